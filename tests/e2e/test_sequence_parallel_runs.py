"""--sequence_parallel_size through the CLI, on real ranks (gloo, sdpa, DeepSpeed's Ulysses
attention): two ranks sharing each row train as one rank holding it whole. Same rows, same ten
steps: the loss (the token mean over the whole rows, rel 1e-5) and the gradient norm (rel 1e-4),
at batch 1 and 2 and at gradient accumulation 2; the counts (samples, tokens) count each once;
evaluation (whole rows on each rank) gives the unsplit eval loss. Then resumes: at the same split,
and on another split and world size."""

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
        "10",
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
    assert len(whole.train_rows()) == 10
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


def _deltas(rows: list[dict], key: str) -> list[int]:
    return [b[key] - a[key] for a, b in zip(rows, rows[1:])]


def test_a_sequence_parallel_checkpoint_resumes_on_another_split_and_world_size(
    tmp_path, run_finetune, tiny_models
):
    """Saved at step 2 by 2 ranks sharing each row (1 data-parallel rank), resumed:
    - on 1 rank holding whole rows (universal format, same rows per step): the rows the
      uninterrupted run logged;
    - on 2 ranks, each with its own rows (2 data-parallel ranks now): the data continues where it
      stopped, each step taking the rows a fresh 2-data-parallel run takes at the same position
      (equal token counts), nothing skipped or repeated across the epoch end;
    - on 4 ranks, 2 sharing each row (universal, 2 data-parallel ranks): the rows of the 2-rank
      resume, the same model on the same rows split another way."""
    common = ("--validation_split_percentage", "0", "--per_device_train_batch_size", "1")
    args = _args(tmp_path, tiny_models, *common, "--max_steps", "6")
    saved = run_finetune(
        *args,
        "--sequence_parallel_size",
        "2",
        "--save_checkpoint",
        "--save_steps",
        "2",
        out_dir=tmp_path / "saved",
    )
    assert saved.returncode == 0, saved.output[-3000:]
    manifest = json.loads((tmp_path / "saved" / "global_step2" / "manifest.json").read_text())
    assert manifest["sequence_parallel_size"] == 2
    at_2 = ("--resume_from_checkpoint", str(tmp_path / "saved" / "global_step2"))

    def resumed(name: str, nprocs: int, n: int, **kw):
        r = run_finetune(
            *args,
            *at_2,
            "--sequence_parallel_size",
            str(n),
            nprocs=nprocs,
            out_dir=tmp_path / name,
            **kw,
        )
        assert r.returncode == 0, r.output[-3000:]
        assert [row["step"] for row in r.train_rows()] == [3, 4, 5, 6]
        return r

    whole = resumed("whole", 1, 1, launcher="python")
    assert "universal" in whole.output
    for a, b in zip(saved.train_rows()[2:], whole.train_rows(), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert (b["samples_seen"], b["tokens_seen"]) == (a["samples_seen"], a["tokens_seen"])

    fresh = run_finetune(
        *_args(tmp_path, tiny_models, *common, "--max_steps", "5"),
        nprocs=2,
        out_dir=tmp_path / "fresh",
    )
    assert fresh.returncode == 0, fresh.output[-3000:]
    split = resumed("split", 2, 1)
    assert "--sequence_parallel_size 2 on 2 ranks (1 data-parallel) with 1 on 2" in split.output
    step_2 = saved.train_rows()[1]
    assert _deltas([step_2, *split.train_rows()], "tokens_seen") == _deltas(
        fresh.train_rows(), "tokens_seen"
    )
    assert _deltas([step_2, *split.train_rows()], "samples_seen") == [2, 2, 2, 2]

    four = resumed("four", 4, 2)
    assert "universal" in four.output
    for a, b in zip(split.train_rows(), four.train_rows(), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert (b["samples_seen"], b["tokens_seen"]) == (a["samples_seen"], a["tokens_seen"])
