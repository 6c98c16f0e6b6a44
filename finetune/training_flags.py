"""Checks of the flags that shape what the model learns from, beyond the data: the learning-rate
schedule's own arguments and warmup (--lr_scheduler_kwargs, --warmup_ratio), and the kernels and
noise (--attn_implementation, --use_liger_kernel, --neftune_noise_alpha). resolve calls them before
any file is read; each failure names its flag (exit 2 before anything is written).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from typing import Any

from finetune.config import ConfigError

# Each schedule's own arguments (--lr_scheduler_kwargs): those of transformers' schedule function
# (tests/test_schedules.py checks them against the installed transformers), and those it requires.
SCHEDULER_KWARGS = {
    "linear": (),
    "cosine": ("num_cycles",),
    "constant": (),
    "constant_with_warmup": (),
    "cosine_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate"),
    "warmup_stable_decay": (
        "num_decay_steps",
        "num_stable_steps",
        "warmup_type",
        "decay_type",
        "min_lr_ratio",
        "num_cycles",
    ),
}
# Attention kernels transformers accepts by name (a hub kernel, "org/repo", also passes), and the
# package each needs beyond transformers.
ATTN_IMPLEMENTATIONS = {
    "eager": None,
    "sdpa": None,
    "flex_attention": None,
    "flash_attention_2": "flash_attn",
    "flash_attention_3": "flash_attn_interface",
}


def resolve_schedule(v: dict[str, Any]) -> None:
    """--lr_scheduler_kwargs (JSON text on the command line, a mapping in a --config file) checked
    against the schedule's own arguments; --warmup_ratio / a fractional --warmup_steps kept as a
    fraction (resolved against the run's steps once the data is known: build.warmup_steps)."""
    name, kw = v["lr_scheduler_type"], v["lr_scheduler_kwargs"]
    example = """'{"min_lr_rate": 0.1}'"""
    if isinstance(kw, str):
        try:
            kw = json.loads(kw)
        except ValueError as e:
            raise ConfigError(
                f"`--lr_scheduler_kwargs` must be a JSON dict like {example}: {e}"
            ) from None
    if kw is not None and not isinstance(kw, dict):
        raise ConfigError(f"`--lr_scheduler_kwargs` must be a JSON dict like {example}, got {kw!r}")
    kw = kw or {}
    allowed = SCHEDULER_KWARGS[name]
    bad = sorted(set(kw) - set(allowed))
    if bad:
        raise ConfigError(
            f"`--lr_scheduler_kwargs`: {', '.join(bad)} is not an argument of "
            f"`--lr_scheduler_type {name}` (it takes: {', '.join(allowed) or 'none'})"
        )
    if name == "cosine_with_min_lr" and sum(k in kw for k in ("min_lr", "min_lr_rate")) != 1:
        raise ConfigError(
            "`--lr_scheduler_type cosine_with_min_lr` needs exactly one of min_lr, min_lr_rate "
            f"in `--lr_scheduler_kwargs` (e.g. {example})"
        )
    if name == "warmup_stable_decay" and "num_decay_steps" not in kw:
        raise ConfigError(
            "`--lr_scheduler_type warmup_stable_decay` needs num_decay_steps in "
            """`--lr_scheduler_kwargs` (e.g. '{"num_decay_steps": 100, "min_lr_ratio": 0.1}')"""
        )
    for key, low, high in (("min_lr", 0, None), ("min_lr_rate", 0, 1), ("min_lr_ratio", 0, 1)):
        value = kw.get(key)
        if value is not None and not (
            isinstance(value, (int, float)) and low <= value and (high is None or value <= high)
        ):
            span = f"in [{low}, {high}]" if high is not None else "a number >= 0"
            raise ConfigError(f"`--lr_scheduler_kwargs`: {key} must be {span}, got {value!r}")
    for key in ("num_decay_steps", "num_stable_steps"):
        value = kw.get(key)
        if value is not None and not (isinstance(value, int) and value >= 0):
            raise ConfigError(
                f"`--lr_scheduler_kwargs`: {key} must be a whole number of steps, got {value!r}"
            )
    v["lr_scheduler_kwargs"] = kw or None
    steps, ratio = v["warmup_steps"], v["warmup_ratio"]
    if ratio is not None:
        if steps is not None:
            raise ConfigError("Can't give both `--warmup_steps` and `--warmup_ratio`")
        if not 0 <= ratio < 1:
            raise ConfigError(f"`--warmup_ratio` must be in [0, 1), got {ratio}")
        v["warmup_steps"] = ratio
    elif steps is not None and steps >= 1:
        if steps != int(steps):
            raise ConfigError(
                "`--warmup_steps` must be a whole number of steps, or a fraction of the run's "
                f"steps below 1, got {steps}"
            )
        v["warmup_steps"] = int(steps)


def check_kernels(v: Mapping[str, Any]) -> None:
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
    alpha = v["neftune_noise_alpha"]
    if alpha is not None and not alpha > 0:
        raise ConfigError(f"`--neftune_noise_alpha` must be positive, got {alpha}")
