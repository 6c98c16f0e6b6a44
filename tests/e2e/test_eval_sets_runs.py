"""Held-out eval sets through the CLI on 2 ranks: a mixture judged on one held-out file, and two
named sets, each logged, the aggregate token-weighted, the best checkpoint following the named
one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

DATA = Path(__file__).resolve().parents[2] / "finetune" / "resources" / "data"


def _files(tmp_path: Path) -> dict[str, str]:
    train = [json.loads(line)["text"] for line in (DATA / "train.jsonl").read_text().splitlines()]
    held = [
        json.loads(line)["text"] for line in (DATA / "validation.jsonl").read_text().splitlines()
    ]
    out = {}
    for name, rows, key in (
        ("a", train[:300], "text"),
        ("b", train[300:600], "body"),
        ("held", held[:60], "text"),
        ("other", held[60:200], "body"),
    ):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({key: r}) + "\n" for r in rows))
        out[name] = str(path)
    return out


COMMON = ("--max_steps", "4", "--eval_steps", "2", "--per_device_train_batch_size", "4")


def test_a_mixture_is_judged_on_its_held_out_file(run_finetune, tmp_path):
    f = _files(tmp_path)
    config = tmp_path / "mix.yaml"
    config.write_text(
        "dataset_mixture:\n"
        f"  - {{train_file: {f['a']}, weight: 2}}\n"
        f"  - {{train_file: {f['b']}, text_column: body, weight: 1}}\n"
        f"validation_file: {f['held']}\n"
    )
    result = run_finetune("--config", str(config), *COMMON)
    assert result.returncode == 0, result.output[-3000:]
    evals = result.eval_rows()
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert len({r["eval_tokens"] for r in evals}) == 1  # the same held-out rows each time
    assert "600 train / 60 eval examples" in result.output  # no source split off rows


def test_two_named_sets_are_logged_with_their_aggregate_and_pick_the_best(run_finetune, tmp_path):
    f = _files(tmp_path)
    sets = [
        {"name": "held", "validation_file": f["held"]},
        {"name": "other", "validation_file": f["other"], "text_column": "body"},
    ]
    result = run_finetune(
        "--train_file",
        f["a"],
        "--eval_datasets",
        json.dumps(sets),
        "--metric_for_best_model",
        "other_loss",
        "--max_eval_samples",
        "40",
        "--save_checkpoint",
        "--save_steps",
        "2",
        *COMMON,
    )
    assert result.returncode == 0, result.output[-3000:]
    evals = {r["step"]: r for r in result.eval_rows()}
    for row in evals.values():
        held, other = row["eval_held_tokens"], row["eval_other_tokens"]
        weighted = (row["eval_held_loss"] * held + row["eval_other_loss"] * other) / (held + other)
        assert row["eval_loss"] == pytest.approx(weighted, rel=1e-9)
        assert row["eval_tokens"] == held + other
    assert evals[0]["eval_held_tokens"] != evals[0]["eval_other_tokens"]
    out = result.out_dir
    best = json.loads((out / "global_step4" / "manifest.json").read_text())["best"]
    assert best["metric"] == "eval_other_loss"
    assert best["value"] == min(evals[s]["eval_other_loss"] for s in (2, 4))
