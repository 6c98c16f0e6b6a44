"""Model and tokenizer loading.

Under ZeRO-3 the model is built partitioned: transformers sees a live ``HfDeepSpeedConfig`` and
wraps construction / ``from_pretrained`` in ``deepspeed.zero.Init``, so no rank ever materialises
the full model (and weights are loaded shard by shard into the partitions).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from finetune.config import RESOURCES_DIR, ConfigError, ModelArgs
from finetune.distributed import logger
from finetune.ds_config import zero_stage

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EMBEDDED_MODEL_DIR = RESOURCES_DIR / "model"
EMBEDDED_TOKENIZER_DIR = RESOURCES_DIR / "tokenizer"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# What a checkpoint's partitions fit only if equal: the architecture and the shapes of its tensors.
# (PretrainedConfig's attribute_map gives every model type these names, e.g. gpt2's n_embd.)
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def load_tokenizer(args: ModelArgs) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    name = (
        args.tokenizer_name
        or args.model_name_or_path
        or args.config_name
        or str(EMBEDDED_TOKENIZER_DIR)
    )
    if name == args.config_name and args.tokenizer_name is None and _is_embedded_name(name):
        name = str(EMBEDDED_TOKENIZER_DIR)
    try:
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:
        flag = (
            "--tokenizer_name"
            if args.tokenizer_name
            else "--model_name_or_path"
            if args.model_name_or_path
            else "--config_name"
        )
        raise ConfigError(
            f"{flag}: cannot load a tokenizer from '{name}': {_first_line(e)}"
        ) from None
    if tok.pad_token is None:
        # Causal LMs often ship without one; padded positions are masked from loss and attention.
        if tok.eos_token is None:
            raise ConfigError(
                f"--tokenizer_name: tokenizer '{name}' has neither a pad nor an eos token"
            )
        tok.pad_token = tok.eos_token
        logger.info("tokenizer has no pad token; using eos (%r) for padding", tok.eos_token)
    return tok


def _is_embedded_name(name: str) -> bool:
    return str(name) == str(EMBEDDED_MODEL_DIR)


def load_model(args: ModelArgs, ds_config: dict, precision: str, seed: int) -> PreTrainedModel:
    """Build or load the model; partitioned at construction when the config is ZeRO-3."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    # Must stay referenced while the model is built: transformers holds only a weakref to it.
    hf_ds = HfDeepSpeedConfig(ds_config) if zero_stage(ds_config) == 3 else None
    dtype = DTYPES[precision]
    torch.manual_seed(seed)
    kernel = {"attn_implementation": args.attn_implementation} if args.attn_implementation else {}
    if args.model_name_or_path:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                args.model_name_or_path,
                dtype=dtype,
                trust_remote_code=args.trust_remote_code,
                **kernel,
            )
        except (OSError, ValueError, ImportError) as e:
            _attention_error(args, e)
            raise ConfigError(
                f"--model_name_or_path: cannot load '{args.model_name_or_path}': {_first_line(e)}"
            ) from None
    else:
        source = args.config_name or str(EMBEDDED_MODEL_DIR)
        try:
            config = AutoConfig.from_pretrained(source, trust_remote_code=args.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"--config_name: cannot load a config from '{source}': {_first_line(e)}"
            ) from None
        try:
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, trust_remote_code=args.trust_remote_code, **kernel
            )
        except (ValueError, ImportError) as e:
            _attention_error(args, e)
            raise
    _KEEPALIVE.append(hf_ds)  # transformers checks it again later (generate, resize, checkpointing)
    if args.gradient_checkpointing:
        # transformers >= 5.2x; the old name warns
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    # Training never reads the KV cache; building it costs time. (Restored in saved configs.)
    model.config.use_cache = False
    if args.use_liger_kernel:  # resolve checked the package and the GPU
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    if args.neftune_noise_alpha:
        add_neftune(model, args.neftune_noise_alpha)
    if args.use_peft:  # the base frozen, LoRA adapters added (finetune/lora.py)
        from finetune.lora import apply_lora

        model = apply_lora(
            model, args, args.model_name_or_path or args.config_name or str(EMBEDDED_MODEL_DIR)
        )
    return model


_KEEPALIVE: list = []


def _attention_error(args: ModelArgs, e: BaseException) -> None:
    """transformers refusing --attn_implementation (this model has no such kernel) → exit 2."""
    if args.attn_implementation and "attn" in str(e).lower():
        raise ConfigError(
            f"--attn_implementation {args.attn_implementation}: {_first_line(e)}"
        ) from None


def add_neftune(model: PreTrainedModel, alpha: float) -> None:
    """NEFTune (Jain et al. 2023, as HF Trainer's --neftune_noise_alpha): uniform noise of scale
    alpha / sqrt(sequence length x hidden size) on the input embeddings, in training mode only.
    Drawn from the torch RNG, whose state every checkpoint keeps: a resume draws the same noise."""
    import math

    def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if module.training:
            scale = alpha / math.sqrt(output.size(-2) * output.size(-1))
            output = output + torch.zeros_like(output).uniform_(-scale, scale)
        return output

    model.get_input_embeddings().register_forward_hook(hook)


def accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    """Does the model's forward take transformers' loss kwargs (num_items_in_batch)? Its own
    ``accepts_loss_kwargs`` where it says, else whether its forward takes **kwargs (what HF
    Trainer checks). A peft model: its base model's."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    said = getattr(base, "accepts_loss_kwargs", None)
    if said is not None:
        return bool(said)
    params = inspect.signature(base.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def check_checkpoint_model(folder: str | os.PathLike, args: ModelArgs) -> None:
    """The model this run builds is the one ``folder`` (a checkpoint) was saved from: the same
    architecture and shapes. Otherwise loading its partitions fails deep inside DeepSpeed (missing
    keys, size mismatches), after the engine is built; this says which flag and which value."""
    from transformers import AutoConfig

    flag, source, shown = _model_source(args)
    try:
        saved = AutoConfig.from_pretrained(folder, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--resume_from_checkpoint: {folder}/config.json is unreadable: {_first_line(e)}"
        ) from None
    try:
        now = AutoConfig.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{flag}: cannot load a config from '{shown}': {_first_line(e)}"
        ) from None
    differ = [
        f"{k} {getattr(saved, k, None)} vs {getattr(now, k, None)}"
        for k in SHAPE_KEYS
        if getattr(saved, k, None) != getattr(now, k, None)
    ]
    if differ:
        raise ConfigError(
            f"--resume_from_checkpoint: {folder} holds another model than {flag} {shown} "
            f"({'; '.join(differ)}: checkpoint vs model); resume with the model it was trained from"
        )


def _model_source(args: ModelArgs) -> tuple[str, str, str]:
    """The flag the model's config comes from, where it is read, and how messages name it."""
    if args.model_name_or_path:
        return "--model_name_or_path", args.model_name_or_path, args.model_name_or_path
    if args.config_name:
        return "--config_name", args.config_name, args.config_name
    return "--model_name_or_path", str(EMBEDDED_MODEL_DIR), "(not given: the embedded model)"


def count_parameters(model: torch.nn.Module) -> int:
    # Under ZeRO-3 a parameter's local tensor is a shard; ds_numel is the full size.
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
