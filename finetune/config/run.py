"""The run's configuration as a whole: the five groups frozen into a ``RunConfig``, the table of
groups every flag is found through, and what fills a flag left unset."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict, dataclass
from typing import Any

from finetune.config.checkpoint import CheckpointArgs
from finetune.config.data import DataArgs
from finetune.config.model import ModelArgs
from finetune.config.preference import PreferenceArgs
from finetune.config.train import TrainArgs


@dataclass(frozen=True)
class RunConfig:
    model: ModelArgs
    data: DataArgs
    train: TrainArgs
    ckpt: CheckpointArgs
    preference: PreferenceArgs
    # The DeepSpeed config with every "auto" resolved except those needing the dataset's size
    # (scheduler total steps), which the trainer fills via ``finalize_ds_config``.
    ds_config: dict
    world_size: int
    uses_embedded_model: bool
    uses_embedded_data: bool

    def to_json_dict(self) -> dict:
        return {k: asdict(getattr(self, k)) for k, _ in GROUPS}


# Each group's name in RunConfig and its dataclass, in the order the CLI's help lists them and
# their checks run.
GROUPS = (
    ("model", ModelArgs),
    ("data", DataArgs),
    ("train", TrainArgs),
    ("ckpt", CheckpointArgs),
    ("preference", PreferenceArgs),
)
# Flags that take several values (space-separated on the command line, a list in a --config file).
LIST_FLAGS = tuple(
    f.name for _, cls in GROUPS for f in dataclasses.fields(cls) if f.metadata.get("nargs")
)

# Fallbacks for unset fields; the embedded tiny model gets values that make it learn in a short run.
FALLBACKS = dict(
    per_device_train_batch_size=8,
    gradient_accumulation_steps=1,
    learning_rate=5e-5,
    weight_decay=0.0,
    adam_beta1=0.9,
    adam_beta2=0.999,
    adam_epsilon=1e-8,
    max_grad_norm=1.0,
    warmup_steps=0,
    logging_steps=10,
    max_seq_length=512,
)
EMBEDDED_PRESET = dict(learning_rate=1e-3, warmup_steps=10, logging_steps=5, max_seq_length=128)
EMBEDDED_MAX_STEPS = 150


def resume_may_change() -> frozenset[str]:
    """The flags a resume may give another value than the checkpoint's run without a warning:
    where the run goes and how long, how often it logs, evaluates and saves, and how it checks
    what it resumes (declared on each field: ``resume_may_change=True``)."""
    return frozenset(
        f.name
        for _, group in GROUPS
        for f in dataclasses.fields(group)
        if f.metadata.get("resume_may_change")
    )


def flag_defaults() -> dict[str, Any]:
    """Every flag's value when it is not given (``None`` = unset, filled by ``resolve``)."""
    return {f.name: f.default for _, cls in GROUPS for f in dataclasses.fields(cls)}


def env_world_size() -> int:
    """Every supported launcher exports WORLD_SIZE before our code runs; plain python is 1."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1
