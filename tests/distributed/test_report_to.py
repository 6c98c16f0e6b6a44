"""--report_to tensorboard,wandb,csv in a real 2-rank run under the DeepSpeed launcher: each tracker
written once (rank 0), events.jsonl with the run's start, checkpoints, resume and end, and a resumed
run logging to the same wandb run."""

from __future__ import annotations

import json

import pytest
from test_trackers import (
    csv_rows,
    history_at,
    offline_runs,
    read_wandb_run,
    tensorboard_scalars,
)

pytestmark = pytest.mark.distributed

WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def events_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def test_report_to_tensorboard_wandb_csv_then_resume(run_finetune, tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install -e .[test])")
    pytest.importorskip(
        "tensorboard", reason="tensorboard is not installed (pip install -e .[test])"
    )
    flags = (
        "--logging_steps",
        "1",
        "--save_checkpoint",
        "--save_steps",
        "2",
        "--run_name",
        "two-ranks",
        "--report_to",
        "tensorboard,wandb,csv",
    )
    r = run_finetune("--max_steps", "4", *flags, env=WANDB_ENV)
    assert r.returncode == 0, r.output[-4000:]
    out = r.out_dir
    losses = {row["step"]: row["loss"] for row in r.train_rows()}
    assert sorted(losses) == [1, 2, 3, 4]

    # wandb: one run (rank 0's), under OUT, named, with the flags as config and the checkpoints.
    (run_dir,) = offline_runs(out)
    assert not (tmp_path / "wandb").exists()  # no rank fell back to the working directory
    run = read_wandb_run(run_dir)
    assert run["name"] == "two-ranks" and run["exit_code"] == 0
    assert (
        run["config"]["world_size"] == 2
        and run["config"]["train"]["report_to"] == "tensorboard,wandb,csv"
    )
    assert history_at(run["history"], "train/loss") == pytest.approx(losses)
    assert sorted(history_at(run["history"], "eval/loss")) == [0, 4]
    assert history_at(run["history"], "events/checkpoint") == {2: 2, 4: 4}

    # tensorboard: one event file (rank 0's); csv: each step once, one header.
    (event_file,) = (out / "tensorboard").rglob("events.out.tfevents*")
    assert tensorboard_scalars(event_file.parent)["train/loss"] == pytest.approx(losses)
    loss_csv = out / "csv" / "finetune" / "train_loss.csv"
    assert csv_rows(loss_csv) == [["step", "loss"]] + [
        [str(s), str(losses[s])] for s in (1, 2, 3, 4)
    ]
    assert csv_rows(out / "csv" / "finetune" / "events_checkpoint.csv")[1:] == [
        ["2", "2.0"],
        ["4", "4.0"],
    ]

    # events.jsonl: written once, not once per rank.
    events = events_of(out)
    assert [(e["event"], e["step"]) for e in events] == [
        ("start", 0),
        ("checkpoint", 2),
        ("checkpoint", 4),
        ("end", 4),
    ]
    assert events[0]["world_size"] == 2 and events[0]["run_name"] == "two-ranks"
    assert [e["tag"] for e in events[1:3]] == ["global_step2", "global_step4"]
    assert events[-1]["exit_code"] == 0 and len({e["run_id"] for e in events}) == 1

    # Resumed: the same wandb run (offline: a second folder with its id), events appended.
    r2 = run_finetune("--max_steps", "6", "--resume_from_checkpoint", "auto", *flags, env=WANDB_ENV)
    assert r2.returncode == 0, r2.output[-4000:]
    runs = offline_runs(out)
    assert len(runs) == 2 and {read_wandb_run(p)["id"] for p in runs} == {run["id"]}
    resumed = read_wandb_run(next(p for p in runs if p != run_dir))
    assert sorted(history_at(resumed["history"], "train/loss")) == [5, 6]
    later = events_of(out)[len(events) :]
    assert [(e["event"], e["step"]) for e in later] == [
        ("start", 4),
        ("resume", 4),
        ("checkpoint", 6),
        ("end", 6),
    ]
    assert later[1]["from"] == "global_step4" and later[0]["run_id"] != events[0]["run_id"]
    assert [row[0] for row in csv_rows(loss_csv)] == ["step", "1", "2", "3", "4", "5", "6"]
