"""Flag values → a checked, reconciled, frozen ``RunConfig``.

``resolve`` puts the values in one spelling (list flags, the mixture's entries, the schedule's
arguments), checks them (``flag_checks.check``: each group's own rules, then those across groups),
then the files they name (``sources.validate_paths``), reconciles them with the DeepSpeed JSON
(``ds_config``) and fills what is still unset from the embedded-default preset or the documented
fallback, in that order. It sits above every module it consults (config, flag_checks, sources,
ds_config, data/mixture), so none of them imports it back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from finetune import flag_checks
from finetune.config import (
    EMBEDDED_MAX_STEPS,
    EMBEDDED_PRESET,
    FALLBACKS,
    GROUPS,
    LIST_FLAGS,
    ConfigError,
    RunConfig,
    env_world_size,
    flag_defaults,
    resolve_ddp_timeout,
    split_names,
)
from finetune.config.preference import is_preference, preference_values
from finetune.config.train import schedule_values
from finetune.data import eval_sets, mixture
from finetune.ds_config import load_ds_json, reconcile_ds
from finetune.sources import validate_paths


def resolve(
    values: Mapping[str, Any], precision_flag: str | None = None, *, world_size: int | None = None
) -> RunConfig:
    """Check flag values, reconcile them with the DeepSpeed JSON, and freeze them.

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
    named = eval_sets.parse(v["eval_datasets"])
    v["eval_datasets"] = eval_sets.normalize(named) if named is not None else None
    embedded_data = (
        v["dataset_name"] is None and v["train_file"] is None and not v["dataset_mixture"]
    )
    flag_checks.check(v)
    v.update(schedule_values(v))
    v.update(preference_values(v))
    if eval_sets.has_held_out(v):  # the run is judged on held-out sets: train on all the data
        v["validation_split_percentage"] = 0
    if is_preference(v["objective"]):  # the preference format's columns (TRL's names)
        v["chosen_column"] = v["chosen_column"] or "chosen"
        v["rejected_column"] = v["rejected_column"] or "rejected"
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
    sp = v["sequence_parallel_size"]
    if world % sp:
        raise ConfigError(
            f"`--sequence_parallel_size {sp}` must divide the world size ({world} ranks): "
            f"each row is shared by {sp} ranks"
        )
    ds = load_ds_json(v["deepspeed_config"])
    reconcile_ds(v, ds, world // sp, fallbacks, precision_flag or f"precision {v['precision']}")
    if ds.get("sequence_parallel_size", sp) != sp:
        raise ConfigError(
            f"`sequence_parallel_size: {ds['sequence_parallel_size']}` in "
            f"{v['deepspeed_config']} differs from `--sequence_parallel_size {sp}`: drop one"
        )
    if sp > 1:
        _check_sequence_parallel_ds(ds, sp, v["deepspeed_config"])
        # what DeepSpeed's own config divides the world by (zero.Init's, before the mpu exists)
        ds["sequence_parallel_size"] = sp
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


def _check_sequence_parallel_ds(ds: dict, sp: int, path: str) -> None:
    """The DeepSpeed JSON --sequence_parallel_size can train with: ZeRO-3's gradient
    reduce-scatter, which averages over every rank (what loss.py weighs the shards' tokens by);
    without it ZeRO-3 averages each bucket over every rank or over world / N by its size."""
    if ds.get("zero_optimization", {}).get("reduce_scatter", True) is False:
        raise ConfigError(
            f"`--sequence_parallel_size {sp}` needs `zero_optimization.reduce_scatter: true` "
            f"(the default) in {path}"
        )
