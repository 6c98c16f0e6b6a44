"""Preference objectives through the CLI on 2 real ZeRO-3 ranks: a DPO run killed mid-save and
resumed, with the reference cache there and then deleted, logs the uninterrupted run's rows bit for
bit; the live reference (a partitioned copy, or LoRA's base with the adapters off) gives the
precomputed one's numbers."""

from __future__ import annotations

import shutil

import pytest

from finetune.objectives import PAIR_METRICS

pytestmark = pytest.mark.e2e

# The metrics a row's numbers are compared on (not the timings).
COMPARED = ("loss", "grad_norm", "eval_loss", *PAIR_METRICS, *(f"eval_{m}" for m in PAIR_METRICS))


def _rows(result) -> dict:
    assert result.returncode == 0, result.output[-3000:]
    return {
        (r["step"], "eval_loss" in r): {k: r[k] for k in COMPARED if k in r}
        for r in result.metrics()
    }


def _flags(cache, *extra) -> tuple:
    return (
        "--objective",
        "dpo",
        "--per_device_train_batch_size",
        "4",
        "--logging_steps",
        "1",
        "--eval_steps",
        "4",
        "--max_eval_samples",
        "24",
        "--warmup_steps",
        "0",
        "--dataset_cache_dir",
        str(cache),
        *extra,
    )


def test_a_dpo_run_killed_and_resumed_without_its_reference_cache_logs_the_same_rows(
    run_finetune, tmp_path
):
    cache = tmp_path / "cache"
    flags = _flags(cache, "--max_steps", "8", "--save_checkpoint", "--save_steps", "2")
    whole = run_finetune(*flags, out_dir=tmp_path / "whole", launcher="deepspeed")
    expected = _rows(whole)
    assert "reference log-probs: computed" in whole.output
    killed = run_finetune(
        *flags,
        out_dir=tmp_path / "killed",
        env={"FINETUNE_FAULT": "save.snapshot:1:6:kill"},
        launcher="deepspeed",
    )
    assert killed.returncode != 0, killed.output[-3000:]
    assert "reference log-probs: cached" in killed.output
    assert (tmp_path / "killed" / "latest").read_text().strip() == "global_step4"
    # A requeue on fresh disks: the reference entries are gone, the checkpoint is there.
    for entry in (cache / "finetune-tokenized").glob("reference-*"):
        shutil.rmtree(entry)
    resumed = run_finetune(
        *flags,
        "--resume_from_checkpoint",
        "auto",
        out_dir=tmp_path / "killed",
        launcher="deepspeed",
    )
    assert "reference log-probs: computed" in resumed.output
    rows = _rows(resumed)
    assert {step for step, _ in rows} == set(range(0, 9))
    assert rows == expected  # every row of steps 0-8, bit for bit
    assert rows[(8, False)]["rewards/margins"] != 0.0


def test_the_live_reference_and_loras_adapters_off_give_the_precomputed_numbers(
    run_finetune, tmp_path
):
    cache = tmp_path / "cache"
    first = {}
    for name, extra in {
        "precompute": (),
        "live": ("--reference", "live"),
        "lora": ("--use_peft",),
        "lora_live": ("--use_peft", "--reference", "live"),
    }.items():
        result = run_finetune(*_flags(cache, "--max_steps", "2", *extra), out_dir=tmp_path / name)
        first[name] = _rows(result)
    for name in ("live", "lora_live"):
        base = "precompute" if name == "live" else "lora"
        for key, row in first[base].items():
            for metric, value in row.items():
                assert first[name][key][metric] == pytest.approx(value, rel=1e-6, abs=1e-9), (
                    name,
                    key,
                    metric,
                )
    # Step 2 moved away from the reference: a reward that is not zero, the same both ways.
    assert first["live"][(2, False)]["rewards/chosen"] != 0.0


def test_an_orpo_run_saves_async_keeps_its_best_by_reward_accuracy_resumes_on_one_rank_and_exports(
    run_finetune, tmp_path
):
    """What checkpoints promise, under a preference objective: --async_save, the best checkpoint
    by an eval_rewards metric, a resume on another world size (universal), an export."""
    import json
    import subprocess
    import sys

    out = tmp_path / "out"
    flags = [
        "--objective",
        "orpo",
        "--per_device_train_batch_size",
        "4",
        "--logging_steps",
        "2",
        "--eval_steps",
        "2",
        "--max_eval_samples",
        "16",
        "--save_checkpoint",
        "--save_steps",
        "2",
        "--async_save",
        "--metric_for_best_model",
        "rewards/accuracies",
        "--dataset_cache_dir",
        str(tmp_path / "cache"),
    ]
    first = run_finetune(*flags, "--max_steps", "4", out_dir=out)
    assert first.returncode == 0, first.output[-3000:]
    manifest = json.loads((out / "global_step4" / "manifest.json").read_text())
    assert manifest["reference"] == {"objective": "orpo", "mode": "none", "weights": None}
    assert manifest["best"]["metric"] == "eval_rewards/accuracies"
    resumed = run_finetune(
        *flags, "--max_steps", "6", "--resume_from_checkpoint", "auto", nprocs=1, out_dir=out
    )
    assert resumed.returncode == 0, resumed.output[-3000:]
    rows = resumed.train_rows()
    assert rows[-1]["step"] == 6 and "nll_loss" in rows[-1] and "log_odds_ratio" in rows[-1]
    evals = {r["step"]: r["eval_rewards/accuracies"] for r in resumed.eval_rows()}
    best = json.loads((out / "global_step6" / "manifest.json").read_text())["best"]
    assert best["value"] == max(evals[s] for s in (2, 4, 6) if s in evals)
    export = subprocess.run(
        [sys.executable, "-m", "finetune", "export", str(out), str(tmp_path / "hf"), "--best"],
        capture_output=True,
        text=True,
    )
    assert export.returncode == 0, export.stdout + export.stderr
    assert (tmp_path / "hf" / "config.json").is_file()
