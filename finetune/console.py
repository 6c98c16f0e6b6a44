"""What a run prints: our dependencies' known noise filtered, their loggers at --log_level.

At the default level (warning) a 2-rank run otherwise shows, before its first step, a torch
FutureWarning per rank for each deprecated collective DeepSpeed still calls, DeepSpeed's "Setting
accelerator to CPU" once per process and its "…shm_comm_op built successfully" print per rank
(and with --use_peft, a transformers FutureWarning per rank for a property peft reads).
Each is a fact about our dependencies that the user cannot act on, repeated N times. What is
filtered is listed here by exact message, so a new warning, or one of these from a different
place, still shows. ``--log_level info|debug`` filters nothing and raises DeepSpeed's, transformers'
and datasets' loggers to that level.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator

LEVELS = ("warning", "info", "debug")

# torch 2.13 deprecates the *_tensor collectives DeepSpeed 0.19 calls (all_gather_into_tensor,
# reduce_scatter_tensor); each fires once per process, from torch's c10d_logger wrapper.
_DEPRECATED_COLLECTIVE = (
    r"`torch\.distributed\.\w+` is deprecated\. Please use `torch\.distributed\.\w+` instead\."
)
# peft 0.21 reads transformers' deprecated model.is_gradient_checkpointing when it wraps a model
# (--use_peft), once per process.
_DEPRECATED_BY_PEFT = (
    r"`is_gradient_checkpointing` is deprecated and will be removed in v6\. Use "
    r"`is_activation_checkpointing` instead\."
)
# DeepSpeed's accelerator detection, once per process; on ranks other than 0 it only repeats rank 0.
_PER_PROCESS = (
    "Setting accelerator to CPU. If you have GPU or other "
    "accelerator, we were unable to detect it.",
)
_BUILT = re.compile(r"^DeepSpeed \S+ built successfully$")


def _level_from_argv(argv: list[str]) -> str:
    """--log_level as the command line gives it, before parsing: DeepSpeed is imported (and logs)
    while the flags are validated, so the filters must be in place first."""
    for i, arg in enumerate(argv):
        if arg == "--log_level" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--log_level="):
            return arg.split("=", 1)[1]
    return "warning"


class _Repeats(logging.Filter):
    """Drops DeepSpeed's per-process messages on every rank but 0 (rank 0 still shows them once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.getMessage() in _PER_PROCESS and os.environ.get("RANK", "0") != "0")


_repeats = _Repeats()


def quiet(argv: list[str] | None = None, level: str | None = None) -> None:
    """Install the filters and set the dependencies' log levels. Idempotent; call before DeepSpeed
    is imported (its loggers are looked up by name, so they keep what is set here)."""
    level = level or _level_from_argv(list(sys.argv[1:] if argv is None else argv))
    if level not in LEVELS:
        level = "warning"  # the parser names the bad value later
    verbose = level != "warning"
    ds = logging.getLogger("DeepSpeed")
    for message in (_DEPRECATED_COLLECTIVE, _DEPRECATED_BY_PEFT):
        warnings.filterwarnings(
            "default" if verbose else "ignore", message=message, category=FutureWarning
        )
    if verbose:
        ds.removeFilter(_repeats)
    else:
        ds.addFilter(_repeats)
    numeric = getattr(logging, level.upper())
    # DeepSpeed's factory sets its logger's level when first imported; set again once it is.
    if "deepspeed" in sys.modules:
        ds.setLevel(numeric)
        for handler in ds.handlers:  # its stdout handler has the same level of its own
            handler.setLevel(numeric)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", level)
    os.environ.setdefault("DATASETS_VERBOSITY", level)
    for name in ("transformers", "datasets"):
        if name in sys.modules:
            logging.getLogger(name).setLevel(numeric)
    logging.getLogger("finetune").setLevel(logging.DEBUG if level == "debug" else logging.INFO)


@contextlib.contextmanager
def swallow_build_notice() -> Iterator[None]:
    """DeepSpeed prints "DeepSpeed …shm_comm_op built successfully" on every rank when it loads
    its CPU all-reduce op (deepspeed.init_distributed); anything else printed there passes."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        kept = [line for line in captured.getvalue().splitlines() if not _BUILT.match(line)]
        if kept:
            print("\n".join(kept), flush=True)
