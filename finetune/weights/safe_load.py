"""Reading DeepSpeed's rank files without running code from them.

A ``.pt`` file is a pickle, and unpickling a pickle calls whatever functions it names:
``torch.load(weights_only=False)``, what DeepSpeed itself uses, runs code chosen by whoever wrote
the file. So a checkpoint from someone else is as trustworthy as a script from them. Every rank
file we read is loaded with ``torch.load(weights_only=True)`` instead: torch's restricted unpickler
builds tensors, plain containers and torch's own types, plus exactly the classes allowed below;
anything else fails closed, naming the class (``UnsafePickle``).

The allow-list is what DeepSpeed 0.19 pickles into a ZeRO-3 checkpoint beyond torch's defaults,
found by listing every global in checkpoints of each configuration we ship (fp32 and bf16; ZeRO-3
with and without CPU offload; FusedAdam, DeepSpeedCPUAdam and torch AdamW; HF and DeepSpeed LR
schedulers; consolidated or not) with ``torch.serialization.get_unsafe_globals_in_checkpoint``:

  deepspeed.runtime.zero.config.ZeroStageEnum         optim files: ``zero_stage``, an int enum
                                                      rebuilt from its value (``ZeroStageEnum(3)``)
  deepspeed.runtime.fp16.loss_scaler.LossScaler       optim files: ``loss_scaler`` (fp32, bf16:
                                                      a static scale); attributes only, no code
  deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler  the same under fp16 (its ``dtype`` is a
                                                      torch dtype, allowed by torch already)

Everything else in those files is torch's default set: ``collections.OrderedDict``, ``torch.Size``,
typed storages, ``torch._utils._rebuild_tensor_v2``, and ``torch._tensor._rebuild_from_type_v2``
with ``torch.Tensor`` (DeepSpeed's flat fp32 partitions carry a ``ds_id`` attribute). The model
states, LR scheduler state (HF's LambdaLR stores no functions), our RNG files and DeepSpeed's
``ds_config`` are plain data.

``inert=True`` (export) builds the DeepSpeed classes as placeholders that only keep their
arguments and state, so reading a checkpoint never imports DeepSpeed; otherwise (resume, through
the checkpoint engine's ``load``) they are DeepSpeed's own classes, which its ``load_checkpoint``
needs. ``check_globals``/``refusals`` read a file's pickle opcodes without unpickling anything (for
verification: every rank refuses alike, before a load); ``run_module`` runs DeepSpeed's
ds_to_universal with every ``torch.load`` in it restricted.

Used wherever a rank file is read: resume (the checkpoint engine in checkpoint/writer.py, and
checkpoint/resume.py), the exports (zero_files.py), the universal conversion (universal.py), and
``finetune verify`` and ``finetune ls --verify`` (opcodes only).
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.serialization import MAP_LOCATION

from finetune.config import ConfigError

_TORCH_LOAD = torch.load  # before run_module replaces it

DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
)


class UnsafePickle(ConfigError):
    """A rank file names something outside the allow-list (or is not a torch file): not loaded."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"{path}: {reason}")
        self.reason = reason


class Placeholder:
    """Stands in for one of DeepSpeed's classes when loading ``inert``: keeps the constructor
    arguments (an enum's value: ``args[0]``) and the pickled state, runs nothing."""

    def __new__(cls, *args: object, **kwargs: object) -> Placeholder:
        return super().__new__(cls)

    def __init__(self, *args: object, **kwargs: object):
        self.args = args

    def __setstate__(self, state: object) -> None:
        self.state = state


_PLACEHOLDERS = {
    name: type(name.rsplit(".", 1)[1], (Placeholder,), {"__module__": name.rsplit(".", 1)[0]})
    for name in DEEPSPEED_GLOBALS
}


def allowed_globals(inert: bool = False) -> list[tuple[type, str]]:
    """``(class, pickled name)`` pairs for ``torch.serialization.safe_globals``."""
    if inert:
        return [(cls, name) for name, cls in _PLACEHOLDERS.items()]
    found = []
    for name in DEEPSPEED_GLOBALS:
        module, attr = name.rsplit(".", 1)
        found.append((getattr(importlib.import_module(module), attr), name))
    return found


def load(
    path: str | os.PathLike,
    map_location: MAP_LOCATION = None,
    *,
    mmap: bool = False,
    inert: bool = False,
) -> Any:
    """``torch.load`` of a DeepSpeed rank file, restricted to tensors, plain data and the
    allow-list. Raises ``UnsafePickle`` naming the file and the refused class. The signature of
    DeepSpeed's ``CheckpointEngine.load`` (``path, map_location``), so a checkpoint engine can
    delegate to it."""
    try:
        with torch.serialization.safe_globals(allowed_globals(inert)):
            return _TORCH_LOAD(path, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refusal(path, refused(str(e))) from e


def _refusal(path: str | os.PathLike, what: str) -> UnsafePickle:
    return UnsafePickle(
        path,
        f"refused to unpickle {what}: not on the allow-list of what DeepSpeed pickles "
        "into a checkpoint (finetune/weights/safe_load.py); loading it could run code",
    )


def refused(message: str) -> str:
    """The global torch's restricted unpickler refused, from its error message."""
    for pattern in (
        r"GLOBAL (\S+) was not an allowed global",
        r"unsupported GLOBAL (\S+) whose module",
        r"unrecognized function (.+?)(?: which belongs|$)",
        r"but got (<class [^>]+>)",
    ):
        m = re.search(pattern, message, re.MULTILINE)
        if m:
            return m.group(1)
    lines = [line for line in message.splitlines() if line.strip()]
    return f"what it holds ({lines[-2] if len(lines) > 1 else message})"


def check_globals(path: str | os.PathLike) -> None:
    """Refuse (``UnsafePickle``) a file that names anything beyond torch's defaults and the
    allow-list, found by reading its pickle's opcodes: nothing is unpickled. For a file that a tool
    of DeepSpeed's is about to load, so the refusal is ours, one line, naming the class."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(Path(path))
    except (
        RuntimeError,
        ValueError,
        OSError,
        EOFError,
        zipfile.BadZipFile,
        pickle.UnpicklingError,
    ) as e:
        raise UnsafePickle(
            path, f"not a torch file that can be read safely ({type(e).__name__}: {e})"
        ) from e
    unsafe = sorted(g for g in found if g not in DEEPSPEED_GLOBALS)
    if unsafe:
        raise _refusal(path, ", ".join(unsafe))


RANK_FILES = (
    "zero_pp_rank_{r}_mp_rank_00_model_states.pt",
    "zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
    "bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
)


def refusals(folder: str | os.PathLike, ranks: list[int]) -> list[str]:
    """What ``check_globals`` refuses in these ranks' DeepSpeed files of ``folder`` (those present),
    one line each: for a resume's verification, so a checkpoint naming a class off the list is
    skipped or refused by every rank alike, before DeepSpeed unpickles anything."""
    found = []
    for r in ranks:
        for pattern in RANK_FILES:
            path = Path(folder) / pattern.format(r=r)
            if not path.is_file():
                continue
            try:
                check_globals(path)
            except UnsafePickle as e:
                found.append(f"{path.name}: {e.reason}")
    return found


# --- DeepSpeed's own tools, run with every torch.load restricted --------------------------------


def _restricted_torch_load(
    f: str | os.PathLike,
    map_location: MAP_LOCATION = None,
    pickle_module: object = None,
    *,
    weights_only: bool | None = None,
    mmap: bool | None = None,
    **kwargs: object,
) -> Any:
    """``torch.load`` as DeepSpeed's tools call it, whatever ``weights_only`` they ask for."""
    return load(f, map_location, mmap=bool(mmap))


def run_module(module: str, argv: list[str]) -> None:
    """Run ``python -m MODULE ARGV`` (DeepSpeed's ds_to_universal) with every ``torch.load`` in it
    restricted to the allow-list: the tool itself passes ``weights_only=False``. Its worker
    processes are forked, so they inherit the restriction."""
    import multiprocessing
    import runpy
    import sys

    # a spawned worker would import torch.load afresh
    multiprocessing.set_start_method("fork", force=True)
    torch.load = _restricted_torch_load
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    import sys

    run_module(sys.argv[1], sys.argv[2:])
