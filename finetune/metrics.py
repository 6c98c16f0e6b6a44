"""OUT/metrics.jsonl (rank 0, appended, one JSON object per logged step) and TensorBoard rows."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from finetune import distributed as dist


class MetricsWriter:
    def __init__(self, output_dir: str, monitor=None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.monitor = monitor  # DeepSpeed's MonitorMaster: writes only on rank 0 itself
        self.dropped = 0

    def write(self, row: dict) -> None:
        """Called on every rank; only rank 0 writes. A failed write (a full disk) drops the row
        with a warning instead of raising: rank 0 alone raising here would leave every other
        rank waiting in the next collective, and metrics are not worth a week-long job."""
        if self.monitor is not None and self.monitor.enabled:
            step = row["step"]
            self.monitor.write_events([(f"finetune/{k}", float(v), step) for k, v in row.items()
                                       if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)])
        if not dist.is_main():
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except (OSError, TypeError, ValueError) as e:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                dist.logger.warning("could not write %s (%s: %s); %d row(s) dropped so far", self.path,
                                    type(e).__name__, e, self.dropped)


def _rows(text: str) -> list[tuple[str, dict]]:
    """(line, row) of every whole JSON object; a torn line (a crash mid-append) is skipped."""
    out = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append((line, row))
    return out


def truncate_after(path: Path, step: int) -> None:
    """Drop rows logged after ``step`` (a crashed run's tail) and torn lines, so the file reads as
    one run. Atomic: temp file, fsync, rename."""
    if not path.exists():
        return
    try:
        kept = [line for line, row in _rows(path.read_text()) if isinstance(row.get("step"), int) and row["step"] <= step]
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # a directory in its place, a read error: the metrics are not the checkpoint
        dist.logger.warning("could not trim %s to step %d (%s); new rows are appended after what is there", path, step, e)


def read_metrics(output_dir: str) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [row for _, row in _rows(path.read_text())]
