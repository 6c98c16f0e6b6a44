"""Typed run configuration and DeepSpeed config resolution.

The CLI turns flags into these dataclasses once; nothing downstream sees argparse. Each field's
`help` metadata is the flag's help text. Fields whose default is ``None`` are "unset": they are
filled from the DeepSpeed JSON, from the embedded-default preset, or from the documented
fallback, in that order (see ``cli.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
RESOURCES_DIR = PACKAGE_DIR / "resources"
# configs/ lives at the repository root (the package is installed editable by `make setup`).
CONFIGS_DIR = PACKAGE_DIR.parent / "configs"
DEFAULT_DS_CONFIG = "configs/ds_zero3.json"

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
DATA_EXTENSIONS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")


class ConfigError(ValueError):
    """Bad usage or input: the CLI prints the message as one line and exits 2."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ModelArgs:
    model_name_or_path: str | None = _f(None, "Hub id or local directory of a causal LM (default: the embedded tiny model).")
    config_name: str | None = _f(None, "Config (hub id or dir) to train a model from scratch instead of loading weights.")
    tokenizer_name: str | None = _f(None, "Tokenizer hub id or dir (default: the model's).")
    trust_remote_code: bool = _f(False, "Allow model/tokenizer code from the hub or model dir to run (off by default).")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")


@dataclass(frozen=True)
class DataArgs:
    dataset_name: str | None = _f(None, "Hub dataset id (loaded with datasets.load_dataset).")
    dataset_config_name: str | None = _f(None, "Hub dataset configuration name.")
    train_file: str | None = _f(None, "Local training file: .json, .jsonl, .csv, .parquet or .txt.")
    validation_file: str | None = _f(None, "Local validation file (same formats as --train_file).")
    text_column: str = _f("text", "Column holding plain text.")
    prompt_column: str | None = _f(None, "Column holding prompts (loss masked); needs --completion_column.")
    completion_column: str | None = _f(None, "Column holding completions (trained on).")
    messages_column: str | None = _f(None, "Column holding chat messages, rendered with the tokenizer's chat template.")
    max_seq_length: int | None = _f(None, "Truncate (or pack) sequences to this many tokens (default 512; 128 for the embedded model).")
    packing: bool = _f(False, "Concatenate examples and cut them into --max_seq_length blocks.")
    validation_split_percentage: int = _f(5, "Percent of the training data held out for eval when there is no validation split.")
    max_train_samples: int | None = _f(None, "Truncate the training set to this many examples.")
    max_eval_samples: int | None = _f(None, "Truncate the eval set to this many examples.")
    dataset_cache_dir: str | None = _f(None, "Where tokenized datasets are cached and reused by later runs "
                                       "(default: datasets' cache, $HF_DATASETS_CACHE).")
    preprocessing_num_workers: int | None = _f(None, "Processes that tokenize a dataset not yet in the cache "
                                               "(default: the cores this process may use; 1 below 20,000 examples).")


@dataclass(frozen=True)
class TrainArgs:
    deepspeed_config: str = _f(DEFAULT_DS_CONFIG, "DeepSpeed JSON; \"auto\" values are filled from these flags.")
    per_device_train_batch_size: int | None = _f(None, "Micro batch per rank (default 8).")
    per_device_eval_batch_size: int = _f(8, "Eval batch per rank.")
    gradient_accumulation_steps: int | None = _f(None, "Micro batches per optimizer step (default 1).")
    learning_rate: float | None = _f(None, "Peak learning rate (default 5e-5; 1e-3 for the embedded model).")
    weight_decay: float | None = _f(None, "AdamW weight decay, not applied to biases and norms (default 0.0).")
    adam_beta1: float | None = _f(None, "AdamW beta1 (default 0.9).")
    adam_beta2: float | None = _f(None, "AdamW beta2 (default 0.999).")
    adam_epsilon: float | None = _f(None, "AdamW epsilon (default 1e-8).")
    max_grad_norm: float | None = _f(None, "Gradient clipping norm, 0 disables (default 1.0).")
    lr_scheduler_type: str = _f("linear", "Learning-rate decay after warmup.", choices=SCHEDULERS)
    warmup_steps: int | None = _f(None, "Linear warmup steps (default 0; 10 for the embedded model).")
    num_train_epochs: float | None = _f(None, "Epochs to train (default 3); exclusive with --max_steps.")
    max_steps: int | None = _f(None, "Optimizer steps to train; exclusive with --num_train_epochs.")
    seed: int = _f(42, "Seed for model init, data order and dropout.")
    precision: str = _f("auto", "auto = bf16 where the accelerator supports it, else fp32.", choices=PRECISIONS)
    logging_steps: int | None = _f(None, "Log train metrics every N optimizer steps (default 10; 5 for the embedded model).")
    eval_steps: int | None = _f(None, "Evaluate every N steps; eval always runs at step 0 and at the end.")
    report_to: str = _f("none", "Also log to TensorBoard through DeepSpeed's monitor.", choices=("none", "tensorboard"))


@dataclass(frozen=True)
class CheckpointArgs:
    output_dir: str = _f("output", "Where metrics.jsonl and checkpoints go.")
    save_checkpoint: bool = _f(False, "Save checkpoints (always a final one; periodic with --save_steps).")
    save_steps: int | None = _f(None, "Also save every N optimizer steps.")
    save_total_limit: int | None = _f(None, "Keep at most K checkpoints (never deletes the newest complete one).")
    save_consolidated: bool = _f(False, "Also gather the weights into HF safetensors in the checkpoint folder.")
    max_shard_size: str = _f("5GB", "Largest consolidated safetensors shard (HF size string, e.g. 500MB).")
    consolidated_dtype: str | None = _f(None, "dtype of consolidated weights (default: the training dtype).", choices=("bf16", "fp16", "fp32"))
    resume_from_checkpoint: str | None = _f(None, "PATH, 'latest' or 'auto' (resume if a checkpoint exists).")
    resume_skip_checksum: bool = _f(False, "Verify only file sizes (not checksums) before resuming.")
    on_save_error: str = _f("continue", "What a failed periodic save does; a failed final save always exits 1.", choices=("continue", "abort"))
    preempt_signals: str = _f("SIGTERM,SIGUSR1", "Signals that stop training at the next step boundary with a committed "
                              "checkpoint (partitioned only) and exit code 75, for requeueing; 'none' disables.")


@dataclass(frozen=True)
class RunConfig:
    model: ModelArgs
    data: DataArgs
    train: TrainArgs
    ckpt: CheckpointArgs
    # The DeepSpeed config with every "auto" resolved except those needing the dataset's size
    # (scheduler total steps), which the trainer fills via ``finalize_ds_config``.
    ds_config: dict
    world_size: int
    uses_embedded_model: bool
    uses_embedded_data: bool

    def to_json_dict(self) -> dict:
        from dataclasses import asdict

        return {k: asdict(getattr(self, k)) for k in ("model", "data", "train", "ckpt")}


# --- DeepSpeed JSON ------------------------------------------------------------------------

def resolve_config_path(path: str) -> Path:
    """Paths are relative to the working directory; the default also resolves from the repo."""
    p = Path(path)
    if p.exists():
        return p
    if not p.is_absolute() and p.parts[:1] == ("configs",) and (CONFIGS_DIR / p.name).exists():
        return CONFIGS_DIR / p.name
    raise ConfigError(f"--deepspeed_config: file not found: {path}")


def load_ds_json(path: str) -> dict:
    p = resolve_config_path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"--deepspeed_config: cannot read {p}: {e.strerror}") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed_config: {p} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"--deepspeed_config: {p} must hold a JSON object, not {type(cfg).__name__}")
    return cfg


_MISSING = object()


def _get(cfg: dict, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _set(cfg: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def reconcile(flag: str, flag_value: Any, cfg: dict, key: str, fallback: Any, path: str, *, write: bool = True) -> Any:
    """One value set both by a flag and by the DeepSpeed JSON.

    "auto" or absent in the JSON → the flag (or ``fallback``) wins and is written into the JSON;
    an explicit JSON value with no flag → the JSON wins; both explicit and different → error.
    """
    json_value = _get(cfg, key)
    if json_value is _MISSING or json_value == "auto":
        value = fallback if flag_value is None else flag_value
        if write or json_value == "auto":
            _set(cfg, key, value)
        return value
    if flag_value is not None and not _same(flag_value, json_value):
        raise ConfigError(f"`--{flag} {flag_value}` contradicts `{key}: {json.dumps(json_value)}` in {path}; drop one or make them agree")
    return json_value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return float(a) == float(b)
    return a == b


def zero_stage(cfg: dict) -> int:
    stage = _get(cfg, "zero_optimization.stage")
    return 0 if stage is _MISSING else int(stage)


def finalize_ds_config(cfg: dict, total_steps: int, warmup_steps: int, learning_rate: float) -> dict:
    """Fill the values that need the dataset's size: a DeepSpeed scheduler's step counts."""
    out = json.loads(json.dumps(cfg))
    sched = out.get("scheduler")
    if isinstance(sched, dict):
        params = sched.setdefault("params", {})
        for key, value in (("total_num_steps", total_steps), ("warmup_num_steps", warmup_steps),
                           ("warmup_max_lr", learning_rate), ("warmup_min_lr", 0.0)):
            if params.get(key) == "auto":
                params[key] = value
    leftover = [k for k, v in _walk(out) if v == "auto"]
    if leftover:
        raise ConfigError(f"--deepspeed_config: cannot resolve \"auto\" for {', '.join(leftover)}")
    return out


def _walk(node: Any, prefix: str = ""):
    if isinstance(node, (dict, list)):
        for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
            yield from _walk(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), node


def data_format(path: str) -> str | None:
    """The `datasets` builder for a local data file, from its extension."""
    return DATA_EXTENSIONS.get(Path(path).suffix.lower())


def env_world_size() -> int:
    """Every supported launcher exports WORLD_SIZE before our code runs; plain python is 1."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1
