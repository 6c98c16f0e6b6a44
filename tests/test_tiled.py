"""--tiled_mlp in one process: the tiled MLPs and loss give the untiled model's loss and gradients
(tiles that leave some empty, a tied lm_head, a mean in evaluation); what cannot be tiled right is
refused with exit 2 before training (tiled.check, the flag checks). The same on 2 ZeRO-3 ranks:
tests/e2e/test_tiled_runs.py."""

from __future__ import annotations

import copy

import pytest
import torch

from finetune.config import ConfigError
from finetune.data.formats import IGNORE
from finetune.resolve import resolve
from finetune.tiled import apply, check, tiles


def _llama(tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _batch(rows: int = 2, width: int = 13) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (rows, width))
    labels = ids.clone()
    labels[0, :4] = IGNORE  # a masked prompt
    labels[-1, width - 3 :] = IGNORE  # padding
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("tied", [False, True])
def test_tiled_loss_and_gradients_are_the_models(tied):
    plain = _llama(tied)
    tiled = copy.deepcopy(plain)
    # tiles of up to 32 tokens (the hidden size): 4 for the MLPs (rows of up to 128 tokens), 6 for
    # the loss (forwards of up to 192); rows of 13 tokens: MLP tiles of 4, the last one short;
    # loss tiles of 3, the last one empty
    assert apply(tiled, 128, 192) == (4, 6)
    batch = _batch()
    items = float((batch["labels"][:, 1:] != IGNORE).sum())
    want = plain(**batch).loss  # the mean over the label tokens
    got = tiled(**batch, num_items_in_batch=items)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want, rtol=1e-6, atol=0)
    want.backward()
    got.loss.backward()
    grads = dict(tiled.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-7)
    tiled.eval()
    with torch.no_grad():  # evaluation: the mean over the batch's own label tokens
        torch.testing.assert_close(tiled(**batch).loss, plain(**batch).loss, rtol=1e-6, atol=0)


def test_tile_counts_round_up_and_never_reach_zero():
    assert tiles(1, 4096) == 1
    assert tiles(4097, 4096) == 2
    assert tiles(16384, 4096) == 4  # a 16k row of Llama-3-8B: 4 tiles of 2.1 GB of logits


def _config_model(kind: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        kind,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        **extra,
    )
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    "kind, extra, says",
    [
        ("mixtral", {"num_local_experts": 4}, "routes its MLPs to 4 experts"),
        ("gemma2", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ],
)
def test_a_model_the_tiles_would_change_is_refused(kind, extra, says):
    with pytest.raises(ConfigError) as e:
        check(_config_model(kind, **extra))
    assert "`--tiled_mlp`" in str(e.value) and says in str(e.value)


def test_a_plain_llama_is_taken():
    check(_llama(tied=True))


def test_flags_tiling_cannot_work_with_are_refused():
    with pytest.raises(ConfigError, match="`--tiled_mlp` does not work with `--use_peft`"):
        resolve({"tiled_mlp": True, "use_peft": True}, world_size=1)
