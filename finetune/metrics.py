"""OUT/metrics.jsonl (rank 0, appended, one JSON object per logged step) and TensorBoard rows."""

from __future__ import annotations

import json
import math
import os
import time
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


EXIT_STATUS = "exit_status.json"
RUN_ID_ENV = "FINETUNE_RUN_ID"


def write_exit_status(output_dir: str, code: int, note: dict | None) -> None:
    """Rank 0: OUT/exit_status.json, replaced atomically, saying how this run ended.

    Job scripts read it because launchers lose the ranks' exit code (torchrun turns any failure
    into 1); ``run_id`` echoes $FINETUNE_RUN_ID so a script can tell this run's file from a stale one.
    """
    status = {"exit_code": code, "reason": "finished" if code == 0 else "failed", **(note or {}),
              "run_id": os.environ.get(RUN_ID_ENV), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    path = Path(output_dir) / EXIT_STATUS
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{EXIT_STATUS}.tmp")
    tmp.write_text(json.dumps(status, indent=2) + "\n")
    os.replace(tmp, path)
