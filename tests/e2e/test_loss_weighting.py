"""The loss of a step is the mean over every label token of the step, through the CLI: however the
step's examples are split into micro-batches (gradient accumulation), ranks, padded rows or packed
blocks, its first row's loss and gradient norm are those of the same tokens in one padded batch.
(A mean of micro-batch means over-weights the short examples.)"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.e2e

# A long and a short example per pair: their micro-batch means differ from the token mean.
TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank while the sun sets slowly "
    "behind the distant hills and the birds return to their nests for the night.",
    "Short one.",
    "A second long example talks about checkpoints, partitions and the optimizer state that every "
    "rank keeps for its own shard of the parameters during training.",
    "Tiny.",
]


def _data(tmp_path, texts):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def _first_row(result) -> tuple[float, float]:
    assert result.returncode == 0, result.output[-3000:]
    row = result.train_rows()[0]
    assert row["step"] == 1
    return row["loss"], row["grad_norm"]


COMMON = ("--max_steps", "1", "--logging_steps", "1", "--validation_split_percentage", "0")


def test_micro_batches_and_ranks_of_different_lengths_weigh_every_token_alike(
    tmp_path, run_finetune, tiny_models
):
    data = _data(tmp_path, TEXTS[:2])
    base = ("--model_name_or_path", str(tiny_models["llama"]), "--train_file", data, *COMMON)
    one = run_finetune(
        *base,
        "--per_device_train_batch_size",
        "2",
        launcher="python",
        nprocs=1,
        out_dir=tmp_path / "one",
    )
    accum = run_finetune(
        *base,
        "--per_device_train_batch_size",
        "1",
        "--gradient_accumulation_steps",
        "2",
        launcher="python",
        nprocs=1,
        out_dir=tmp_path / "accum",
    )
    ranks = run_finetune(
        *base,
        "--per_device_train_batch_size",
        "1",
        nprocs=2,
        out_dir=tmp_path / "ranks",
    )
    loss, norm = _first_row(one)
    for other in (accum, ranks):
        other_loss, other_norm = _first_row(other)
        assert other_loss == pytest.approx(loss, rel=1e-5)
        assert other_norm == pytest.approx(norm, rel=1e-4)


def test_a_packed_step_has_the_padded_steps_loss_and_gradient(tmp_path, run_finetune, tiny_models):
    """The same examples in one step, padded or packed into blocks: the same first-step loss."""
    from finetune.cli import parse_train_args
    from finetune.data.cache import prepare
    from finetune.modeling import load_tokenizer

    texts = [t + f" Number {i}." for i in range(3) for t in TEXTS]  # 12 examples
    data = _data(tmp_path, texts)
    base = (
        "--model_name_or_path",
        str(tiny_models["llama"]),
        "--train_file",
        data,
        "--max_seq_length",
        "64",
        *COMMON,
    )
    # how many blocks the 12 examples pack into: the step takes them all
    cfg = parse_train_args([*base, "--packing", "--output_dir", str(tmp_path / "unused")])
    blocks = len(prepare(cfg, load_tokenizer(cfg.model))[0])
    assert 1 < blocks < len(texts)
    padded = run_finetune(
        *base,
        "--per_device_train_batch_size",
        str(len(texts)),
        launcher="python",
        nprocs=1,
        out_dir=tmp_path / "padded",
    )
    packed = run_finetune(
        *base,
        "--packing",
        "--per_device_train_batch_size",
        str(blocks),
        launcher="python",
        nprocs=1,
        out_dir=tmp_path / "packed",
    )
    assert "efficiency" in packed.output
    (loss, norm), (packed_loss, packed_norm) = _first_row(padded), _first_row(packed)
    assert packed_loss == pytest.approx(loss, rel=1e-5)
    assert packed_norm == pytest.approx(norm, rel=1e-4)


def test_rows_dealt_to_ranks_by_length_give_the_one_batch_loss_and_gradient(
    tmp_path, run_finetune, tiny_models
):
    """--balance_by_length gives a step's two long rows to one rank and its six short ones to the
    other, where round-robin pads four rows to a long one on each: the step trains the same
    tokens, so it has the same loss and gradient as one batch of them all."""
    from finetune.cli import parse_train_args
    from finetune.data import ResumableSampler
    from finetune.data.balance import deal, token_lengths
    from finetune.data.cache import prepare
    from finetune.data.sampler import SamplerState
    from finetune.modeling import load_tokenizer

    data = _data(tmp_path, [TEXTS[0], TEXTS[2], *(f"Short {i}." for i in range(6))])
    base = ("--model_name_or_path", str(tiny_models["llama"]), "--train_file", data, *COMMON)
    cfg = parse_train_args([*base, "--output_dir", str(tmp_path / "unused")])
    lengths = token_lengths(prepare(cfg, load_tokenizer(cfg.model))[0])
    _, step = ResumableSampler(len(lengths), 2, 0, cfg.train.seed).plan_step(SamplerState(), 4)
    dealt = [deal(step, lengths, 2, r) for r in range(2)]
    assert sorted(dealt[0]) == sorted(lengths.argsort()[-2:].tolist())  # the two long rows
    assert [len(d) for d in dealt] == [2, 6]
    one = run_finetune(
        *base,
        "--per_device_train_batch_size",
        "8",
        launcher="python",
        nprocs=1,
        out_dir=tmp_path / "one",
    )
    loss, norm = _first_row(one)
    for flag in ("--balance_by_length", "--no_balance_by_length"):
        ranks = run_finetune(
            *base, flag, "--per_device_train_batch_size", "4", nprocs=2, out_dir=tmp_path / flag
        )
        assert ("rows dealt to the ranks by length" in ranks.output) == (flag == "--balance_by_length")
        ranks_loss, ranks_norm = _first_row(ranks)
        assert ranks_loss == pytest.approx(loss, rel=1e-5)
        assert ranks_norm == pytest.approx(norm, rel=1e-4)
