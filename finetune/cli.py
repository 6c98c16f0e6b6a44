"""Command line → typed config. The only module that sees an argparse Namespace.

``finetune [flags]`` trains; ``finetune COMMAND …`` runs a subcommand. The train parser is built
from the config dataclasses' fields; its Namespace becomes a plain dict of flag values that
``resolve.resolve`` validates and reconciles. Usage errors exit 2 with one line naming the flag or
file, before any heavy work and before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from finetune import __version__, console, run_config
from finetune import distributed as dist
from finetune.commands import SUBCOMMANDS, Parser, subcommand
from finetune.config import GROUPS, ConfigError, RunConfig, precision_shorthand
from finetune.ops import use_venv_extensions_dir
from finetune.preemption import release_early
from finetune.resolve import resolve


def _help(f: dataclasses.Field) -> str:
    text = f.metadata["help"]
    if f.default is not None and f.default is not False:
        text += f" (default: {f.default})"
    return text.replace("%", "%%")


def build_train_parser() -> argparse.ArgumentParser:
    """The training flags, one per config field. A flag not given is absent from the Namespace
    (argument_default=SUPPRESS), so a --config file's value shows through where no
    flag overrides it."""
    p = Parser(
        prog="finetune",
        argument_default=argparse.SUPPRESS,
        description="ZeRO-3 fine-tuning of HuggingFace causal LMs with DeepSpeed. With no flags: "
        "trains the embedded tiny model on bundled data. Commands: "
        + ", ".join(f"finetune {c}" for c in SUBCOMMANDS)
        + " (each with --help).",
    )
    p.add_argument("--version", action="version", version=f"finetune {__version__}")
    p.add_argument(
        "--config",
        metavar="FILE",
        help="A .yaml or .json file of training flags (keys are the flag names without --, e.g. "
        "learning_rate: 2.0e-5); flags on the command line override it. Every run writes its "
        "resolved flags to OUT/run_config.yaml, which this takes to run it again.",
    )
    for title, cls in GROUPS:
        group = p.add_argument_group(f"{title} arguments")
        for f in dataclasses.fields(cls):
            flag = f"--{f.name}"
            if f.type in (bool, "bool", "bool | None"):
                group.add_argument(flag, action="store_true", help=_help(f))
                # Every switch can be turned off too: to override a --config file that turns it on.
                group.add_argument(
                    f"--no_{f.name}",
                    action="store_false",
                    dest=f.name,
                    help=f"Turn off --{f.name}." if f.default is not False else argparse.SUPPRESS,
                )
                continue
            group.add_argument(
                flag,
                type=_scalar_type(f),
                choices=f.metadata.get("choices"),
                help=_help(f),
                metavar=f.name.upper(),
                nargs=f.metadata.get("nargs"),
            )
    # "argument --fp16: not allowed with argument --bf16"
    shorthand = p.add_mutually_exclusive_group()
    shorthand.add_argument(
        "--bf16",
        action="store_const",
        const="bf16",
        dest="precision_alias",
        help="Shorthand for --precision bf16.",
    )
    shorthand.add_argument(
        "--fp16",
        action="store_const",
        const="fp16",
        dest="precision_alias",
        help="Shorthand for --precision fp16.",
    )
    # The DeepSpeed launcher appends --local_rank; the environment already carries it.
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return p


def _scalar_type(f: dataclasses.Field) -> Callable[[str], Any]:
    t = str(f.type)
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def parse_train_args(argv: list[str]) -> RunConfig:
    """Flags over --config file over defaults, then validated and reconciled (resolve.resolve)."""
    given = vars(build_train_parser().parse_args(argv))
    alias = given.pop("precision_alias", None)
    given.pop("local_rank", None)
    config_file = given.pop("config", None)
    values = (
        {**run_config.overridden(run_config.load(config_file), given), **given}
        if config_file
        else given
    )
    values["precision"], precision_flag = precision_shorthand(
        values.get("precision", "auto"), alias
    )
    return resolve(values, precision_flag)


# --- subcommands ---------------------------------------------------------------------------


def _train(argv: list[str]) -> int:
    cfg = parse_train_args(argv)
    console.quiet(level=cfg.train.log_level)  # a --config file's log_level, now that it is read
    from finetune.run import run

    return run(cfg)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": _train,
    **{name: subcommand(name) for name in SUBCOMMANDS},
}


def _command(argv: list[str]) -> str:
    """The subcommand ``argv`` starts with (removed from it); "train" when it starts with a flag."""
    if argv and argv[0] in COMMANDS:
        return argv.pop(0)
    if argv and not argv[0].startswith("-"):
        # Training takes no positional arguments: a bare word is a mistyped command.
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(
            f"unknown command '{argv[0]}'{hint}; commands: {', '.join(sorted(COMMANDS))} "
            "(or flags alone, to train)"
        )
    return "train"


def entry() -> None:
    """``finetune`` and ``python -m finetune``: run ``main``, then leave without
    interpreter teardown.

    Everything a run writes is flushed and closed by then (checkpoints, metrics, exit_status.json,
    TensorBoard events, the lease). Teardown itself can abort a finished rank with SIGABRT
    ("terminate called without an active exception": gloo's C++ worker threads still holding
    tensors while the interpreter is finalised, pytorch/pytorch#179291), seen once in ~330 runs
    here after a clean destroy_process_group; the launcher would then report a failure for a run
    that succeeded (or hide its real exit code).
    """
    try:
        code = main()
    except SystemExit as e:  # argparse's --help / usage errors
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # a crash: the traceback, exit 1, and no teardown either (it aborted
        traceback.print_exc()  # a crashing rank with SIGABRT in CI: exit -6 where 1 is documented)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    console.quiet(argv)  # before DeepSpeed is imported: it logs while the flags are checked
    use_venv_extensions_dir()  # before DeepSpeed loads an op
    dist.adopt_launcher_env()
    try:
        command = _command(argv)
        if command != "train":
            release_early()  # only training treats SIGTERM/SIGUSR1 as "save and stop"
        return COMMANDS[command](argv)
    except ConfigError as e:
        if dist.rank() == 0:
            print(f"finetune: error: {e}", file=sys.stderr)
        return 2
