"""--report_to: the trackers that get the metrics rows and run events besides OUT/metrics.jsonl and
OUT/events.jsonl (metrics.py writes those and forwards to these).

tensorboard, csv: DeepSpeed's own monitor (``engine.monitor``, rank 0 only), switched on in the
DeepSpeed JSON by ds_config (OUT/tensorboard/finetune, OUT/csv/finetune). The engine itself writes
its Train/Samples/* scalars there (learning rate, fp16 loss scale, x = samples seen); MonitorTracker
adds our rows and events, and guards the monitor so that none of its writes can raise (they run on
rank 0 alone, the engine's inside engine.step: a full disk there would leave the other ranks
waiting in the next collective).

wandb: WandbTracker, ours rather than DeepSpeed's WandbMonitor, which calls wandb.init(project,
group, entity) only (no run name, config, dir, or resume of the same run) and logs every scalar with
``step=`` its own x value: the engine's at samples seen, ours at optimizer steps, and wandb drops
any row whose step is below one already logged. Ours logs against a step metric of its own
(``train/global_step``), so a resumed run that repeats a crashed run's last steps, or a background
save committed a few steps after its step, is plotted where it belongs instead of dropped.

Names, the same in every tracker: a row's ``loss`` → ``train/loss``, ``eval_loss`` → ``eval/loss``;
an event → ``events/<kind>`` = its step (wandb also gets ``events/<kind>_<field>`` for its fields).

Every tracker method runs on rank 0 only, and its failures are logged by the caller, never raised
(a tracker is not worth a week-long run); only ``open_trackers``, before training, may fail the
run, and does so on every rank alike.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from finetune import distributed as dist
from finetune.config import ConfigError, RunConfig, report_targets

if TYPE_CHECKING:
    from deepspeed.monitor.monitor import MonitorMaster
    from wandb.sdk.wandb_run import Run as WandbRun

STEP_METRIC = "train/global_step"  # wandb's x axis for everything we log (HF Trainer's name)
WANDB_ID_FILE = "wandb_run_id"  # under OUT: the wandb run a resumed run continues
DEFAULT_WANDB_PROJECT = "finetune"  # when $WANDB_PROJECT is not set
# What each target needs installed, and how to get it.
PACKAGES = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install wandb, or pip install 'finetune[wandb]'"),
}


class Tracker(Protocol):
    name: str

    def write(self, row: dict) -> None: ...

    def event(self, record: dict) -> None: ...

    def close(self, exit_code: int) -> None: ...


def check_available(targets: Iterable[str]) -> str | None:
    """The error line for a --report_to target whose package is not installed, else None. Looks the
    package up without importing it (wandb's import takes a second)."""
    for target in targets:
        if target in PACKAGES:
            package, how = PACKAGES[target]
            if importlib.util.find_spec(package) is None:
                return f"`--report_to {target}`: the {package} package is not installed ({how})"
    return None


def scalars(row: dict) -> dict[str, float]:
    """A metrics row's finite numbers under tracker names (``eval_loss`` → ``eval/loss``, ``loss`` →
    ``train/loss``); the step, None and non-finite values left out."""
    out = {}
    for key, value in row.items():
        if (
            key == "step"
            or isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            continue
        out[f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"] = value
    return out


def event_fields(record: dict) -> dict[str, Any]:
    """An events.jsonl record's own fields: not its time, kind, step or run id."""
    return {k: v for k, v in record.items() if k not in ("time", "event", "step", "run_id")}


class Failures:
    """A tracker's failed calls: the first and every 100th logged with the call and the error."""

    def __init__(self, name: str):
        self.name = name
        self.count = 0

    def record(self, what: str, error: BaseException) -> None:
        self.count += 1
        if self.count == 1 or self.count % 100 == 0:
            dist.logger.warning(
                "%s: %s failed (%s); %d failure(s) so far, training goes on",
                self.name,
                what,
                dist.describe_error(error),
                self.count,
            )


# --- tensorboard, csv: DeepSpeed's monitor -------------------------------------------------------


class MonitorTracker:
    """DeepSpeed's MonitorMaster with TensorBoard and/or csv on rank 0: our rows and events as
    scalars; the monitor's own writes (the engine's too) made unable to raise, and dropped once
    ``may_write`` says this run may no longer write into OUT (a lost lease)."""

    def __init__(self, monitor: MonitorMaster, may_write: Callable[[], bool] = lambda: True):
        self.monitor = monitor
        self.may_write = may_write
        self.name = (
            "+".join(
                n
                for n, m in (("tensorboard", monitor.tb_monitor), ("csv", monitor.csv_monitor))
                if m is not None
            )
            or "DeepSpeed monitor"
        )
        self.failures = Failures(self.name)
        self._write_events = monitor.write_events
        # An instance attribute: engine.step's own self.monitor.write_events(...) comes here too.
        monitor.write_events = self._guarded
        csv = monitor.csv_monitor
        if csv is not None and csv.log_dir:
            # csvMonitor writes a header the first time it sees a file in this process: a resumed
            # run's would land mid-file. Files already there have theirs.
            try:
                csv.filenames.extend(
                    p.stem for p in Path(csv.log_dir).glob("*.csv") if p.stem not in csv.filenames
                )
            except OSError as e:  # rank 0 alone: at worst a second header line
                dist.logger.warning("could not list %s (%s)", csv.log_dir, e)

    def _guarded(self, events: list) -> None:
        # Third-party writers (tensorboard's event file thread, csv files): whatever they raise, on
        # rank 0 alone, must not end the run; OSError is the usual one (a full disk).
        if not self.may_write():
            return
        try:
            self._write_events(events)
        except Exception as e:  # noqa: BLE001 — logged, counted; see above
            self.failures.record("writing scalars", e)

    def write(self, row: dict) -> None:
        step = row["step"]
        self.monitor.write_events([(name, float(v), step) for name, v in scalars(row).items()])

    def event(self, record: dict) -> None:
        step = record["step"]
        self.monitor.write_events([(f"events/{record['event']}", float(step), step)])

    def close(self, exit_code: int) -> None:
        if self.monitor.tb_monitor is not None:
            self.monitor.tb_monitor.flush()


# --- wandb ---------------------------------------------------------------------------------------


class WandbTracker:
    """One wandb run, on rank 0: named, with the resolved flags as its config, files under OUT, the
    same run continued when the training run resumes (its id kept in OUT/wandb_run_id)."""

    name = "wandb"

    def __init__(self, run: WandbRun):
        self.run = run
        self.last_step = 0

    @classmethod
    def start(cls, out: Path, name: str, config: dict, run_id: str, resumed: bool) -> WandbTracker:
        """wandb.init: project $WANDB_PROJECT (default "finetune"), files under $WANDB_DIR or OUT;
        the id: $WANDB_RUN_ID, else the one OUT/wandb_run_id names when resuming, else ``run_id``.
        Not being logged in is bad input (ConfigError); other failures raise as they are."""
        import wandb

        id_file = out / WANDB_ID_FILE
        wandb_id = (
            os.environ.get("WANDB_RUN_ID") or (_read_id(id_file) if resumed else None) or run_id
        )
        try:
            run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or DEFAULT_WANDB_PROJECT,
                name=name,
                id=wandb_id,
                resume="allow",
                config=config,
                dir=os.environ.get("WANDB_DIR") or str(out),
            )
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:
            text = (str(e).strip().splitlines() or [type(e).__name__])[0]
            login = isinstance(e, wandb.errors.AuthenticationError) or "api_key" in text
            raise ConfigError(
                f"`--report_to wandb`: {text}"
                + (" (run `wandb login`, or set WANDB_MODE=offline)" if login else "")
            ) from None
        run.define_metric(STEP_METRIC)
        run.define_metric("*", step_metric=STEP_METRIC, step_sync=True)
        try:
            from finetune.io.durable import replace_text

            replace_text(id_file, run.id + "\n")
        except OSError as e:  # the run goes on; only a resume would start a new wandb run
            dist.logger.warning(
                "could not write %s (%s); a resumed run will log to a new wandb run", id_file, e
            )
        return cls(run)

    def write(self, row: dict) -> None:
        step = row["step"]
        self.last_step = max(self.last_step, step)
        self.run.log({**scalars(row), STEP_METRIC: step})

    def event(self, record: dict) -> None:
        kind = record["event"]
        step = record["step"]
        data = {f"events/{kind}": step}
        data.update(
            (f"events/{kind}_{k}", v)
            for k, v in event_fields(record).items()
            if isinstance(v, (str, int, float, bool))
        )
        # At its step, or later (a background save commits a few steps after it was taken): the
        # step metric's summary stays the newest step.
        self.run.log({**data, STEP_METRIC: max(step, self.last_step)})
        if kind == "preempted":
            self.run.mark_preempting()  # wandb shows it preempted, not crashed

    def close(self, exit_code: int) -> None:
        import wandb

        self.run.finish(exit_code=exit_code)
        # finish() can return before wandb's service process has written the run's last records
        # (offline: run-<id>.wandb still empty, seen in 1 of 15 runs); teardown waits for that
        # process to exit. wandb's own atexit hook would do it, but the CLI ends with os._exit.
        try:
            wandb.teardown(exit_code)
        except SystemExit as e:  # how teardown reports the service's own failure: not our exit
            raise RuntimeError(f"wandb's service process exited with {e.code}") from None


def _read_id(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None  # absent (the run before did not use wandb), unreadable: a new wandb run


def run_name(cfg: RunConfig) -> str:
    """--run_name, else the output dir's folder name."""
    return cfg.train.run_name or Path(cfg.ckpt.output_dir).resolve().name


def tracker_config(cfg: RunConfig) -> dict:
    """What trackers record as the run's config: the resolved flags, world size, DeepSpeed JSON."""
    return {**cfg.to_json_dict(), "world_size": cfg.world_size, "deepspeed": cfg.ds_config}


def open_trackers(cfg: RunConfig, run_id: str, resumed: bool) -> list[Tracker]:
    """The trackers of --report_to that finetune starts itself (wandb; DeepSpeed's monitor starts
    inside deepspeed.initialize): on rank 0, empty elsewhere. Collective: every rank calls it, and
    a failure (not logged in to wandb) raises on every rank."""
    if "wandb" not in report_targets(cfg.train.report_to):
        return []

    def start() -> WandbTracker:
        out = Path(cfg.ckpt.output_dir)
        return WandbTracker.start(out, run_name(cfg), tracker_config(cfg), run_id, resumed)

    tracker = dist.run_agreed(start, on=dist.is_main())
    if tracker is not None:
        dist.logger.info(
            "wandb run %s (%s), files in %s", tracker.run.id, tracker.run.name, tracker.run.dir
        )
    return [tracker] if tracker is not None else []
