"""The model's flags (``ModelArgs``): what is loaded or built, LoRA, the attention kernel and
the fused kernels; and their checks, on the values alone."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from finetune.config.fields import ConfigError, flag, require_positive, split_names

# A model folder's weights, in any layout transformers loads (single file or sharded with an index).
WEIGHT_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "tf_model.h5",
    "flax_model.msgpack",
    "model.ckpt.index",
)
LORA_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_modules_to_save")
# Attention kernels transformers accepts by name (a hub kernel, "org/repo", also passes), and the
# package each needs beyond transformers.
ATTN_IMPLEMENTATIONS = {
    "eager": None,
    "sdpa": None,
    "flex_attention": None,
    "flash_attention_2": "flash_attn",
    "flash_attention_3": "flash_attn_interface",
}


@dataclass(frozen=True)
class ModelArgs:
    model_name_or_path: str | None = flag(
        None, "Hub id or local directory of a causal LM (default: the embedded tiny model)."
    )
    config_name: str | None = flag(
        None, "Config (hub id or dir) to train a model from scratch instead of loading weights."
    )
    tokenizer_name: str | None = flag(None, "Tokenizer hub id or dir (default: the model's).")
    trust_remote_code: bool = flag(
        False, "Allow model/tokenizer code from the hub or model dir to run (off by default)."
    )
    gradient_checkpointing: bool = flag(False, "Recompute activations in backward to save memory.")
    # LoRA, with TRL's flag names (finetune/lora.py).
    use_peft: bool = flag(
        False,
        "Train LoRA adapters (peft) instead of every weight: the base model stays frozen (and "
        "partitioned), and checkpoints hold only the adapters' trainable state.",
    )
    lora_r: int = flag(16, "LoRA rank.")
    lora_alpha: int = flag(32, "LoRA alpha: the adapters' output is scaled by alpha / r.")
    lora_dropout: float = flag(0.05, "Dropout on the input of the LoRA branch.")
    lora_target_modules: str | None = flag(
        None,
        "Modules that get adapters: names (space- or comma-separated, e.g. "
        "q_proj v_proj) or all-linear (every linear layer but the output head); "
        "default: peft's choice for the architecture (q_proj v_proj for Llama).",
        nargs="+",
    )
    lora_modules_to_save: str | None = flag(
        None,
        "Modules trained in full beside the adapters and saved with them (e.g. lm_head).",
        nargs="+",
    )
    attn_implementation: str | None = flag(
        None,
        "Attention kernel, passed to from_pretrained / from_config: eager, sdpa, "
        "flash_attention_2, flash_attention_3, flex_attention, or another the installed "
        "transformers accepts (default: transformers' choice, sdpa where available). With "
        "--packing and flash_attention_*, each micro-batch is one row of whole examples "
        "(varlen, no padding).",
    )
    use_liger_kernel: bool = flag(
        False,
        "Patch the model with Liger's fused Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear "
        "cross-entropy): less memory, faster steps. Needs a CUDA GPU and "
        "`pip install liger-kernel`.",
    )
    neftune_noise_alpha: float | None = flag(
        None,
        "NEFTune: add uniform noise of scale alpha / sqrt(sequence length x hidden size) to the "
        "input embeddings while training (not in evaluation), as HF Trainer's flag; e.g. 5.",
    )

    @classmethod
    def check(cls, v: Mapping[str, Any]) -> None:
        """The model flags' own rules, on the flag values before anything is loaded: each
        failure names its flag."""
        if v["config_name"] and v["model_name_or_path"]:
            raise ConfigError(
                "Can't give both `--config_name` (train from scratch) and "
                "`--model_name_or_path` (load weights)"
            )
        _check_lora(v)
        _check_kernels(v)


def _check_lora(v: Mapping[str, Any]) -> None:
    """The LoRA flags: meaningful only with --use_peft (a value other than the default without
    it is a mistake), and in range."""
    if not v["use_peft"]:
        defaults = {f.name: f.default for f in dataclasses.fields(ModelArgs)}
        given = [f"--{k}" for k in LORA_FLAGS if v[k] != defaults[k]]
        if given:
            raise ConfigError(
                f"{', '.join(f'`{g}`' for g in given)} "
                f"need{'s' if len(given) == 1 else ''} `--use_peft`"
            )
        return
    require_positive(v, ("lora_r", "lora_alpha"))
    if not 0 <= v["lora_dropout"] < 1:
        raise ConfigError(f"`--lora_dropout` must be in [0, 1), got {v['lora_dropout']}")
    for name in ("lora_target_modules", "lora_modules_to_save"):
        if v[name] is not None and not split_names(v[name]):
            raise ConfigError(f"`--{name}` names no module, got {v[name]!r}")


def _check_kernels(v: Mapping[str, Any]) -> None:
    """--attn_implementation, --use_liger_kernel, --neftune_noise_alpha: what they need is here
    (checked before anything is written; transformers would fail only once the model loads)."""
    name = v["attn_implementation"]
    if name is not None and "/" not in name:  # "org/repo": a hub kernel transformers fetches
        if name not in ATTN_IMPLEMENTATIONS:
            raise ConfigError(
                f"`--attn_implementation`: unknown kernel {name!r} (choose from "
                f"{', '.join(ATTN_IMPLEMENTATIONS)}, or a hub kernel org/repo)"
            )
        package = ATTN_IMPLEMENTATIONS[name]
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"`--attn_implementation {name}` needs the {package} package and a CUDA GPU "
                f"(pip install {'flash-attn' if package == 'flash_attn' else package}); "
                "sdpa needs nothing"
            )
    if v["use_liger_kernel"]:
        if importlib.util.find_spec("liger_kernel") is None:
            raise ConfigError(
                "`--use_liger_kernel` needs the liger-kernel package: pip install liger-kernel"
            )
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "`--use_liger_kernel` needs a CUDA GPU (Liger's kernels are Triton); none is "
                "visible to this process"
            )
    require_positive(v, ("neftune_noise_alpha",))
