"""The best checkpoint and early stopping through the real CLI (one rank, plain python): early
stopping ends at the same step with a kill -9 and a resume in between, and the best checkpoint
outlives --save_total_limit and exports to a model with its recorded eval loss."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import Result

pytestmark = (
    pytest.mark.e2e
)  # real runs (about 4 minutes on 2 cores): `make check`, not `make test`
VALIDATION = 12  # examples in the eval set


@pytest.fixture
def files(data_files, tmp_path):
    lines = data_files["text_jsonl"].read_text().splitlines()
    val = tmp_path / "val.jsonl"
    val.write_text("\n".join(lines[:VALIDATION]) + "\n")
    return ["--train_file", str(data_files["text_jsonl"]), "--validation_file", str(val)]


def rows_by_step(result: Result) -> dict[tuple[int, str], dict]:
    """The last row of each (step, kind): what a resumed run re-logged replaces the killed one's."""
    rows = {}
    for r in result.metrics():
        rows[(r["step"], "eval" if "eval_loss" in r else "train")] = r
    return rows


def exit_status(out) -> dict:
    return json.loads((out / "exit_status.json").read_text())


def test_early_stopping_stops_at_the_same_step_after_kill_9_and_resume(
    run_finetune, files, tmp_path
):
    # A learning rate that barely moves the weights (warmup over 100,000 steps) and a threshold no
    # such change can beat: evaluations at 2, 4, 6, 8 do not improve on step 0's, so patience 4
    # stops at 8 (a resume that forgot the counters would stop at 14).
    flags = [
        *files,
        "--max_steps",
        "40",
        "--eval_steps",
        "2",
        "--logging_steps",
        "1",
        "--save_checkpoint",
        "--save_steps",
        "2",
        "--early_stopping_patience",
        "4",
        "--early_stopping_threshold",
        "0.5",
        "--warmup_steps",
        "100000",
        "--max_seq_length",
        "64",
    ]
    whole = run_finetune(*flags, launcher="python", nprocs=1, out_dir=tmp_path / "whole")
    assert whole.returncode == 0, whole.output[-3000:]
    status = exit_status(whole.out_dir)
    assert (status["reason"], status["exit_code"], status["step"]) == ("early_stopped", 0, 8)
    assert max(s for s, kind in rows_by_step(whole) if kind == "train") == 8
    assert sorted(s for s, kind in rows_by_step(whole) if kind == "eval") == [0, 2, 4, 6, 8]
    assert (whole.out_dir / "latest").read_text().strip() == "global_step8"

    # SIGKILL in the save of step 6 (after its evaluation): the run resumes from step 4.
    out = tmp_path / "killed"
    killed = run_finetune(
        *flags,
        launcher="python",
        nprocs=1,
        out_dir=out,
        env={"FINETUNE_FAULT": "save.snapshot:0:6:kill"},
    )
    assert killed.returncode in (-9, 137), killed.output[-3000:]
    assert (out / "latest").read_text().strip() == "global_step4"
    resumed = run_finetune(
        *flags, "--resume_from_checkpoint", "auto", launcher="python", nprocs=1, out_dir=out
    )
    assert resumed.returncode == 0, resumed.output[-3000:]
    status = exit_status(out)
    assert (status["reason"], status["step"]) == ("early_stopped", 8)
    assert (out / "latest").read_text().strip() == "global_step8"
    # The same rows, the resumed ones in place of what the killed run logged after step 4.
    ours, theirs = rows_by_step(resumed), rows_by_step(whole)
    assert ours.keys() == theirs.keys()
    for key, row in theirs.items():
        for name in ("loss", "eval_loss", "lr"):
            if name in row:
                assert ours[key][name] == pytest.approx(row[name], rel=1e-6, abs=1e-9), key
    state = json.loads((out / "global_step8" / "trainer_state.json").read_text())
    assert state["evals_without_improvement"] == 4
    assert state["best_metric"] == pytest.approx(min(r["eval_loss"] for r in whole.eval_rows()))

    # Resumed again, from its final checkpoint: it stops at once, training nothing more.
    again = run_finetune(
        *flags, "--resume_from_checkpoint", "auto", launcher="python", nprocs=1, out_dir=out
    )
    assert again.returncode == 0, again.output[-3000:]
    assert (exit_status(out)["reason"], exit_status(out)["step"]) == ("early_stopped", 8)
    assert len(again.metrics()) == len(resumed.metrics())  # no new row


def eval_loss_of(model_dir, val_file, max_len: int) -> float:
    """The token-weighted loss of a model folder on the eval file, computed here from scratch:
    each text tokenized as finetune does (special tokens, EOS appended, truncated), every label
    after the first counted."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for line in val_file.read_text().splitlines():
        ids = tok(json.loads(line)["text"])["input_ids"]
        if tok.eos_token_id is not None and (not ids or ids[-1] != tok.eos_token_id):
            ids = ids + [tok.eos_token_id]
        ids = torch.tensor([ids[:max_len]])
        with torch.no_grad():
            loss = model(input_ids=ids, labels=ids).loss
        total += float(loss) * (ids.shape[1] - 1)
        count += ids.shape[1] - 1
    return total / count


def test_the_best_checkpoint_survives_retention_and_exports_with_its_eval_loss(
    run_finetune, files, tmp_path
):
    # greater_is_better on the loss: the earliest evaluated checkpoint is the best (training lowers
    # the loss), every later one worse; --async_save: each commit comes a step boundary later.
    flags = [
        *files,
        "--max_steps",
        "10",
        "--eval_steps",
        "2",
        "--logging_steps",
        "2",
        "--save_checkpoint",
        "--save_steps",
        "2",
        "--save_total_limit",
        "1",
        "--async_save",
        "--metric_for_best_model",
        "loss",
        "--greater_is_better",
        "--max_seq_length",
        "64",
    ]
    r = run_finetune(*flags, launcher="python", nprocs=1)
    assert r.returncode == 0, r.output[-3000:]
    evals = {row["step"]: row for row in r.eval_rows()}
    saved = (2, 4, 6, 8, 10)
    best_step = max(saved, key=lambda s: evals[s]["eval_loss"])
    assert best_step < 10, evals  # the premise: a later checkpoint is worse
    tag = f"global_step{best_step}"
    assert sorted(p.name for p in r.out_dir.glob("global_step*")) == sorted({tag, "global_step10"})
    manifest = json.loads((r.out_dir / tag / "manifest.json").read_text())
    assert manifest["eval"] == evals[best_step]
    assert manifest["best"]["tag"] == tag

    ls = subprocess.run(
        [sys.executable, "-m", "finetune", "ls", str(r.out_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ls.returncode == 0, ls.stderr
    listed = json.loads(ls.stdout)
    assert listed["best"]["tag"] == tag
    assert [c["tag"] for c in listed["checkpoints"] if c["best"]] == [tag]

    exported = tmp_path / "exported"
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "export", str(r.out_dir), str(exported), "--best"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert tag in proc.stdout
    recomputed = eval_loss_of(exported, tmp_path / "val.jsonl", 64)
    assert math.isclose(recomputed, evals[best_step]["eval_loss"], rel_tol=1e-4), (
        recomputed,
        evals[best_step],
    )


def test_early_stopping_without_saving_checkpoints(run_finetune, files, tmp_path):
    """No --save_checkpoint: early stopping still ends the run (exit 0, reason early_stopped),
    with nothing saved."""
    r = run_finetune(
        *files,
        "--max_steps",
        "40",
        "--eval_steps",
        "3",
        "--early_stopping_patience",
        "2",
        "--early_stopping_threshold",
        "0.5",
        "--warmup_steps",
        "100000",
        "--max_seq_length",
        "64",
        launcher="python",
        nprocs=1,
    )
    assert r.returncode == 0, r.output[-3000:]
    status = exit_status(r.out_dir)
    assert (status["reason"], status["step"]) == ("early_stopped", 6)
    assert "best_checkpoint" not in status and not list(r.out_dir.glob("global_step*"))
    assert [row["step"] for row in r.eval_rows()] == [0, 3, 6]
