"""--tiled_mlp through the CLI on real ranks (gloo, ZeRO-3): the MLPs and the logits + loss in
tiles give the rows of the untiled run. Tiles hold up to hidden size tokens: the loss is cut into
many, the MLPs into several (rows longer than the hidden size), and short rows leave trailing
tiles empty. With lm_head tied to the input embedding (the embedded
model), at gradient accumulation 2; with sequence parallelism and gradient checkpointing (the
tiny Llama): same losses, same gradient norms, same eval loss."""

from __future__ import annotations

import json

import pytest
from test_sequence_parallel_runs import TEXTS

pytestmark = pytest.mark.e2e


def _data(tmp_path) -> str:
    """TEXTS four times over: 16 rows, 8 of them shorter than the hidden size."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 4))
    return str(path)


def _same_rows(a, b) -> None:
    for r in (a, b):
        assert r.returncode == 0, r.output[-3000:]
    assert len(a.train_rows()) >= 2
    for x, y in zip(a.train_rows(), b.train_rows(), strict=True):
        assert y["step"] == x["step"]
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
        assert y["tokens_seen"] == x["tokens_seen"]
    for x, y in zip(a.eval_rows(), b.eval_rows(), strict=True):
        assert y["eval_loss"] == pytest.approx(x["eval_loss"], rel=1e-5)


def test_a_tied_lm_head_trains_the_same_tiled(tmp_path, run_finetune):
    args = (
        "--train_file",
        _data(tmp_path),
        "--validation_file",
        _data(tmp_path),
        "--max_steps",
        "3",
        "--logging_steps",
        "1",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "2",
    )
    whole = run_finetune(*args, nprocs=2, out_dir=tmp_path / "whole")
    tiled = run_finetune(*args, "--tiled_mlp", nprocs=2, out_dir=tmp_path / "tiled")
    _same_rows(whole, tiled)
    # 8 eval rows of 128 tokens in tiles of 128 (the hidden size)
    assert "the logits and loss in 8" in tiled.output


def test_tiles_under_sequence_parallelism_and_checkpointing_train_as_one_rank(
    tmp_path, run_finetune, tiny_models
):
    args = (
        "--model_name_or_path",
        str(tiny_models["llama"]),
        "--train_file",
        _data(tmp_path),
        "--validation_file",
        _data(tmp_path),
        "--max_seq_length",
        "256",
        "--max_steps",
        "2",
        "--logging_steps",
        "1",
        "--per_device_train_batch_size",
        "2",
    )
    whole = run_finetune(*args, launcher="python", nprocs=1, out_dir=tmp_path / "whole")
    shared = run_finetune(
        *args,
        "--sequence_parallel_size",
        "2",
        "--tiled_mlp",
        "--gradient_checkpointing",
        nprocs=2,
        out_dir=tmp_path / "shared",
    )
    _same_rows(whole, shared)
    # 128 tokens of a row on each rank, 8 eval rows of 256 tokens, hidden size 64
    said = "each MLP in 2 tiles (rows of up to 128 tokens on a rank), the logits and loss in 32"
    assert said in shared.output
