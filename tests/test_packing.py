"""Packing that keeps examples apart (finetune/data/packing.py) and the collation of packed blocks:
best-fit decreasing places every example whole, exactly once; a packed block's logits equal each
example's own forward pass (eager and sdpa); a packed batch's loss equals the padded batch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from finetune.data import IGNORE, collate, model_inputs
from finetune.data.packing import pack_bfd, plan_bfd

from conftest import build_tiny_model

PAD = 0


def _reference_bfd(lengths: list[int], capacity: int) -> list[int]:
    """Best-fit decreasing, one example at a time: the rooms left in the blocks, sorted."""
    rooms: list[int] = []
    for n in sorted(lengths, reverse=True):
        fits = [i for i, r in enumerate(rooms) if r >= n]
        if fits:
            best = min(fits, key=lambda i: rooms[i])
            rooms[best] -= n
        else:
            rooms.append(capacity - n)
    return sorted(rooms)


@pytest.mark.parametrize("seed", range(6))
def test_plan_is_exactly_best_fit_decreasing(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        capacity = int(rng.integers(2, 80))
        top = capacity if rng.random() < 0.5 else max(2, capacity // 5)
        lengths = rng.integers(1, top + 1, size=int(rng.integers(1, 120)))
        block_of, n_blocks = plan_bfd(lengths, capacity)
        assert (block_of >= 0).all() and (block_of < n_blocks).all()
        fill = np.bincount(block_of, weights=lengths, minlength=n_blocks)
        assert fill.max() <= capacity and (fill > 0).all()
        # the same blocks, room for room, as the one-at-a-time algorithm
        assert sorted((capacity - fill).astype(int).tolist()) == _reference_bfd(
            lengths.tolist(), capacity
        )


def test_plan_scales_to_millions_of_examples():
    """Counts, not examples: two million examples of up to 4,096 tokens in seconds."""
    lengths = np.minimum(np.random.default_rng(0).geometric(1 / 300, size=2_000_000), 4096)
    block_of, n_blocks = plan_bfd(lengths, 4096)
    assert lengths.sum() / (n_blocks * 4096) > 0.99


def test_plan_refuses_an_example_longer_than_a_block():
    with pytest.raises(ValueError, match="1..8"):
        plan_bfd(np.array([3, 9]), 8)


def _examples(rng, n: int, max_len: int) -> list[dict]:
    rows = []
    for i in range(n):
        length = int(rng.integers(2, max_len + 1))
        ids = rng.integers(1, 500, size=length).tolist()
        prompt = int(rng.integers(0, length - 1))  # masked prompt tokens, then trained ones
        rows.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:], "i": i})
    return rows


def test_no_example_is_split_or_lost_and_first_labels_are_masked(tmp_path):
    import datasets

    rng = np.random.default_rng(1)
    rows = _examples(rng, 400, 48)
    ds = datasets.Dataset.from_list([{k: r[k] for k in ("input_ids", "labels")} for r in rows])
    packed, stats = pack_bfd(ds, 64, str(tmp_path / "p.arrow"), chunk_blocks=7)
    seen = []
    for block in packed:
        ids, labels, pos = block["input_ids"], block["labels"], block["position_ids"]
        assert len(ids) == len(labels) == len(pos) <= 64
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        assert starts[0] == 0
        for a, b in zip(starts, starts[1:], strict=False):
            assert pos[a:b] == list(range(b - a))  # one example: positions 0..n-1
            seen.append((tuple(ids[a:b]), tuple(labels[a:b])))
    want = sorted((tuple(r["input_ids"]), (IGNORE, *r["labels"][1:])) for r in rows)
    assert sorted(seen) == want  # every example once, whole, its first label ignored
    assert stats["examples"] == 400 and stats["blocks"] == len(packed)
    assert stats["tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert stats["efficiency"] == pytest.approx(stats["tokens"] / (64 * len(packed)), abs=1e-6)


def test_collate_packed_rows_gives_positions_and_no_mask():
    rows = [
        {"input_ids": [5, 6, 7, 8], "labels": [IGNORE, 6, IGNORE, 8], "position_ids": [0, 1, 0, 1]},
        {"input_ids": [9, 10], "labels": [IGNORE, 10], "position_ids": [0, 1]},
    ]
    batch = collate(rows, PAD)
    assert "attention_mask" not in batch
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1], [0, 1, 0, 1]]
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, PAD, PAD]]
    assert batch["labels"].tolist() == [[IGNORE, 6, IGNORE, 8], [IGNORE, 10, IGNORE, IGNORE]]
    flat = collate(rows, PAD, flatten=True)  # flash-attention's varlen form: one row, no padding
    assert flat["position_ids"].tolist() == [[0, 1, 0, 1, 0, 1]]
    assert flat["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    for b in (batch, flat):
        _, tokens, n_rows = model_inputs(b)
        assert (tokens, n_rows) == (6, 2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("m") / "llama")


def _model(path, attn: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=attn, dtype=torch.float32
    )
    # as training sets it (modeling.load_model): with a KV cache transformers does not read
    # packed sequences from the position ids
    model.config.use_cache = False
    return model.eval()


def _blocks(rows: list[dict], max_len: int):
    import datasets

    ds = datasets.Dataset.from_list([{k: r[k] for k in ("input_ids", "labels")} for r in rows])
    packed, _ = pack_bfd(ds, max_len)
    return [packed[i] for i in range(len(packed))]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_block_logits_equal_each_examples_own(llama, attn):
    model = _model(llama, attn)
    rows = _examples(np.random.default_rng(2), 9, 30)
    blocks = _blocks(rows, 64)
    assert any(sum(p == 0 for p in b["position_ids"]) > 1 for b in blocks)  # examples do share
    batch, _, _ = model_inputs(collate(blocks, PAD))
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        by_example = {
            tuple(r["input_ids"]): model(input_ids=torch.tensor([r["input_ids"]])).logits[0]
            for r in rows
        }
    compared = 0
    for b, block in enumerate(blocks):
        pos = block["position_ids"]
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        for a, e in zip(starts, starts[1:], strict=False):
            alone = by_example[tuple(block["input_ids"][a:e])]
            torch.testing.assert_close(packed[b, a:e], alone, atol=1e-5, rtol=1e-5)
            compared += 1
    assert compared == len(rows)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_packed_batch_has_the_padded_batchs_loss(llama, attn):
    """The mean over every label token: the padded batch of the examples, and the packed blocks
    of the same examples, give the same loss (and so the same gradient)."""
    model = _model(llama, attn)
    rows = _examples(np.random.default_rng(3), 12, 40)
    padded, _, _ = model_inputs(collate(rows, PAD))
    packed, _, _ = model_inputs(collate(_blocks(rows, 64), PAD))

    def loss(batch):
        n = (batch["labels"][..., 1:] != IGNORE).sum()
        return model(**batch, num_items_in_batch=n).loss, int(n)

    with torch.no_grad():
        (a, n_a), (b, n_b) = loss(padded), loss(packed)
    assert n_a == n_b
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
