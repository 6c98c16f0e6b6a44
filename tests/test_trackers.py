"""--report_to's trackers and OUT/events.jsonl, in one process (world size 1, no launcher): wandb
offline (its run files read back), DeepSpeed's TensorBoard and csv monitors (their files read back),
failures that must never raise, and the flag's checks."""

from __future__ import annotations

import csv
import json
import logging
import struct
import time
from pathlib import Path

import pytest

from finetune import trackers
from finetune.config import ConfigError
from finetune.metrics import EVENTS, MetricsWriter, read_metrics, truncate_after
from finetune.resolve import resolve

TRAIN = [
    {
        "step": s,
        "epoch": 0.1 * s,
        "loss": 3.0 / s,
        "lr": 1e-3,
        "grad_norm": None,
        "tokens_per_s": 100.0 + s,
    }
    for s in (1, 2, 3)
]
EVAL = {"step": 0, "eval_loss": 4.5, "eval_perplexity": 90.0, "eval_tokens": 77}


# --- reading what wandb wrote offline ------------------------------------------------------------


def wandb_records(run_dir: Path) -> list:
    """The records of an offline run's run-<id>.wandb: wandb's LevelDB-log framing (a 7-byte file
    header, 32 KiB blocks of chunks: crc32, length, type FULL/FIRST/MIDDLE/LAST) around protobuf
    Records. wandb ships no Python reader of it any more (its core is in Go)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data, pos, block, parts, records = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            parts = chunk
        elif kind in (3, 4):
            parts += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            records.append(record)
    return records


def read_wandb_run(run_dir: Path) -> dict:
    """{"id", "name", "project", "config" (top-level keys → values), "history" (one dict per
    logged row, keys → values), "exit_code"} of an offline run folder."""
    out: dict = {"history": [], "exit_code": None}
    for record in wandb_records(run_dir):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            out.update(
                id=run.run_id,
                name=run.display_name,
                project=run.project,
                config={u.key: json.loads(u.value_json) for u in run.config.update},
            )
        elif kind == "history":
            out["history"].append(
                {
                    "/".join(i.nested_key) or i.key: json.loads(i.value_json)
                    for i in record.history.item
                }
            )
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    return out


def offline_runs(out: Path) -> list[Path]:
    return sorted((out / "wandb").glob("offline-run-*"))


def history_at(history: list[dict], key: str) -> dict[int, object]:
    """{train/global_step: value} of ``key`` over the logged rows."""
    return {row[trackers.STEP_METRIC]: row[key] for row in history if key in row}


@pytest.fixture
def wandb_offline(monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install -e .[test])")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_NAME", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)


def run_config(out: Path, report_to: str, **flags):
    return resolve({"output_dir": str(out), "report_to": report_to, **flags}, world_size=1)


# --- wandb ----------------------------------------------------------------------------------------


def test_wandb_offline_run_has_name_config_history_and_events(tmp_path, wandb_offline):
    out = tmp_path / "out"
    out.mkdir()
    cfg = run_config(out, "wandb", run_name="my-run", learning_rate=1e-3)
    opened = trackers.open_trackers(cfg, "run1abc", resumed=False)
    assert [t.name for t in opened] == ["wandb"]
    metrics = MetricsWriter(str(out), run_id="run1abc", trackers=opened)
    metrics.event("start", 0, world_size=1, run_name="my-run")
    metrics.write(EVAL)
    for row in TRAIN:
        metrics.write(row)
        if row["step"] == 2:
            metrics.event("checkpoint", 2, tag="global_step2", consolidated=False)
    metrics.event("end", 3, exit_code=0)
    metrics.close(0)

    (run_dir,) = offline_runs(out)
    run = read_wandb_run(run_dir)
    assert (run["id"], run["name"], run["project"]) == ("run1abc", "my-run", "finetune")
    assert (out / trackers.WANDB_ID_FILE).read_text().strip() == "run1abc"
    assert {"model", "data", "train", "ckpt", "world_size", "deepspeed"} <= set(run["config"])
    assert (
        run["config"]["train"]["learning_rate"] == 1e-3
        and run["config"]["train"]["report_to"] == "wandb"
    )
    history = run["history"]
    assert history_at(history, "train/loss") == {1: 3.0, 2: 1.5, 3: 1.0}
    assert history_at(history, "eval/loss") == {0: 4.5}
    assert "train/grad_norm" not in {k for row in history for k in row}  # None is left out
    assert history_at(history, "events/checkpoint") == {2: 2}
    assert history_at(history, "events/checkpoint_tag") == {2: "global_step2"}
    assert history_at(history, "events/end_exit_code") == {3: 0}
    assert run["exit_code"] == 0
    # events.jsonl has them too, whatever the trackers
    assert [e["event"] for e in read_events(out)] == ["start", "checkpoint", "end"]


def test_wandb_resumed_run_continues_the_same_wandb_run(tmp_path, wandb_offline):
    """Resuming: the id in OUT/wandb_run_id (each launch has its own finetune run id); a fresh start
    in the same OUT: a new wandb run. A late (background) commit is logged at the newest step."""
    out = tmp_path / "out"
    out.mkdir()
    cfg = run_config(out, "wandb")

    def launch(run_id: str, resumed: bool, steps: list[int]) -> dict:
        # wandb names an offline run's folder by its start second and id: two launches of one id
        # within a second would share it (a real resume is never that quick).
        time.sleep(1.05 - time.time() % 1)
        metrics = MetricsWriter(
            str(out), run_id=run_id, trackers=trackers.open_trackers(cfg, run_id, resumed)
        )
        for s in steps:
            metrics.write({"step": s, "loss": 1.0 / s})
        metrics.event("checkpoint", steps[0], tag=f"global_step{steps[0]}")  # committed later
        metrics.event("preempted", steps[-1], signal="SIGTERM")
        metrics.close(75)
        (mine,) = [p for p in offline_runs(out) if p.name not in seen]
        seen.add(mine.name)
        return read_wandb_run(mine)

    seen: set[str] = set()

    first = launch("first1", False, [1, 2])
    again = launch("second2", True, [2, 3])  # resumes step 2's checkpoint: step 2 logged again
    fresh = launch("third3", False, [1])
    assert first["id"] == again["id"] == "first1" and fresh["id"] == "third3"
    assert history_at(again["history"], "train/loss") == {2: 0.5, 3: 1.0 / 3}
    # x = the newest step; value = its step
    assert history_at(again["history"], "events/checkpoint") == {3: 2}
    assert again["exit_code"] == 75
    assert len(offline_runs(out)) == 3  # wandb offline: one folder per launch (`wandb sync` each)
    assert (out / trackers.WANDB_ID_FILE).read_text().strip() == "third3"


def test_wandb_not_logged_in_is_bad_input(tmp_path, wandb_offline, monkeypatch):
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError(
            "api_key not configured (no-tty). call wandb.login(key=[your_api_key])"
        )

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(
        ConfigError, match=r"`--report_to wandb`: api_key not configured .*WANDB_MODE=offline"
    ):
        trackers.open_trackers(run_config(tmp_path, "wandb"), "r", resumed=False)
    assert not (tmp_path / trackers.WANDB_ID_FILE).exists()


def test_no_trackers_without_report_to(tmp_path):
    assert trackers.open_trackers(run_config(tmp_path, "none"), "r", resumed=False) == []
    assert trackers.open_trackers(run_config(tmp_path, "tensorboard,csv"), "r", resumed=False) == []


# --- DeepSpeed's monitor: TensorBoard, csv -------------------------------------------------------


@pytest.fixture
def ds_rank0(monkeypatch):
    """DeepSpeed's monitors ask deepspeed.comm for the rank: rank 0 of an uninitialized world."""
    import deepspeed.comm

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda group=None: 0)


def monitor_for(cfg):
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.monitor import MonitorMaster

    return MonitorMaster(get_monitor_config(cfg.ds_config))


def csv_rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_and_csv_through_deepspeeds_monitor(tmp_path, ds_rank0):
    out = tmp_path / "out"
    cfg = run_config(out, "tensorboard,csv")
    assert cfg.ds_config["tensorboard"] == {
        "enabled": True,
        "output_path": str(out / "tensorboard"),
        "job_name": "finetune",
    }
    assert cfg.ds_config["csv_monitor"] == {
        "enabled": True,
        "output_path": str(out / "csv"),
        "job_name": "finetune",
    }
    monitor = monitor_for(cfg)
    metrics = MetricsWriter(str(out), monitor, run_id="r1")
    assert [t.name for t in metrics.trackers] == ["tensorboard+csv"]
    monitor.write_events([("Train/Samples/lr", 1e-3, 16)])  # what engine.step writes itself
    metrics.write(EVAL)
    for row in TRAIN:
        metrics.write(row)
    metrics.event("checkpoint", 3, tag="global_step3")
    metrics.close(0)

    folder = out / "csv" / "finetune"
    assert csv_rows(folder / "train_loss.csv") == [
        ["step", "loss"],
        ["1", "3.0"],
        ["2", "1.5"],
        ["3", "1.0"],
    ]
    assert csv_rows(folder / "eval_loss.csv") == [["step", "loss"], ["0", "4.5"]]
    assert csv_rows(folder / "events_checkpoint.csv") == [["step", "checkpoint"], ["3", "3.0"]]
    assert csv_rows(folder / "Train_Samples_lr.csv") == [["step", "lr"], ["16", "0.001"]]
    assert not (folder / "train_grad_norm.csv").exists()
    scalars = tensorboard_scalars(out / "tensorboard" / "finetune")
    assert scalars["train/loss"] == {1: 3.0, 2: 1.5, 3: 1.0}
    assert scalars["eval/loss"] == {0: 4.5} and scalars["events/checkpoint"] == {3: 3.0}
    assert scalars["Train/Samples/lr"] == {16: pytest.approx(1e-3)}


def test_csv_of_a_resumed_run_has_one_header(tmp_path, ds_rank0):
    cfg = run_config(tmp_path, "csv")
    for steps in ([1, 2], [2, 3]):  # the second process resumes at 1 and repeats step 2
        metrics = MetricsWriter(str(tmp_path), monitor_for(cfg))
        for s in steps:
            metrics.write({"step": s, "loss": float(s)})
        metrics.close(0)
    assert csv_rows(tmp_path / "csv" / "finetune" / "train_loss.csv") == [
        ["step", "loss"],
        ["1", "1.0"],
        ["2", "2.0"],
        ["2", "2.0"],
        ["3", "3.0"],
    ]


# --- failures never raise ------------------------------------------------------------------------


class Broken:
    name = "broken"

    def __init__(self):
        self.calls = 0

    def _fail(self, arg):
        self.calls += 1
        raise RuntimeError("service gone")

    write = event = close = _fail


def test_tracker_failures_are_logged_not_raised(tmp_path, ds_rank0, caplog):
    cfg = run_config(tmp_path, "csv")
    monitor = monitor_for(cfg)
    broken = Broken()
    metrics = MetricsWriter(str(tmp_path), monitor, run_id="r", trackers=[broken])
    folder = tmp_path / "csv" / "finetune"
    for p in folder.iterdir():
        p.unlink()
    folder.rmdir()
    folder.write_text("a file where the csv folder was")  # every csv write now fails
    with caplog.at_level(logging.WARNING, logger="finetune"):
        for row in TRAIN:
            metrics.write(row)
        # the engine's own write, guarded too
        monitor.write_events([("Train/Samples/lr", 1e-3, 16)])
        metrics.event("checkpoint", 3, tag="global_step3")
        metrics.close(1)
        metrics.close(1)  # once
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]
    assert [e["event"] for e in read_events(tmp_path)] == ["checkpoint"]
    assert broken.calls == 5  # 3 rows, 1 event, 1 close
    warned = [r.getMessage() for r in caplog.records]
    # the first only
    assert sum("broken: write failed (RuntimeError: service gone)" in m for m in warned) == 1
    assert any(m.startswith("csv: writing scalars failed (NotADirectoryError") for m in warned), (
        warned
    )


# --- events.jsonl --------------------------------------------------------------------------------


def read_events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / EVENTS).read_text().splitlines()]


def test_events_jsonl_is_appended_and_never_truncated(tmp_path):
    first = MetricsWriter(str(tmp_path), run_id="run-a")
    first.event("start", 0, world_size=2, run_name="x")
    first.write({"step": 5, "loss": 1.0})
    first.event("checkpoint", 5, tag="global_step5", consolidated=True)
    first.event("preempted", 7, signal="SIGTERM on rank 1")
    truncate_after(tmp_path / "metrics.jsonl", 4)  # what a resume does to metrics.jsonl
    second = MetricsWriter(str(tmp_path), run_id="run-b")
    second.event("resume", 5, from_="global_step5")
    second.event("save_failed", 6, error="rank 1: OSError: [Errno 28] No space left on device")
    second.event("end", 8, exit_code=0)
    events = read_events(tmp_path)
    assert [(e["event"], e["step"], e["run_id"]) for e in events] == [
        ("start", 0, "run-a"),
        ("checkpoint", 5, "run-a"),
        ("preempted", 7, "run-a"),
        ("resume", 5, "run-b"),
        ("save_failed", 6, "run-b"),
        ("end", 8, "run-b"),
    ]
    assert events[0]["world_size"] == 2 and events[0]["run_name"] == "x"
    assert events[1]["tag"] == "global_step5" and events[1]["consolidated"] is True
    assert events[3]["from"] == "global_step5" and "from_" not in events[3]
    assert events[5]["exit_code"] == 0
    for e in events:
        assert list(e)[:4] == ["time", "event", "step", "run_id"]
        assert e["time"].endswith("+00:00") and len(e["time"]) == len("2026-01-01T00:00:00+00:00")


def test_only_rank_0_writes(tmp_path, monkeypatch):
    from finetune import distributed as dist

    monkeypatch.setattr(dist, "is_main", lambda: False)
    broken = Broken()
    metrics = MetricsWriter(str(tmp_path), run_id="r", trackers=[broken])
    metrics.write({"step": 1, "loss": 1.0})
    metrics.event("start", 0)
    metrics.close(0)
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / EVENTS).exists()
    assert broken.calls == 0


def test_unwritable_events_file_warns(tmp_path, caplog):
    (tmp_path / EVENTS).mkdir()  # a folder in its place
    with caplog.at_level(logging.WARNING, logger="finetune"):
        MetricsWriter(str(tmp_path), run_id="r").event("end", 3, exit_code=1)
    assert any("could not write the end event of step 3" in r.getMessage() for r in caplog.records)


# --- names, and the flag's checks ----------------------------------------------------------------


def test_scalar_names():
    assert trackers.scalars(
        {
            "step": 4,
            "loss": 2.0,
            "lr": 1e-4,
            "grad_norm": None,
            "loss_scale": float("inf"),
            "eval_loss": 3.0,
            "note": "x",
            "flag": True,
        }
    ) == {"train/loss": 2.0, "train/lr": 1e-4, "eval/loss": 3.0}


def test_check_available(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    missing = ("wandb", "tensorboard")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a)
    )
    assert trackers.check_available(()) is None and trackers.check_available(("csv",)) is None
    assert trackers.check_available(("csv", "tensorboard")) == (
        "`--report_to tensorboard`: the tensorboard package is not installed "
        "(pip install tensorboard)"
    )
    assert "`--report_to wandb`: the wandb package is not installed" in trackers.check_available(
        ("wandb",)
    )


def test_report_to_flag_checks(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    with pytest.raises(
        ConfigError, match="`--report_to tensorboard`: the tensorboard package is not installed"
    ):
        run_config(tmp_path, "csv,tensorboard")
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps({"zero_optimization": {"stage": 3}, "wandb": {"enabled": True, "project": "p"}})
    )
    if importlib.util.find_spec("wandb") is not None:
        with pytest.raises(
            ConfigError, match=r"`--report_to wandb` and `wandb.enabled: true` in .*ds.json"
        ):
            run_config(tmp_path, "wandb", deepspeed_config=str(ds))
    assert (
        run_config(tmp_path, "csv", deepspeed_config=str(ds)).ds_config["wandb"]["enabled"] is True
    )  # theirs
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, "csv_monitor": "on"}))
    with pytest.raises(ConfigError, match="`csv_monitor` in .* must be an object"):
        run_config(tmp_path, "csv", deepspeed_config=str(ds))
