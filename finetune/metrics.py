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

    def write(self, row: dict) -> None:
        """Called on every rank; only rank 0 writes."""
        if self.monitor is not None and self.monitor.enabled:
            step = row["step"]
            self.monitor.write_events([(f"finetune/{k}", float(v), step) for k, v in row.items()
                                       if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)])
        if not dist.is_main():
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_metrics(output_dir: str) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
