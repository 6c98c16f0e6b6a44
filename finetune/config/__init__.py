"""Typed run configuration: the flags' dataclasses, one module per group, each with the checks
that read only its own flags.

  fields.py      what every group shares: ConfigError, the field that carries a flag's help
  model.py       ModelArgs       the model, LoRA, kernels
  data.py        DataArgs        the data, its format's columns, packing, a mixture
  train.py       TrainArgs       batch, optimizer, schedule, length, logging, the best metric
  checkpoint.py  CheckpointArgs  saving, the bucket copy, resuming, preemption
  preference.py  PreferenceArgs  the objective: SFT, or DPO and its cousins, and the reference
  run.py         RunConfig (the groups frozen together), GROUPS, fallbacks and presets

Each group's ``check(values)`` holds its own rules; the rules across groups, and those that need
another module's knowledge, are finetune/flag_checks.py's. The CLI turns its Namespace into a plain
dict of flag values and hands it to ``resolve.resolve``, which checks it (flag_checks.check, then
the files it names) and freezes it into a ``RunConfig``; nothing here (or downstream) sees
argparse. This package imports nothing else of finetune's, so every module may import it. Each
field's `help` metadata is the flag's help text. Fields whose default is ``None`` are "unset":
``resolve`` fills them from the DeepSpeed JSON, from the embedded-default preset, or from the
documented fallback, in that order.
"""

from finetune.config.checkpoint import CheckpointArgs, check_size
from finetune.config.data import DATA_EXTENSIONS, SINGLE_DATASET_FLAGS, DataArgs, data_format
from finetune.config.fields import (
    CONFIGS_DIR,
    DEFAULT_DS_CONFIG,
    PACKAGE_DIR,
    RESOURCES_DIR,
    ConfigError,
    split_names,
)
from finetune.config.model import WEIGHT_FILES, ModelArgs
from finetune.config.preference import OBJECTIVES, SFT, PreferenceArgs, is_preference
from finetune.config.run import (
    EMBEDDED_MAX_STEPS,
    EMBEDDED_PRESET,
    FALLBACKS,
    GROUPS,
    LIST_FLAGS,
    RunConfig,
    env_world_size,
    flag_defaults,
    resume_may_change,
)
from finetune.config.train import (
    DEFAULT_DDP_TIMEOUT,
    DEFAULT_METRIC,
    LEGACY_TIMEOUT_ENV,
    METRICS,
    MIN_DDP_TIMEOUT,
    PRECISIONS,
    SCHEDULER_KWARGS,
    SCHEDULERS,
    TRACKERS,
    TrainArgs,
    metric_name,
    precision_shorthand,
    report_targets,
    resolve_ddp_timeout,
)

__all__ = [
    "CONFIGS_DIR",
    "DATA_EXTENSIONS",
    "DEFAULT_DDP_TIMEOUT",
    "DEFAULT_DS_CONFIG",
    "DEFAULT_METRIC",
    "EMBEDDED_MAX_STEPS",
    "EMBEDDED_PRESET",
    "FALLBACKS",
    "GROUPS",
    "LEGACY_TIMEOUT_ENV",
    "LIST_FLAGS",
    "METRICS",
    "MIN_DDP_TIMEOUT",
    "PACKAGE_DIR",
    "PRECISIONS",
    "RESOURCES_DIR",
    "SCHEDULER_KWARGS",
    "SCHEDULERS",
    "SINGLE_DATASET_FLAGS",
    "TRACKERS",
    "WEIGHT_FILES",
    "CheckpointArgs",
    "ConfigError",
    "DataArgs",
    "ModelArgs",
    "OBJECTIVES",
    "PreferenceArgs",
    "SFT",
    "RunConfig",
    "TrainArgs",
    "check_size",
    "data_format",
    "env_world_size",
    "flag_defaults",
    "is_preference",
    "metric_name",
    "precision_shorthand",
    "report_targets",
    "resolve_ddp_timeout",
    "resume_may_change",
    "split_names",
]
