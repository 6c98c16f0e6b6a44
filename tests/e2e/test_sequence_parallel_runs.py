"""--sequence_parallel_size through the CLI, on real ranks (gloo, sdpa, DeepSpeed's Ulysses
attention): two ranks sharing each row train as one rank holding it whole. Same rows, same first
step: the loss (the token mean over the whole rows) and the gradient norm, at batch 1 and 2 and at
gradient accumulation 2; the counts (samples, tokens) count each once; evaluation (whole rows on
each rank) gives the unsplit eval loss."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.e2e

# Rows of different lengths (padding inside a micro-batch; widths not a multiple of 2 shards).
TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank while the sun sets slowly "
    "behind the distant hills and the birds return to their nests for the night.",
    "Short one, with an odd count of words.",
    "A second long example talks about checkpoints, partitions and the optimizer state that every "
    "rank keeps for its own shard of the parameters during training.",
    "Tiny.",
]


def _data(tmp_path) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return str(path)


def _args(tmp_path, tiny_models, *flags: str) -> tuple[str, ...]:
    """The tiny Llama trained on TEXTS, a row logged every step, and ``flags``."""
    model = ("--model_name_or_path", str(tiny_models["llama"]))
    return (*model, "--train_file", _data(tmp_path), "--logging_steps", "1", *flags)


@pytest.mark.parametrize("batch, accumulation", [(1, 1), (2, 1), (1, 2)])
def test_two_ranks_sharing_each_row_train_as_one_rank_holding_it(
    tmp_path, run_finetune, tiny_models, batch, accumulation
):
    args = _args(
        tmp_path,
        tiny_models,
        "--validation_file",
        _data(tmp_path),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        str(batch),
        "--gradient_accumulation_steps",
        str(accumulation),
    )
    whole = run_finetune(*args, launcher="python", nprocs=1, out_dir=tmp_path / "whole")
    shared = run_finetune(
        *args, "--sequence_parallel_size", "2", nprocs=2, out_dir=tmp_path / "shared"
    )
    for r in (whole, shared):
        assert r.returncode == 0, r.output[-3000:]
    for a, b in zip(whole.train_rows(), shared.train_rows(), strict=True):
        assert b["step"] == a["step"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert (b["samples_seen"], b["tokens_seen"]) == (a["samples_seen"], a["tokens_seen"])
    assert len(whole.train_rows()) == 2
    for a, b in zip(whole.eval_rows(), shared.eval_rows(), strict=True):
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
        assert b["eval_tokens"] == a["eval_tokens"]


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "data_ms")} for r in rows]


def test_a_sequence_parallel_run_resumes_exactly(tmp_path, run_finetune, tiny_models):
    """Killed at its step-4 save, resumed from step 2 with the same --sequence_parallel_size: every
    logged row equals the uninterrupted run's, across an epoch end (4 rows an epoch)."""
    args = _args(
        tmp_path,
        tiny_models,
        "--validation_split_percentage",
        "0",
        "--max_steps",
        "6",
        "--per_device_train_batch_size",
        "1",
        "--sequence_parallel_size",
        "2",
    )
    straight = run_finetune(*args, out_dir=tmp_path / "a")
    assert straight.returncode == 0, straight.output[-3000:]
    save = ("--save_checkpoint", "--save_steps", "2")
    killed = run_finetune(
        *args, *save, out_dir=tmp_path / "b", env={"FINETUNE_FAULT": "save.snapshot:0:4:kill"}
    )
    assert killed.returncode != 0
    assert (tmp_path / "b" / "latest").read_text().strip() == "global_step2"
    resumed = run_finetune(*args, *save, "--resume_from_checkpoint", "auto", out_dir=tmp_path / "b")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "global_step2 at step 2" in resumed.output
    assert [r["step"] for r in resumed.train_rows()] == [1, 2, 3, 4, 5, 6]
    assert _comparable(resumed.metrics()) == _comparable(straight.metrics())
