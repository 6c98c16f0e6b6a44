"""--sequence_parallel_size 2 against HF Trainer's own route to the same feature
(bench/train/hf_sp_run.py: ``ParallelismConfig(sp_backend="deepspeed", sp_size=2)`` with
``deepspeed=`` the same ZeRO-3 JSON), each on 2 ranks sharing every row (gloo, sdpa, DeepSpeed's
Ulysses attention): the same model (``from_config`` of the tiny Llama's config, seed 42), the same
rows in the same order at batch 1, the same AdamW, schedule and clipping. Every step of an epoch
trains a row of the same length and logs the same loss and gradient norm, rel 1e-5 (measured: at
most 6e-8 for the loss, the float32 rounding of HF's loss tensor, and 2e-8 for the gradient norm):
both tools take the loss as the token mean over the whole row, HF by weighting each shard's mean
by its label tokens across the group."""

from __future__ import annotations

import json

import pytest
from test_sequence_parallel_runs import TEXTS, _data

from conftest import BIN, REPO, Running, child_env, free_port

pytestmark = pytest.mark.e2e

HF_SCRIPT = REPO / "bench" / "train" / "hf_sp_run.py"
DS_CONFIG = str(REPO / "configs" / "ds_zero3.json")
# TEXTS, rows of different lengths: the two long ones are cut at MAX_LEN; "Tiny.", padded to
# MAX_LEN on HF's side, leaves the second rank of its group nothing but padding to train on.
MAX_LEN = 64  # HF pads every row to it: its adapter all-gathers equally wide rows only (gloo)
STEPS = len(TEXTS)  # one epoch, every row once
# Warmup 0: step 1 already updates the weights, so later steps compare the optimizers too.
COMMON = (
    *("--max_seq_length", str(MAX_LEN), "--max_steps", str(STEPS)),
    *("--learning_rate", "1e-3", "--warmup_steps", "0"),
)


def _finetune(run_finetune, tmp_path, config: str, data: str, *flags: str) -> list[dict]:
    """finetune's metrics rows, one per step, from 2 ranks with ``flags``."""
    r = run_finetune(
        *("--config_name", config, "--tokenizer_name", config, "--attn_implementation", "sdpa"),
        *("--deepspeed_config", DS_CONFIG, "--train_file", data),
        *("--validation_split_percentage", "0", "--per_device_train_batch_size", "1"),
        *("--logging_steps", "1", *COMMON, *flags),
        nprocs=2,
        out_dir=tmp_path / "finetune",
    )
    assert r.returncode == 0, r.output[-3000:]
    return r.train_rows()


def _hf(tmp_path, config: str, data: str) -> list[dict]:
    """Each rank's record of bench/train/hf_sp_run.py with sp_size 2 on 2 ranks."""
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]
    cmd += [str(HF_SCRIPT), "--config_dir", config, "--tokenizer_dir", config]
    cmd += ["--train_file", data, "--ds_config", DS_CONFIG, "--sp_size", "2", *COMMON]
    cmd += ["--output_dir", str(tmp_path / "hf_out"), "--result", str(tmp_path / "hf")]
    r = Running(cmd, tmp_path, child_env()).finish(timeout=300)
    assert r.returncode == 0, r.output[-3000:]
    return [json.loads((tmp_path / f"hf.rank{rank}.json").read_text()) for rank in (0, 1)]


def test_hf_trainers_sequence_parallelism_trains_as_finetunes(tmp_path, run_finetune, tiny_models):
    config, data = str(tiny_models["llama"]), _data(tmp_path)
    ours = _finetune(run_finetune, tmp_path, config, data, "--sequence_parallel_size", "2")
    hf = _hf(tmp_path, config, data)

    # Accelerate dealt each rank its own rows (the adapter then trains the group's rows in turn),
    # and both ranks of the group hold the same loss.
    assert [h["accelerate"]["num_processes"] for h in hf] == [2, 2]
    theirs, theirs_1 = ([row for row in h["log_history"] if "loss" in row] for h in hf)
    assert theirs == theirs_1
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(1, STEPS + 1))
    tokens = [
        b["tokens_seen"] - a["tokens_seen"] for a, b in zip([{"tokens_seen": 0}, *ours], ours)
    ]
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        # The same row: all of its tokens but the last are labels, split over HF's two shards.
        # At initialization any row's loss is near ln(vocab) (one word changed in step 1's row
        # moves it by 3e-5): the gradient norm (3% for that word) and later steps tell rows apart.
        assert sum(h["shards"][step]["loss_tokens"] for h in hf) == tokens[step] - 1
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), f"step {a['step']}"
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), f"step {a['step']}"
    # The same schedule; Trainer logs at each step the learning rate the next step uses.
    assert [r["learning_rate"] for r in theirs[:-1]] == pytest.approx([r["lr"] for r in ours[1:]])
