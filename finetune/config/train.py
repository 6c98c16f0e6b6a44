"""The training flags (``TrainArgs``): the DeepSpeed JSON, batch and optimizer, the learning-rate
schedule, how long, precision, logging and trackers, the collective timeout, the best checkpoint's
metric and early stopping; and their checks, on the values alone."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from finetune.config.fields import (
    DEFAULT_DS_CONFIG,
    ConfigError,
    flag,
    require_not_negative,
    require_positive,
)

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
SCHEDULERS = (
    "linear",
    "cosine",
    "constant",
    "constant_with_warmup",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)
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
_KWARGS_EXAMPLE = """'{"min_lr_rate": 0.1}'"""
TRACKERS = ("tensorboard", "wandb", "csv")
DEFAULT_DDP_TIMEOUT = 900
# Below this a healthy peer that is merely slow (a checkpoint fsync, a
# page-cache stall) fails the run.
MIN_DDP_TIMEOUT = 10
# The collective timeout's older spelling, in minutes; still read when --ddp_timeout is not given.
LEGACY_TIMEOUT_ENV = "FINETUNE_DIST_TIMEOUT_MIN"
# What Trainer.evaluate writes into an eval row besides "step" and "eval_tokens": the values
# --metric_for_best_model may name.
METRICS = ("eval_loss", "eval_perplexity")
# What it writes instead of the perplexity under a preference --objective (TRL's names).
PREFERENCE_METRICS = (
    "eval_rewards/chosen",
    "eval_rewards/rejected",
    "eval_rewards/accuracies",
    "eval_rewards/margins",
    "eval_logps/chosen",
    "eval_logps/rejected",
)
DEFAULT_METRIC = "eval_loss"


@dataclass(frozen=True)
class TrainArgs:
    deepspeed_config: str = flag(
        DEFAULT_DS_CONFIG, 'DeepSpeed JSON; "auto" values are filled from these flags.'
    )
    per_device_train_batch_size: int | None = flag(None, "Micro batch per rank (default 8).")
    per_device_eval_batch_size: int = flag(8, "Eval batch per rank.")
    gradient_accumulation_steps: int | None = flag(
        None, "Micro batches per optimizer step (default 1)."
    )
    learning_rate: float | None = flag(
        None, "Peak learning rate (default 5e-5; 1e-3 for the embedded model)."
    )
    weight_decay: float | None = flag(
        None, "AdamW weight decay, not applied to biases and norms (default 0.0)."
    )
    adam_beta1: float | None = flag(None, "AdamW beta1 (default 0.9).")
    adam_beta2: float | None = flag(None, "AdamW beta2 (default 0.999).")
    adam_epsilon: float | None = flag(None, "AdamW epsilon (default 1e-8).")
    max_grad_norm: float | None = flag(None, "Gradient clipping norm, 0 disables (default 1.0).")
    lr_scheduler_type: str = flag(
        "linear",
        "Learning-rate schedule after warmup (transformers' get_scheduler, with its semantics). "
        "cosine_with_min_lr needs min_lr or min_lr_rate in --lr_scheduler_kwargs; "
        "warmup_stable_decay needs num_decay_steps (and takes min_lr_ratio, num_stable_steps, "
        "decay_type, warmup_type).",
        choices=SCHEDULERS,
    )
    lr_scheduler_kwargs: dict | None = flag(
        None,
        "The schedule's own arguments as a JSON dict (a mapping in a --config file), as HF's "
        """flag: e.g. '{"min_lr_rate": 0.1}' for cosine_with_min_lr, """
        """'{"num_decay_steps": 100, "min_lr_ratio": 0.1}' for warmup_stable_decay.""",
        json=dict,
    )
    warmup_steps: float | None = flag(
        None,
        "Linear warmup: a whole number of steps, or a fraction of the run's steps when below 1 "
        "(transformers 5's spelling of a ratio; rounded up) (default 0; 10 for the embedded "
        "model).",
    )
    warmup_ratio: float | None = flag(
        None,
        "Linear warmup as a fraction of the run's steps (rounded up), in [0, 1): the same as "
        "--warmup_steps below 1; exclusive with --warmup_steps.",
    )
    num_train_epochs: float | None = flag(
        None, "Epochs to train (default 3); exclusive with --max_steps.", resume_may_change=True
    )
    max_steps: int | None = flag(
        None, "Optimizer steps to train; exclusive with --num_train_epochs.", resume_may_change=True
    )
    seed: int = flag(42, "Seed for model init, data order and dropout.")
    precision: str = flag(
        "auto", "auto = bf16 where the accelerator supports it, else fp32.", choices=PRECISIONS
    )
    sequence_parallel_size: int = flag(
        1,
        "Ranks that share each row (DeepSpeed's Ulysses sequence parallelism): each holds 1/N of "
        "its tokens and attention exchanges them all-to-all, so rows about N times longer fit. "
        "The world size must be a multiple of N; the N ranks of a group train on the same rows "
        "(data-parallel ranks = world size / N). Needs sdpa or flash_attention_2/3 (with "
        "--packing, flash_attention_2/3); evaluation runs whole rows on each rank. A resume may "
        "change it (the checkpoint's layout does not depend on it).",
        resume_may_change=True,
    )
    tiled_mlp: bool = flag(
        False,
        "Compute each MLP and the logits + loss in tiles along the sequence (DeepSpeed's tiled "
        "compute, Arctic Long Sequence Training), recomputed one tile at a time in the backward: "
        "their activations and the logits are never held for a whole row, for about one more "
        "forward of the MLPs and lm_head. For long rows, with or without "
        "--sequence_parallel_size; not with --use_peft or --use_liger_kernel. A resume may "
        "change it.",
        resume_may_change=True,
    )
    logging_steps: int | None = flag(
        None,
        "Log train metrics every N optimizer steps (default 10; 5 for the embedded model).",
        resume_may_change=True,
    )
    eval_steps: int | None = flag(
        None,
        "Evaluate every N steps; eval always runs at step 0 and at the end.",
        resume_may_change=True,
    )
    report_to: str = flag(
        "none",
        "Trackers that also get the metrics rows, the run's config and its checkpoint events: "
        "a comma list of tensorboard (OUT/tensorboard), wandb (needs `pip install wandb`; "
        "WANDB_PROJECT, WANDB_MODE=offline are read), csv (OUT/csv), or none.",
    )
    run_name: str | None = flag(
        None, "The run's name in trackers (default: the --output_dir folder's name)."
    )
    log_level: str = flag(
        "warning",
        "What DeepSpeed, transformers and datasets print: warning hides their info lines and "
        "known per-rank repeats (torch deprecations DeepSpeed triggers); info or debug shows "
        "everything.",
        choices=("warning", "info", "debug"),
    )
    plot: bool = flag(
        True,
        "Draw OUT/plots/training.png (train and eval loss, learning rate, tokens/s; checkpoints, "
        "resumes and preemptions marked) at each eval and at the end, on rank 0 in the background; "
        "--no_plot turns it off.",
    )
    ddp_timeout: int | None = flag(
        None,
        "Seconds a collective may wait for a peer before the run fails (default 900). "
        "finetune's own long single-rank work (dataset tokenization, universal conversion) "
        "waits with short polling collectives, so this only bounds how long a dead or stuck "
        "peer goes unnoticed; it is also how long a checkpoint's storage step (a manifest, a "
        "rename, a deletion, a verification read) may go without progress before it fails "
        "on every rank (a hung filesystem).",
        resume_may_change=True,
    )
    # The best checkpoint and early stopping (finetune/checkpoint_format/best.py).
    metric_for_best_model: str | None = flag(
        None,
        "The evaluation metric that picks the best checkpoint (kept by --save_total_limit besides "
        "the newest, marked by `finetune ls`, exported by `finetune export --best`) and that early "
        "stopping watches: eval_loss or eval_perplexity (under a preference --objective eval_loss "
        "or one of eval_rewards/chosen, rejected, accuracies, margins, eval_logps/chosen, "
        "rejected), the eval_ prefix optional. Given "
        "explicitly, or with --early_stopping_patience, --save_steps must be a multiple of "
        "--eval_steps (as HF's load_best_model_at_end), so every checkpoint has its evaluation; "
        "a checkpoint saved without one is never the best (default: eval_loss)",
    )
    greater_is_better: bool | None = flag(
        None,
        "Whether a higher --metric_for_best_model is better; --no_greater_is_better says it is "
        "not (default: off for losses and perplexity, else on)",
    )
    early_stopping_patience: int | None = flag(
        None,
        "Stop after this many evaluations in a row (every --eval_steps, which it needs; the one "
        "at step 0 is the baseline) without improving --metric_for_best_model: the final "
        "checkpoint is saved (with --save_checkpoint), exit 0, exit_status.json reason "
        "early_stopped. Off by default.",
    )
    early_stopping_threshold: float = flag(
        0.0,
        "How much an evaluation must beat the best so far by to count as an improvement for "
        "--early_stopping_patience.",
    )

    @classmethod
    def check(cls, v: Mapping[str, Any]) -> None:
        """The training flags' own rules, on the flag values before any file is read (the
        DeepSpeed JSON's are ds_config's): each failure names its flag."""
        if v["max_steps"] is not None and v["num_train_epochs"] is not None:
            raise ConfigError("Can't give both `--max_steps` and `--num_train_epochs`")
        require_positive(
            v,
            (
                "per_device_train_batch_size",
                "per_device_eval_batch_size",
                "gradient_accumulation_steps",
                "max_steps",
                "logging_steps",
                "eval_steps",
                "num_train_epochs",
                "learning_rate",
                "sequence_parallel_size",
            ),
        )
        require_not_negative(
            v, ("warmup_steps", "weight_decay", "max_grad_norm", "adam_epsilon", "warmup_ratio")
        )
        if v["ddp_timeout"] is not None and v["ddp_timeout"] < MIN_DDP_TIMEOUT:
            raise ConfigError(
                f"`--ddp_timeout` must be at least {MIN_DDP_TIMEOUT} seconds, got "
                f"{v['ddp_timeout']}"
            )
        _check_best(v)
        _check_schedule(v["lr_scheduler_type"], scheduler_kwargs(v["lr_scheduler_kwargs"]))
        _check_warmup(v["warmup_steps"], v["warmup_ratio"])


def _check_best(v: Mapping[str, Any]) -> None:
    """Early stopping's flags (the metric's name is checked against what the objective and the eval
    sets write, and the rules that also read the data and checkpoint flags, in flag_checks)."""
    patience = v["early_stopping_patience"]
    require_positive(v, ("early_stopping_patience",))
    threshold = v["early_stopping_threshold"]
    if threshold is not None and not threshold >= 0:
        raise ConfigError(f"`--early_stopping_threshold` must not be negative, got {threshold}")
    if threshold and patience is None:
        raise ConfigError("`--early_stopping_threshold` needs `--early_stopping_patience`")
    if patience is not None and not v["eval_steps"]:
        raise ConfigError(
            "`--early_stopping_patience` counts periodic evaluations: it needs `--eval_steps`"
        )


def metric_name(name: str | None) -> str:
    """--metric_for_best_model as the eval row spells it: "loss" is "eval_loss" (HF's rule)."""
    if not name:
        return DEFAULT_METRIC
    return name if name.startswith("eval_") else f"eval_{name}"


# --- the learning-rate schedule and warmup ----------------------------------------------------


def scheduler_kwargs(value: Any) -> dict:
    """--lr_scheduler_kwargs as a dict: JSON text on the command line, a mapping in a --config
    file, {} when unset."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(
                f"`--lr_scheduler_kwargs` must be a JSON dict like {_KWARGS_EXAMPLE}: {e}"
            ) from None
    if value is not None and not isinstance(value, dict):
        raise ConfigError(
            f"`--lr_scheduler_kwargs` must be a JSON dict like {_KWARGS_EXAMPLE}, got {value!r}"
        )
    return value or {}


def _check_schedule(name: str, kw: dict) -> None:
    """--lr_scheduler_kwargs against the schedule's own arguments, and the ranges of those."""
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
            f"in `--lr_scheduler_kwargs` (e.g. {_KWARGS_EXAMPLE})"
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


def _check_warmup(steps: float | None, ratio: float | None) -> None:
    if ratio is not None:
        if steps is not None:
            raise ConfigError("Can't give both `--warmup_steps` and `--warmup_ratio`")
        if not 0 <= ratio < 1:
            raise ConfigError(f"`--warmup_ratio` must be in [0, 1), got {ratio}")
    elif steps is not None and steps >= 1 and steps != int(steps):
        raise ConfigError(
            "`--warmup_steps` must be a whole number of steps, or a fraction of the run's "
            f"steps below 1, got {steps}"
        )


def schedule_values(v: Mapping[str, Any]) -> dict[str, Any]:
    """The checked schedule flags as the run keeps them: --lr_scheduler_kwargs a dict (None when
    empty), --warmup_ratio folded into --warmup_steps as a fraction, a whole --warmup_steps an int
    (a fraction is resolved against the run's steps once the data is known:
    build.warmup_steps)."""
    steps, ratio = v["warmup_steps"], v["warmup_ratio"]
    if ratio is not None:
        steps = ratio
    elif steps is not None and steps >= 1:
        steps = int(steps)
    return {
        "lr_scheduler_kwargs": scheduler_kwargs(v["lr_scheduler_kwargs"]) or None,
        "warmup_steps": steps,
    }


# --- values read beside the flags ---------------------------------------------------------------


def report_targets(value: str) -> tuple[str, ...]:
    """--report_to's trackers, in order, without duplicates; () for "none"."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if names == ["none"] or not names:
        return ()
    bad = [n for n in names if n not in TRACKERS]
    if bad:
        raise ConfigError(
            f"`--report_to`: unknown tracker {', '.join(map(repr, bad))} "
            f"(choose from {', '.join(TRACKERS)}, comma-separated, or none)"
        )
    return tuple(dict.fromkeys(names))


def precision_shorthand(precision: str, shorthand: str | None) -> tuple[str, str]:
    """--precision with the --bf16/--fp16 shorthand: the precision, and how errors name its flag."""
    if shorthand is None:
        return precision, f"precision {precision}"
    if precision not in ("auto", shorthand):
        raise ConfigError(f"Can't give both `--{shorthand}` and `--precision {precision}`")
    return shorthand, shorthand


def resolve_ddp_timeout(flag_value: int | None) -> int:
    """--ddp_timeout in seconds; unset: $FINETUNE_DIST_TIMEOUT_MIN (minutes) if set, else 900."""
    if flag_value is not None:
        return flag_value
    minutes = os.environ.get(LEGACY_TIMEOUT_ENV)
    if minutes is None:
        return DEFAULT_DDP_TIMEOUT
    try:
        seconds = int(minutes) * 60
    except ValueError:
        seconds = 0
    if seconds < MIN_DDP_TIMEOUT:
        raise ConfigError(
            f"${LEGACY_TIMEOUT_ENV} must be a whole number of minutes, at least 1, got {minutes!r} "
            f"(or give `--ddp_timeout SECONDS`, which replaces it)"
        )
    return seconds
