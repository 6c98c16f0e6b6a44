"""What one save cost this rank: phase timings for the log line, and its I/O.

Test seam: ``FINETUNE_SAVE_IO=<dir>`` writes each rank's record to ``<dir>/<tag>-rank<r>.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from finetune import distributed as dist
from finetune.distributed import logger
from finetune.io import seams
from finetune.io.durable import bytes_hashed


class SaveIO:
    """This rank's save I/O: bytes it wrote, bytes our code read back (hash_file), and the
    kernel's read counters for the whole process (/proc/self/io), as deltas over one save."""

    def __init__(self):
        self.start = (_proc_io(), bytes_hashed())

    def finish(self, tag: str, files: dict[str, tuple[int, str]], seconds: float) -> dict:
        (io0, hashed0), io1 = self.start, _proc_io()
        record = {
            "tag": tag,
            "rank": dist.rank(),
            "world_size": dist.world_size(),
            "seconds": round(seconds, 4),
            "own_bytes": sum(size for size, _ in files.values()),
            "hashed_bytes": bytes_hashed() - hashed0,
            **{f"{k}_delta": io1[k] - io0[k] for k in io1 if k in io0},
        }
        folder = seams.value(seams.SAVE_IO)
        if folder:
            try:
                Path(folder).mkdir(parents=True, exist_ok=True)
                (Path(folder) / f"{tag}-rank{dist.rank()}.json").write_text(json.dumps(record))
            except OSError as e:
                logger.warning("%s: %s", seams.SAVE_IO, e)
        return record


def _proc_io() -> dict[str, int]:
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return {}
    return {
        k: int(v)
        for k, v in (line.split(": ") for line in lines)
        if k in ("rchar", "read_bytes", "wchar")
    }


class Clock:
    """Per-phase timings of one save, for the log line."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps: list[tuple[str, float]] = []

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps.append((name, now - self.last))
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.start

    def __str__(self) -> str:
        return " ".join(f"{name} {seconds:.2f}s" for name, seconds in self.laps)


def fmt_bytes(n: int | float) -> str:
    """A size for a log line: MB below a GB (two decimals: a small checkpoint's is not
    "0.01 GB"), else GB."""
    return f"{n / 1e6:.2f} MB" if abs(n) < 1e9 else f"{n / 1e9:.2f} GB"


def space_report(freed: dict[int, tuple[int, int | None]], need: int) -> str:
    """What removing a failed save's staging freed, what is free now and what a save needs, for the
    save's error line. ``freed``: leader rank → (bytes freed, bytes free now or None where the
    free space could not be read); several leaders (node-local storage) are named by rank."""
    parts = []
    for rank, (gone, free) in sorted(freed.items()):
        text = f"removing its staging freed {fmt_bytes(gone)}"
        if free is not None:
            text += f"; {fmt_bytes(free)} free now, a save needs ~{fmt_bytes(need)}"
            if free < need:
                text += " (the next save is refused until space is freed)"
        parts.append(f"rank {rank}: {text}" if len(freed) > 1 else text)
    return "; ".join(parts)


def finished(tag: str, clock: Clock, total: int, own: dict, final: bool) -> str:
    """The log line of a committed save: its time, size, rate, phases and rank 0's own I/O."""
    return (
        f"Finished saving the checkpoint {tag} in {clock.total:.2f} seconds "
        f"({total / 1e6:.1f} MB, {total / 1e6 / max(clock.total, 1e-9):.1f} MB/s; {clock}; rank 0 "
        f"wrote {own['own_bytes'] / 1e6:.1f} MB and read back {own['hashed_bytes'] / 1e6:.2f} MB)"
        f"{' [final]' if final else ''}."
    )
