"""The consolidated writer on plain (unpartitioned) models, one process: format, ties, frozen, shards."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from finetune.checkpoint.consolidate import (
    INDEX,
    plan_shards,
    save_consolidated,
    tensor_entries,
)


def tiny(model_type: str, tied: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=97, tie_word_embeddings=tied)
    if model_type == "gpt2":
        kw.update(n_embd=32, n_layer=2, n_head=2, n_positions=64)
    else:
        kw.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw))


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("qwen2", True), ("gpt2", True)])
def test_round_trip_matches_save_pretrained_keys_and_values(tmp_path, model_type, tied):
    from transformers import AutoModelForCausalLM

    model = tiny(model_type, tied)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False) if model_type != "gpt2" else \
        model.transformer.h[0].mlp.c_fc.weight.requires_grad_(False)  # a frozen parameter comes out too
    files = save_consolidated(model, tmp_path, torch.float32, "8KB")
    model.config.save_pretrained(tmp_path)
    index = json.loads((tmp_path / INDEX).read_text())
    assert set(files) == set(index["weight_map"].values()) | {INDEX}
    reference = tmp_path / "ref"
    model.save_pretrained(reference)
    ref_keys = set(load_file(reference / "model.safetensors"))
    ours = {}
    for shard in set(index["weight_map"].values()):
        ours.update(load_file(tmp_path / shard))
    assert set(ours) == ref_keys  # the same keys save_pretrained writes (tied copies dropped)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    x = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x).logits, model.eval()(x).logits)


def test_single_shard_is_model_safetensors_and_dtype_cast(tmp_path):
    model = tiny("llama", False)
    files = save_consolidated(model, tmp_path, torch.bfloat16, "5GB")
    assert set(files) == {"model.safetensors"}
    sd = load_file(tmp_path / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    assert torch.equal(sd["lm_head.weight"], model.lm_head.weight.detach().to(torch.bfloat16))


def test_shard_plan_keeps_gather_order_and_respects_the_limit():
    model = tiny("llama", False)
    entries = tensor_entries(model)
    plan, meta = plan_shards(entries, torch.float32, "10KB")
    flat = [n for names in plan.filename_to_tensors.values() for n in names]
    assert flat == [e[0] for e in entries]
    for names in plan.filename_to_tensors.values():
        size = sum(meta[n].numel() * 4 for n in names)
        assert size <= 10_000 or len(names) == 1  # only a single oversized tensor may exceed it
    assert plan.total_size == sum(p.numel() * 4 for p in model.parameters())


def test_write_error_surfaces_as_oserror_after_the_last_module(tmp_path):
    model = tiny("llama", False)
    plan, _ = plan_shards(tensor_entries(model), torch.float32, "20KB")
    second = list(plan.filename_to_tensors)[1]
    (tmp_path / second).mkdir()  # a directory where a shard file must go
    with pytest.raises(IsADirectoryError):
        save_consolidated(model, tmp_path, torch.float32, "20KB")
