"""OUT/metrics.jsonl (rank 0, appended, one JSON object per logged step), OUT/events.jsonl (rank 0,
appended, never truncated: the run's start, resumes, checkpoints, failed saves, preemption, end),
and both forwarded to the --report_to trackers (finetune/trackers.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from finetune import distributed as dist
from finetune.trackers import Failures, MonitorTracker, Tracker

if TYPE_CHECKING:
    from deepspeed.monitor.monitor import MonitorMaster

METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"


class MetricsWriter:
    """Called on every rank; only rank 0 writes. A failed write (a full disk) or tracker call is
    logged and dropped instead of raised: rank 0 alone raising here would leave every other rank
    waiting in the next collective, and metrics are not worth a week-long job.

    ``monitor``: DeepSpeed's MonitorMaster (``engine.monitor``; TensorBoard and csv when enabled);
    ``run_id``: this launch's id, in every event; ``trackers``: what ``trackers.open_trackers``
    started (wandb); ``may_write``: False once this run may no longer write into OUT (it lost the
    output dir's lease to another run): every later row, event and tracker call is dropped."""

    def __init__(
        self,
        output_dir: str,
        monitor: MonitorMaster | None = None,
        *,
        run_id: str | None = None,
        trackers: Sequence[Tracker] = (),
        may_write: Callable[[], bool] = lambda: True,
    ):
        self.path = Path(output_dir) / METRICS
        self.events_path = Path(output_dir) / EVENTS
        self.run_id = run_id
        self.trackers: list[Tracker] = list(trackers)
        self.may_write = may_write
        if monitor is not None and monitor.enabled and dist.is_main():
            self.trackers.insert(0, MonitorTracker(monitor, may_write))
        self._failures = {id(t): Failures(t.name) for t in self.trackers}
        self.dropped = 0
        self.closed = False

    def write(self, row: dict) -> None:
        """One metrics row ({"step": N, ...}) to metrics.jsonl and every tracker."""
        if not dist.is_main() or not self.may_write():
            return
        error = _append(self.path, row)
        if error is not None:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                dist.logger.warning(
                    "could not write %s (%s); %d row(s) dropped so far",
                    self.path,
                    error,
                    self.dropped,
                )
        self._forward("write", row)

    def event(self, kind: str, step: int, **fields: object) -> None:
        """One event to events.jsonl and every tracker: {"time", "event": kind, "step", "run_id",
        **fields}. A field named with a trailing underscore (``from_``) is written without it."""
        if not dist.is_main() or not self.may_write():
            return
        record = {
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "event": kind,
            "step": step,
            "run_id": self.run_id,
            **{k.removesuffix("_"): v for k, v in fields.items()},
        }
        error = _append(self.events_path, record)
        if error is not None:
            dist.logger.warning(
                "could not write the %s event of step %d to %s (%s)",
                kind,
                step,
                self.events_path,
                error,
            )
        self._forward("event", record)

    def close(self, exit_code: int = 0) -> None:
        """Flush and finish every tracker (wandb.finish with ``exit_code``);
        once. Not collective."""
        if self.closed or not dist.is_main() or not self.may_write():
            return
        self.closed = True
        self._forward("close", exit_code)

    def _forward(self, method: str, arg: dict | int) -> None:
        for tracker in self.trackers:
            # Third-party code (wandb's service, tensorboard's writer): whatever it raises on rank 0
            # alone is logged, not raised; see the class docstring.
            try:
                getattr(tracker, method)(arg)
            except Exception as e:  # noqa: BLE001 — logged and counted, never raised
                self._failures[id(tracker)].record(method, e)


def _append(path: Path, obj: dict) -> str | None:
    """One JSON line, fsync'd; what went wrong, or None."""
    try:
        line = json.dumps(obj) + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        return None
    except (OSError, TypeError, ValueError) as e:
        return dist.describe_error(e)


def _row(line: str) -> dict | None:
    """The JSON object on ``line``; None for a torn line (a crash mid-append) or anything else."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def json_rows(text: str) -> list[tuple[str, dict]]:
    """(line, row) of every whole JSON object; a torn line (a crash mid-append) is skipped."""
    return [(line, row) for line in text.splitlines() if (row := _row(line)) is not None]


def torn_lines(text: str) -> list[int]:
    """The numbers (from 1) of the lines ``json_rows`` skips: torn by a crash mid-append."""
    return [n for n, line in enumerate(text.splitlines(), 1) if _row(line) is None]


def truncate_after(path: Path, step: int) -> None:
    """Drop rows logged after ``step`` (a crashed run's tail) and torn lines, so the file reads as
    one run. Atomic: temp file, fsync, rename."""
    if not path.exists():
        return
    try:
        kept = [
            line
            for line, row in json_rows(path.read_text())
            if isinstance(row.get("step"), int) and row["step"] <= step
        ]
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        # a directory in its place, a read error: the metrics are not the checkpoint
        dist.logger.warning(
            "could not trim %s to step %d (%s); new rows are appended after what is there",
            path,
            step,
            e,
        )


def read_events(output_dir: str | os.PathLike) -> list[dict]:
    """OUT/events.jsonl's events in file order, torn lines skipped; none when there is no file (runs
    from before it existed) or it cannot be read."""
    try:
        text = (Path(output_dir) / EVENTS).read_text(errors="replace")
    except OSError:  # absent, or a folder in its place
        return []
    return [row for _, row in json_rows(text)]


def read_metrics(output_dir: str) -> list[dict]:
    """OUT/metrics.jsonl's rows, torn lines skipped; none when there is no file."""
    path = Path(output_dir) / METRICS
    if not path.exists():
        return []
    return [row for _, row in json_rows(path.read_text())]
