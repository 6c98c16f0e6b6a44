"""A --dataset_mixture in real runs: two sources of different formats on 2 ranks, a checkpoint
mid-epoch resumed on 1 rank (another world size) continuing the same global order, per-source
tokens in metrics.jsonl and `finetune ls`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed

TIMEOUT = 420
# The same global batch on 2 and 1 ranks (4 × GA 1 × 2 = 4 × GA 2 × 1): the same positions per step.
PER_WORLD = {2: ["--gradient_accumulation_steps", "1"], 1: ["--gradient_accumulation_steps", "2"]}
COMMON = ["--max_steps", "6", "--logging_steps", "1", "--per_device_train_batch_size", "4"]


def _ok(r):
    assert r.returncode == 0, r.output[-4000:]


def test_a_mixture_resumed_on_another_world_size_continues_the_same_order(
    run_finetune, data_files, tmp_path
):
    config = tmp_path / "mix.yaml"
    config.write_text(
        "dataset_mixture:\n"
        f"  - train_file: {data_files['text_jsonl']}\n"
        "    weight: 3\n"
        f"  - train_file: {data_files['pc_csv']}\n"
        "    name: qa\n"
        "    prompt_column: question\n"
        "    completion_column: answer\n"
        "    weight: 1\n"
    )
    common = ["--config", str(config), "--dataset_cache_dir", str(tmp_path / "cache"), *COMMON]
    ref = run_finetune(
        *common,
        *PER_WORLD[2],
        "--save_checkpoint",
        "--save_steps",
        "3",
        out_dir=tmp_path / "ref",
        timeout=TIMEOUT,
    )
    _ok(ref)
    assert "mixture source text (" in ref.output and "75.0% of samples" in ref.output
    assert "mixture source qa (" in ref.output and "25.0% of samples" in ref.output
    rows = {r["step"]: r for r in ref.train_rows()}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    last = rows[6]["tokens_seen_by_source"]
    assert set(last) == {"text", "qa"} and sum(last.values()) == rows[6]["tokens_seen"]
    assert all(n > 0 for n in last.values())  # 48 samples at 3:1: both sources drawn

    ckpt = tmp_path / "ref" / "global_step3"  # mid-epoch: ~390 rows hold 97 steps of 4 × 2
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["sampler"]["position"] == 24 and sum(state["sampler"]["draws"]) == 24
    resumed = run_finetune(
        *common,
        *PER_WORLD[1],
        "--resume_from_checkpoint",
        str(ckpt),
        launcher="python",
        nprocs=1,
        out_dir=tmp_path / "new",
        timeout=TIMEOUT,
    )
    _ok(resumed)
    assert "Resuming a 2-rank checkpoint on 1 ranks" in resumed.output
    got = {r["step"]: r for r in resumed.train_rows()}
    assert sorted(got) == [4, 5, 6]
    for step in (4, 5, 6):  # the same rows, step by step: the same tokens of each source
        assert got[step]["tokens_seen_by_source"] == rows[step]["tokens_seen_by_source"], step
        assert got[step]["samples_seen"] == rows[step]["samples_seen"]
        assert got[step]["loss"] == pytest.approx(rows[step]["loss"], rel=0.01)

    ls = subprocess.run(
        [sys.executable, "-m", "finetune", "ls", str(tmp_path / "ref")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ls.returncode == 0, ls.stderr
    line = next(ln for ln in ls.stdout.splitlines() if ln.startswith("global_step6 tokens by"))
    assert f"text {last['text']:,} (" in line and f"qa {last['qa']:,} (" in line, ls.stdout
