"""--sequence_parallel_size in one process: a micro-batch cut into N shards (data/sequence.py) is
the padded batch, shifted once, dealt in contiguous slices that lose and repeat no token; and what
Ulysses cannot run right is refused with exit 2 before training (sequence_parallel.check, the flag
checks)."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from finetune.config import ConfigError
from finetune.data.formats import IGNORE, label_tokens
from finetune.data.load import NUM_ROWS, NUM_TOKENS, collate
from finetune.data.sequence import shard
from finetune.resolve import resolve
from finetune.sequence_parallel import check

from conftest import base_ds, write_ds

PAD = 0


def _rows(lengths: list[int], packed: bool = False) -> list[dict]:
    rows = []
    for i, n in enumerate(lengths):
        ids = [(7 * i + j) % 50 + 1 for j in range(n)]
        labels = [IGNORE if j < i % 3 else x for j, x in enumerate(ids)]  # a masked prompt
        row = {"input_ids": ids, "labels": labels}
        if packed:  # two examples per block
            row["position_ids"] = list(range(n // 2)) + list(range(n - n // 2))
        rows.append(row)
    return rows


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 23), min_size=1, max_size=4),
    n=st.integers(1, 5),
    packed=st.booleans(),
)
def test_the_shards_are_the_padded_batch_shifted_once(lengths, n, packed):
    batch = collate(_rows(lengths, packed), PAD, flatten=packed)  # packed: one varlen row
    shards = [shard(batch, n, r, PAD) for r in range(n)]
    width = batch["input_ids"].shape[1]
    padded = -(-width // n) * n
    whole = {k: torch.cat([s[k] for s in shards], 1) for k in ("input_ids", "shift_labels")}
    assert all(s["input_ids"].shape[1] == padded // n for s in shards)
    assert torch.equal(whole["input_ids"][:, :width], batch["input_ids"])
    assert (whole["input_ids"][:, width:] == PAD).all()
    # each token's target is the next token's label, the row's last (and the padding's) none
    assert torch.equal(whole["shift_labels"][:, : width - 1], batch["labels"][:, 1:])
    assert (whole["shift_labels"][:, width - 1 :] == IGNORE).all()
    assert all(torch.equal(s["labels"], s["shift_labels"]) for s in shards)
    positions = torch.cat([s["position_ids"] for s in shards], 1)
    if packed:
        assert torch.equal(positions[:, :width], batch["position_ids"])
    else:
        assert torch.equal(positions, torch.arange(padded).expand_as(positions))
    # every token and every label counted once over the shards; every shard has the rows
    assert sum(int(s[NUM_TOKENS]) for s in shards) == int(batch[NUM_TOKENS])
    assert sum(label_tokens(s) for s in shards) == label_tokens(batch)
    assert all(int(s[NUM_ROWS]) == len(lengths) and "attention_mask" not in s for s in shards)
    assert all(s["input_ids"].shape[0] == (1 if packed else len(lengths)) for s in shards)
    assert all(s["input_ids"].is_contiguous() for s in shards)


def _model(n_heads=4, kv=2, attn="sdpa", **extra):
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=n_heads,
        num_key_value_heads=kv,
        **extra,
    )
    config._attn_implementation = attn
    return types.SimpleNamespace(config=config)


@pytest.mark.parametrize(
    "model, n, says",
    [
        (_model(attn="eager"), 2, "needs `--attn_implementation` sdpa"),
        (_model(n_heads=6, kv=6), 4, "must divide the model's 6 attention heads"),
        (_model(n_heads=12, kv=3), 2, "must divide the model's 3 key-value heads"),
        (_model(layer_types=["full_attention", "sliding_attention"]), 2, "sliding_attention"),
    ],
)
def test_a_model_ulysses_cannot_split_is_refused(model, n, says):
    with pytest.raises(ConfigError) as e:
        check(model, n, loss_kwargs=True)
    assert f"--sequence_parallel_size {n}" in str(e.value) and says in str(e.value)


def test_fewer_key_value_heads_than_ranks_are_taken_and_a_model_without_loss_kwargs_is_not():
    check(_model(n_heads=4, kv=2), 4, loss_kwargs=True)  # DeepSpeed replicates the KV heads
    with pytest.raises(ConfigError, match="shift_labels"):
        check(_model(), 2, loss_kwargs=False)


def test_a_mistral_sliding_window_is_refused():
    from transformers import MistralConfig

    config = MistralConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, sliding_window=64
    )
    config._attn_implementation = "sdpa"
    with pytest.raises(ConfigError, match="sliding window of 64"):
        check(types.SimpleNamespace(config=config), 2, loss_kwargs=True)


@pytest.mark.parametrize(
    "values, world, says",
    [
        ({"sequence_parallel_size": 3}, 4, "must divide the world size (4 ranks)"),
        ({"sequence_parallel_size": 0}, 2, "`--sequence_parallel_size` must be positive"),
        ({"sequence_parallel_size": 2, "packing": True}, 2, "needs `--attn_implementation"),
        ({"sequence_parallel_size": 2, "use_liger_kernel": True}, 2, "`--use_liger_kernel`"),
        ({"sequence_parallel_size": 2, "neftune_noise_alpha": 5.0}, 2, "--neftune_noise_alpha"),
    ],
)
def test_flags_sequence_parallelism_cannot_work_with_are_refused(values, world, says):
    with pytest.raises(ConfigError) as e:
        resolve(values, world_size=world)
    assert says in str(e.value)


def test_the_step_batch_counts_data_parallel_ranks_only():
    values = {"sequence_parallel_size": 2, "per_device_train_batch_size": 3}
    cfg = resolve(values, world_size=4)
    assert cfg.ds_config["train_batch_size"] == 3 * 2  # 4 ranks, 2 rows at a time


def test_a_deepspeed_json_without_reduce_scatter_is_refused(tmp_path):
    """ZeRO-3's reduce-scatter averages gradients over every rank, what the shards' losses are
    weighed for; without it ZeRO-3 averages some buckets over world / N."""
    ds = base_ds()
    ds["zero_optimization"] = {**ds["zero_optimization"], "reduce_scatter": False}
    values = {"sequence_parallel_size": 2, "deepspeed_config": write_ds(tmp_path, ds)}
    with pytest.raises(ConfigError, match="needs `zero_optimization.reduce_scatter: true`"):
        resolve(values, world_size=2)
