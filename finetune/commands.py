"""What every ``finetune`` command shares: its argument parser, and the table of subcommands.

Each subcommand is a module with ``main(argv) -> int`` that builds its own ``Parser``; it is named
in ``SUBCOMMANDS`` and imported only when run (``finetune ls`` never imports torch's training
stack). This module imports nothing above it, so a subcommand's module never imports the CLI back.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
from collections.abc import Callable

# name → the module whose main(argv) runs it
SUBCOMMANDS: dict[str, str] = {
    "verify": "finetune.offline.verify",
    "export": "finetune.offline.export",
    "ls": "finetune.listing",
    "plot": "finetune.plot",
    "env": "finetune.environment",
}


def subcommand(name: str) -> Callable[[list[str]], int]:
    """The entry point of subcommand ``name``, importing its module when called."""

    def run(argv: list[str]) -> int:
        return importlib.import_module(SUBCOMMANDS[name]).main(argv)

    run.__name__ = f"finetune {name}"
    return run


class Parser(argparse.ArgumentParser):
    """argparse that reports usage errors once (rank 0), not once per rank.

    No abbreviated flags: `--output` would silently be --output_dir to training but not to the
    job scripts, which read --output_dir from the same arguments (finetune.exit_status).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            message += self._suggestions(message.split(": ", 1)[1].split())
        if int(os.environ.get("RANK", "0")) == 0:  # the process group may not exist yet
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

    def _suggestions(self, unknown: list[str]) -> str:
        """'; did you mean --learning_rate?' for the unknown flags that are close to a real one."""
        known = [s for a in self._actions if a.help != argparse.SUPPRESS for s in a.option_strings]
        pairs = [
            (flag, close[0])
            for flag in (t.split("=", 1)[0] for t in unknown if t.startswith("-"))
            if (close := difflib.get_close_matches(flag, known, n=1))
        ]
        if not pairs:
            return ""
        if len(pairs) == 1:
            return f"; did you mean {pairs[0][1]}?"
        return "; did you mean " + ", ".join(f"{good} (for {bad})" for bad, good in pairs) + "?"
