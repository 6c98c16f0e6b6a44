"""Flag values → a validated, reconciled, frozen ``RunConfig``.

``resolve`` checks the values alone (``validate_flags``), then the files they name
(``sources.validate_paths``), reconciles them with the DeepSpeed JSON (``ds_config``) and fills
what is still unset from the embedded-default preset or the documented fallback, in that order.
It sits above every module it consults (config, sources, ds_config, lora, preemption), so none of
them imports it back.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from typing import Any

from finetune.checkpoint_format.best import validate_flags as validate_best_flags
from finetune.config import (
    EMBEDDED_MAX_STEPS,
    EMBEDDED_PRESET,
    FALLBACKS,
    GROUPS,
    LIST_FLAGS,
    MIN_DDP_TIMEOUT,
    ConfigError,
    RunConfig,
    check_size,
    env_world_size,
    flag_defaults,
    resolve_ddp_timeout,
    split_names,
)
from finetune.data import formats, mixture
from finetune.ds_config import load_ds_json, reconcile_ds
from finetune.lora import validate_lora_flags
from finetune.preemption import parse_signals
from finetune.sources import validate_paths
from finetune.training_flags import check_kernels, resolve_schedule


def resolve(
    values: Mapping[str, Any], precision_flag: str | None = None, *, world_size: int | None = None
) -> RunConfig:
    """Validate flag values, reconcile them with the DeepSpeed JSON, and freeze them.

    ``values`` maps flag names (no dashes) to values; flags it lacks take their defaults, and it is
    not modified. ``precision_flag`` is how errors name the precision flag (``"bf16"`` for the
    shorthand; default ``"precision VALUE"``). ``world_size`` defaults to the launcher's WORLD_SIZE.
    """
    defaults = flag_defaults()
    unknown = sorted(set(values) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown flag(s): {', '.join('--' + k for k in unknown)}")
    v = {**defaults, **values}
    for name in LIST_FLAGS:  # one spelling downstream: "q_proj,v_proj"
        if v[name] is not None:
            v[name] = ",".join(split_names(v[name]))
    embedded_model = v["model_name_or_path"] is None and v["config_name"] is None
    entries = mixture.parse(v["dataset_mixture"])  # JSON (command line) or a list (a file)
    v["dataset_mixture"] = mixture.normalize(entries) if entries is not None else None
    embedded_data = (
        v["dataset_name"] is None and v["train_file"] is None and not v["dataset_mixture"]
    )
    validate_flags(v)
    resolve_schedule(v)
    check_kernels(v)
    validate_paths(v)
    # The preset is a default, not a flag: an explicit DeepSpeed JSON value must win over it.
    fallbacks = {**FALLBACKS, **EMBEDDED_PRESET} if embedded_model else FALLBACKS
    if (
        embedded_model
        and v["max_steps"] is None
        and v["num_train_epochs"] is None
        and embedded_data
    ):
        v["max_steps"] = EMBEDDED_MAX_STEPS
    if v["max_steps"] is None and v["num_train_epochs"] is None:
        v["num_train_epochs"] = 3.0
    v["ddp_timeout"] = resolve_ddp_timeout(v["ddp_timeout"])
    world = env_world_size() if world_size is None else world_size
    ds = load_ds_json(v["deepspeed_config"])
    if isinstance(ds.get("scheduler"), dict) and v["lr_scheduler_kwargs"]:
        raise ConfigError(
            f"`--lr_scheduler_kwargs` configures --lr_scheduler_type, but {v['deepspeed_config']} "
            "has its own scheduler section, which replaces it: drop one of them"
        )
    reconcile_ds(v, ds, world, fallbacks, precision_flag or f"precision {v['precision']}")
    for k, fallback in fallbacks.items():
        v[k] = fallback if v[k] is None else v[k]
    groups = {
        name: cls(**{f.name: v[f.name] for f in dataclasses.fields(cls)}) for name, cls in GROUPS
    }
    return RunConfig(
        **groups,
        ds_config=ds,
        world_size=world,
        uses_embedded_model=embedded_model,
        uses_embedded_data=embedded_data,
    )


def validate_flags(v: Mapping[str, Any]) -> None:
    """Checks on the flag values alone (no files read): each failure names its flag."""
    if v["max_steps"] is not None and v["num_train_epochs"] is not None:
        raise ConfigError("Can't give both `--max_steps` and `--num_train_epochs`")
    if v["dataset_name"] and v["train_file"]:
        raise ConfigError("Can't give both `--dataset_name` and `--train_file`")
    if v["config_name"] and v["model_name_or_path"]:
        raise ConfigError(
            "Can't give both `--config_name` (train from scratch) and "
            "`--model_name_or_path` (load weights)"
        )
    if v["dataset_mixture"]:
        mixture.check_flags_with(v)
    formats.check_flags(v)  # the data formats' flags, from their registry
    if v["validation_file"] and not (v["train_file"] or v["dataset_name"]):
        raise ConfigError("`--validation_file` needs `--train_file` or `--dataset_name`")
    for name in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "max_steps",
        "logging_steps",
        "eval_steps",
        "save_steps",
        "save_total_limit",
        "max_seq_length",
        "max_train_samples",
        "max_eval_samples",
        "preprocessing_num_workers",
    ):
        if v[name] is not None and v[name] <= 0:
            raise ConfigError(f"`--{name}` must be positive, got {v[name]}")
    for name in ("num_train_epochs", "learning_rate"):
        if v[name] is not None and not v[name] > 0:
            raise ConfigError(f"`--{name}` must be positive, got {v[name]}")
    for name in ("warmup_steps", "weight_decay", "max_grad_norm", "adam_epsilon", "warmup_ratio"):
        if v[name] is not None and v[name] < 0:
            raise ConfigError(f"`--{name}` must not be negative, got {v[name]}")
    if v["max_seq_length"] is not None and v["max_seq_length"] < 2:
        raise ConfigError(
            f"`--max_seq_length` must be at least 2 (a token to predict the next one from), "
            f"got {v['max_seq_length']}"
        )
    if not 0 <= v["validation_split_percentage"] < 100:
        raise ConfigError(
            "`--validation_split_percentage` must be in [0, 100), got "
            f"{v['validation_split_percentage']}"
        )
    if v["ddp_timeout"] is not None and v["ddp_timeout"] < MIN_DDP_TIMEOUT:
        raise ConfigError(
            f"`--ddp_timeout` must be at least {MIN_DDP_TIMEOUT} seconds, got {v['ddp_timeout']}"
        )
    if v["max_shard_size"] is not None:
        check_size(v["max_shard_size"])
    if v["remote_output_dir"]:
        check_remote(v)
    try:
        parse_signals(v["preempt_signals"])
    except ValueError as e:
        raise ConfigError(
            f"`--preempt_signals`: {e} is not a signal that can be caught "
            "(e.g. SIGTERM,SIGUSR1 or none)"
        ) from None
    if (
        v["save_steps"] or v["save_total_limit"] or v["save_consolidated"] or v["async_save"]
    ) and not v["save_checkpoint"]:
        raise ConfigError(
            "`--save_steps`, `--save_total_limit`, `--save_consolidated` and `--async_save` need "
            "`--save_checkpoint`"
        )
    if v["ignore_unverified_checkpoints"] and v["resume_from_checkpoint"] != "auto":
        raise ConfigError("`--ignore_unverified_checkpoints` needs `--resume_from_checkpoint auto`")
    validate_lora_flags(v)
    validate_best_flags(v)


def check_remote(v: Mapping[str, Any]) -> None:
    """--remote_output_dir: a URI of a supported scheme, its client installed, something to copy.
    (Whether the bucket and credentials work is the start-up probe's: checkpoint/remote_copy.)"""

    from finetune.io.remote import CLIENT_PACKAGE, RemoteError, S3Uri

    uri = v["remote_output_dir"]
    try:
        S3Uri.parse(uri)
    except RemoteError as e:
        raise ConfigError(f"`--remote_output_dir`: {e}") from None
    if not v["save_checkpoint"]:
        raise ConfigError("`--remote_output_dir` copies checkpoints: it needs `--save_checkpoint`")
    if importlib.util.find_spec(CLIENT_PACKAGE) is None:
        raise ConfigError(
            f"`--remote_output_dir` {uri} needs the {CLIENT_PACKAGE} package: "
            f"pip install {CLIENT_PACKAGE} (or finetune[s3])"
        )
