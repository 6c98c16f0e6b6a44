"""``python -m save_io_probe ARGS`` = ``python -m finetune ARGS`` with each rank's save I/O
recorded.

Wraps ``Checkpointer.save`` (``CheckpointManager.save`` in older versions: one of them is in every
version of finetune, so a before/after comparison measures both the same way) and appends one
JSON line per save to
``$SAVE_IO_PROBE_DIR/rank<r>.jsonl``: seconds, and the deltas of /proc/self/io's ``rchar`` (bytes
the process read through read(2)-like calls: files and sockets) and ``read_bytes`` (bytes fetched
from the storage layer) over the save. Used by bench/save/save_io.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _io() -> dict[str, int]:
    lines = Path("/proc/self/io").read_text().splitlines()
    return {k: int(v) for k, v in (line.split(": ") for line in lines)}


def _install() -> None:
    try:  # Checkpointer now; CheckpointManager in older versions
        from finetune.checkpoint.checkpointer import Checkpointer as cls
    except ImportError:
        from finetune.checkpoint.manager import CheckpointManager as cls

    original = cls.save

    def save(self, *args, **kwargs):
        before, start = _io(), time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            seconds, after = time.perf_counter() - start, _io()
            rank = int(os.environ.get("RANK", "0"))
            record = {
                "rank": rank,
                "seconds": seconds,
                "rchar": after["rchar"] - before["rchar"],
                "read_bytes": after["read_bytes"] - before["read_bytes"],
                "wchar": after["wchar"] - before["wchar"],
            }
            out = Path(os.environ["SAVE_IO_PROBE_DIR"])
            out.mkdir(parents=True, exist_ok=True)
            with open(out / f"rank{rank}.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    cls.save = save


if __name__ == "__main__":
    _install()
    try:  # the console entry point: it leaves with os._exit, skipping interpreter teardown,
        from finetune.cli import entry  # which can abort a finished rank (SIGABRT from gloo's
    except ImportError:  # threads; see entry's docstring). Versions before it had only main.
        from finetune.cli import main

        sys.exit(main(sys.argv[1:]))
    entry()
