"""finetune.modeling: the checks around loading (no model is built here)."""

from __future__ import annotations

import pytest

from finetune.config import ConfigError, ModelArgs
from finetune.modeling import EMBEDDED_MODEL_DIR, check_checkpoint_model


def _config_dir(root, name: str, model_type: str, **kw) -> str:
    """A folder holding only a config.json: all a checkpoint or model needs for this check."""
    from transformers import AutoConfig

    folder = root / name
    AutoConfig.for_model(model_type, **kw).save_pretrained(folder)
    return str(folder)


LLAMA = dict(
    vocab_size=513,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
)
GPT2 = dict(vocab_size=513, n_embd=64, n_layer=2, n_head=4)


def test_the_same_model_resumes(tmp_path):
    ckpt = _config_dir(tmp_path, "ckpt", "llama", **LLAMA)
    check_checkpoint_model(
        ckpt, ModelArgs(model_name_or_path=_config_dir(tmp_path, "model", "llama", **LLAMA))
    )


@pytest.mark.parametrize(
    "model_type, kw, differ",
    [
        ("gpt2", GPT2, "model_type llama vs gpt2"),
        ("llama", {**LLAMA, "vocab_size": 1024}, "vocab_size 513 vs 1024"),
        ("llama", {**LLAMA, "num_hidden_layers": 3}, "num_hidden_layers 2 vs 3"),
    ],
    ids=["architecture", "vocabulary", "depth"],
)
def test_another_model_is_named_before_deepspeed_loads_it(model_type, kw, differ, tmp_path):
    """Else: a traceback from DeepSpeed's load_checkpoint (missing keys, size mismatch), exit 1."""
    ckpt = _config_dir(tmp_path, "ckpt", "llama", **LLAMA)
    model = _config_dir(tmp_path, "model", model_type, **kw)
    with pytest.raises(ConfigError) as e:
        check_checkpoint_model(ckpt, ModelArgs(model_name_or_path=model))
    message = str(e.value)
    assert message.startswith(
        f"--resume_from_checkpoint: {ckpt} holds another model than --model_name_or_path {model}"
    )
    assert differ in message, message


def test_the_embedded_model_is_named_when_no_model_flag_was_given(tmp_path):
    ckpt = _config_dir(tmp_path, "ckpt", "llama", **LLAMA)
    with pytest.raises(
        ConfigError, match=r"--model_name_or_path \(not given: the embedded model\)"
    ):
        check_checkpoint_model(ckpt, ModelArgs())
    check_checkpoint_model(str(EMBEDDED_MODEL_DIR), ModelArgs())


# --- kernels and noise -----------------------------------------------------------------------


def _load(**model_flags):
    from finetune.modeling import load_model

    return load_model(ModelArgs(**model_flags), {"train_batch_size": 1}, "fp32", seed=0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attn_implementation_reaches_the_model(attn):
    assert _load(attn_implementation=attn).config._attn_implementation == attn


def test_neftune_noises_embeddings_in_training_only():
    import torch

    model = _load(neftune_noise_alpha=5.0)
    emb = model.get_input_embeddings()
    ids = torch.tensor([[1, 2, 3, 4]])
    clean = torch.nn.functional.embedding(ids, emb.weight)
    model.train()
    noisy = emb(ids)
    bound = 5.0 / (ids.shape[1] * clean.shape[-1]) ** 0.5
    assert 0 < (noisy - clean).abs().max() <= bound + 1e-6
    model.eval()
    assert torch.equal(emb(ids), clean)


def test_loss_kwargs_are_passed_only_to_models_that_take_them():
    import torch

    from finetune.modeling import accepts_loss_kwargs

    assert accepts_loss_kwargs(_load())

    class Plain(torch.nn.Module):
        def forward(self, input_ids, labels=None, attention_mask=None):
            return None

    assert not accepts_loss_kwargs(Plain())
