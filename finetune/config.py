"""Typed run configuration: the flags' dataclasses, their defaults and the checks on one value.

The CLI turns its Namespace into a plain dict of flag values and hands it to ``resolve.resolve``,
which validates it against the files it names and freezes it into a ``RunConfig``; nothing here (or
downstream) sees argparse. This module imports nothing of finetune's, so every module may import it.
Each field's `help` metadata is the flag's help text. Fields whose default is ``None`` are "unset":
``resolve`` fills them from the DeepSpeed JSON, from the embedded-default preset, or from the
documented fallback, in that order.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
RESOURCES_DIR = PACKAGE_DIR / "resources"
# configs/ lives at the repository root (the package is installed editable by `make setup`).
CONFIGS_DIR = PACKAGE_DIR.parent / "configs"
DEFAULT_DS_CONFIG = "configs/ds_zero3.json"

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
DATA_EXTENSIONS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
}
SCHEDULERS = (
    "linear",
    "cosine",
    "constant",
    "constant_with_warmup",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)
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


class ConfigError(ValueError):
    """Bad usage or input: the CLI prints the message as one line and exits 2."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ModelArgs:
    model_name_or_path: str | None = _f(
        None, "Hub id or local directory of a causal LM (default: the embedded tiny model)."
    )
    config_name: str | None = _f(
        None, "Config (hub id or dir) to train a model from scratch instead of loading weights."
    )
    tokenizer_name: str | None = _f(None, "Tokenizer hub id or dir (default: the model's).")
    trust_remote_code: bool = _f(
        False, "Allow model/tokenizer code from the hub or model dir to run (off by default)."
    )
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")
    # LoRA, with TRL's flag names (finetune/lora.py).
    use_peft: bool = _f(
        False,
        "Train LoRA adapters (peft) instead of every weight: the base model stays frozen (and "
        "partitioned), and checkpoints hold only the adapters' trainable state.",
    )
    lora_r: int = _f(16, "LoRA rank.")
    lora_alpha: int = _f(32, "LoRA alpha: the adapters' output is scaled by alpha / r.")
    lora_dropout: float = _f(0.05, "Dropout on the input of the LoRA branch.")
    lora_target_modules: str | None = _f(
        None,
        "Modules that get adapters: names (space- or comma-separated, e.g. "
        "q_proj v_proj) or all-linear (every linear layer but the output head); "
        "default: peft's choice for the architecture (q_proj v_proj for Llama).",
        nargs="+",
    )
    lora_modules_to_save: str | None = _f(
        None,
        "Modules trained in full beside the adapters and saved with them (e.g. lm_head).",
        nargs="+",
    )
    attn_implementation: str | None = _f(
        None,
        "Attention kernel, passed to from_pretrained / from_config: eager, sdpa, "
        "flash_attention_2, flash_attention_3, flex_attention, or another the installed "
        "transformers accepts (default: transformers' choice, sdpa where available). With "
        "--packing and flash_attention_*, each micro-batch is one row of whole examples "
        "(varlen, no padding).",
    )
    use_liger_kernel: bool = _f(
        False,
        "Patch the model with Liger's fused Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear "
        "cross-entropy): less memory, faster steps. Needs a CUDA GPU and "
        "`pip install liger-kernel`.",
    )
    neftune_noise_alpha: float | None = _f(
        None,
        "NEFTune: add uniform noise of scale alpha / sqrt(sequence length x hidden size) to the "
        "input embeddings while training (not in evaluation), as HF Trainer's flag; e.g. 5.",
    )


@dataclass(frozen=True)
class DataArgs:
    dataset_name: str | None = _f(None, "Hub dataset id (loaded with datasets.load_dataset).")
    dataset_config_name: str | None = _f(None, "Hub dataset configuration name.")
    train_file: str | None = _f(None, "Local training file: .json, .jsonl, .csv, .parquet or .txt.")
    validation_file: str | None = _f(None, "Local validation file (same formats as --train_file).")
    text_column: str = _f("text", "Column holding plain text.")
    prompt_column: str | None = _f(
        None, "Column holding prompts (loss masked); needs --completion_column."
    )
    completion_column: str | None = _f(None, "Column holding completions (trained on).")
    messages_column: str | None = _f(
        None, "Column holding chat messages, rendered with the tokenizer's chat template."
    )
    max_seq_length: int | None = _f(
        None,
        "Truncate (or pack) sequences to this many tokens (default "
        "512; 128 for the embedded model).",
    )
    packing: bool = _f(
        False,
        "Pack examples into blocks of up to --max_seq_length tokens, so fewer tokens are "
        "padding. Examples stay whole and attend only to themselves (see --packing_strategy).",
    )
    packing_strategy: str = _f(
        "bfd",
        "How --packing builds blocks. bfd: whole examples placed by best-fit decreasing, "
        "position ids restarting at each example, no attention across examples and no loss on "
        "an example's first token from the previous one (an unpacked run's loss terms, exactly). "
        "concat: every example concatenated and cut into full blocks; examples "
        "attend to the ones before them and are cut across blocks: for continuation "
        "(pretraining-style) text only.",
        choices=("bfd", "concat"),
    )
    validation_split_percentage: int = _f(
        5, "Percent of the training data held out for eval when there is no validation split."
    )
    max_train_samples: int | None = _f(None, "Truncate the training set to this many examples.")
    max_eval_samples: int | None = _f(None, "Truncate the eval set to this many examples.")
    dataset_cache_dir: str | None = _f(
        None,
        "Where tokenized datasets are cached and reused by later runs "
        "(default: datasets' cache, $HF_DATASETS_CACHE).",
    )
    preprocessing_num_workers: int | None = _f(
        None,
        "Processes that tokenize a dataset not yet in the cache "
        "(default: the cores this process may use; 1 below 20,000 examples).",
    )
    dataset_mixture: list | None = _f(
        None,
        "Train on several sources sampled by weight instead of one --train_file/--dataset_name: "
        "a list (a --config file's dataset_mixture:, or JSON here) of sources, each with the "
        "keys one dataset takes (train_file or dataset_name, dataset_config_name, "
        "validation_file, the format's columns, validation_split_percentage, max_train_samples, "
        "max_eval_samples), a weight > 0 (normalized into sampling probabilities) and an "
        "optional unique name. A source that runs out starts its next epoch; an epoch of the "
        "mixture is as many samples as all sources hold. See docs/MIXTURES.md.",
        json=list,
    )


@dataclass(frozen=True)
class TrainArgs:
    deepspeed_config: str = _f(
        DEFAULT_DS_CONFIG, 'DeepSpeed JSON; "auto" values are filled from these flags.'
    )
    per_device_train_batch_size: int | None = _f(None, "Micro batch per rank (default 8).")
    per_device_eval_batch_size: int = _f(8, "Eval batch per rank.")
    gradient_accumulation_steps: int | None = _f(
        None, "Micro batches per optimizer step (default 1)."
    )
    learning_rate: float | None = _f(
        None, "Peak learning rate (default 5e-5; 1e-3 for the embedded model)."
    )
    weight_decay: float | None = _f(
        None, "AdamW weight decay, not applied to biases and norms (default 0.0)."
    )
    adam_beta1: float | None = _f(None, "AdamW beta1 (default 0.9).")
    adam_beta2: float | None = _f(None, "AdamW beta2 (default 0.999).")
    adam_epsilon: float | None = _f(None, "AdamW epsilon (default 1e-8).")
    max_grad_norm: float | None = _f(None, "Gradient clipping norm, 0 disables (default 1.0).")
    lr_scheduler_type: str = _f(
        "linear",
        "Learning-rate schedule after warmup (transformers' get_scheduler, with its semantics). "
        "cosine_with_min_lr needs min_lr or min_lr_rate in --lr_scheduler_kwargs; "
        "warmup_stable_decay needs num_decay_steps (and takes min_lr_ratio, num_stable_steps, "
        "decay_type, warmup_type).",
        choices=SCHEDULERS,
    )
    lr_scheduler_kwargs: dict | None = _f(
        None,
        "The schedule's own arguments as a JSON dict (a mapping in a --config file), as HF's "
        """flag: e.g. '{"min_lr_rate": 0.1}' for cosine_with_min_lr, """
        """'{"num_decay_steps": 100, "min_lr_ratio": 0.1}' for warmup_stable_decay.""",
        json=dict,
    )
    warmup_steps: float | None = _f(
        None,
        "Linear warmup: a whole number of steps, or a fraction of the run's steps when below 1 "
        "(transformers 5's spelling of a ratio; rounded up) (default 0; 10 for the embedded "
        "model).",
    )
    warmup_ratio: float | None = _f(
        None,
        "Linear warmup as a fraction of the run's steps (rounded up), in [0, 1): the same as "
        "--warmup_steps below 1; exclusive with --warmup_steps.",
    )
    num_train_epochs: float | None = _f(
        None, "Epochs to train (default 3); exclusive with --max_steps.", resume_may_change=True
    )
    max_steps: int | None = _f(
        None, "Optimizer steps to train; exclusive with --num_train_epochs.", resume_may_change=True
    )
    seed: int = _f(42, "Seed for model init, data order and dropout.")
    precision: str = _f(
        "auto", "auto = bf16 where the accelerator supports it, else fp32.", choices=PRECISIONS
    )
    logging_steps: int | None = _f(
        None,
        "Log train metrics every N optimizer steps (default 10; 5 for the embedded model).",
        resume_may_change=True,
    )
    eval_steps: int | None = _f(
        None,
        "Evaluate every N steps; eval always runs at step 0 and at the end.",
        resume_may_change=True,
    )
    report_to: str = _f(
        "none",
        "Trackers that also get the metrics rows, the run's config and its checkpoint events: "
        "a comma list of tensorboard (OUT/tensorboard), wandb (needs `pip install wandb`; "
        "WANDB_PROJECT, WANDB_MODE=offline are read), csv (OUT/csv), or none.",
    )
    run_name: str | None = _f(
        None, "The run's name in trackers (default: the --output_dir folder's name)."
    )
    log_level: str = _f(
        "warning",
        "What DeepSpeed, transformers and datasets print: warning hides their info lines and "
        "known per-rank repeats (torch deprecations DeepSpeed triggers); info or debug shows "
        "everything.",
        choices=("warning", "info", "debug"),
    )
    plot: bool = _f(
        True,
        "Draw OUT/plots/training.png (train and eval loss, learning rate, tokens/s; checkpoints, "
        "resumes and preemptions marked) at each eval and at the end, on rank 0 in the background; "
        "--no_plot turns it off.",
    )
    ddp_timeout: int | None = _f(
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
    metric_for_best_model: str | None = _f(
        None,
        "The evaluation metric that picks the best checkpoint (kept by --save_total_limit besides "
        "the newest, marked by `finetune ls`, exported by `finetune export --best`) and that early "
        "stopping watches: eval_loss or eval_perplexity, the eval_ prefix optional. Given "
        "explicitly, or with --early_stopping_patience, --save_steps must be a multiple of "
        "--eval_steps (as HF's load_best_model_at_end), so every checkpoint has its evaluation; "
        "a checkpoint saved without one is never the best (default: eval_loss)",
    )
    greater_is_better: bool | None = _f(
        None,
        "Whether a higher --metric_for_best_model is better; --no_greater_is_better says it is "
        "not (default: off for losses and perplexity, else on)",
    )
    early_stopping_patience: int | None = _f(
        None,
        "Stop after this many evaluations in a row (every --eval_steps, which it needs; the one "
        "at step 0 is the baseline) without improving --metric_for_best_model: the final "
        "checkpoint is saved (with --save_checkpoint), exit 0, exit_status.json reason "
        "early_stopped. Off by default.",
    )
    early_stopping_threshold: float = _f(
        0.0,
        "How much an evaluation must beat the best so far by to count as an improvement for "
        "--early_stopping_patience.",
    )


@dataclass(frozen=True)
class CheckpointArgs:
    output_dir: str = _f(
        "output", "Where metrics.jsonl and checkpoints go.", resume_may_change=True
    )
    save_checkpoint: bool = _f(
        False,
        "Save checkpoints (always a final one; periodic with --save_steps).",
        resume_may_change=True,
    )
    save_steps: int | None = _f(None, "Also save every N optimizer steps.", resume_may_change=True)
    save_total_limit: int | None = _f(
        None,
        "Keep the K newest checkpoints, and the best one (--metric_for_best_model) besides; never "
        "deletes the newest complete one.",
        resume_may_change=True,
    )
    save_consolidated: bool = _f(
        False, "Also gather the weights into HF safetensors in the checkpoint folder."
    )
    async_save: bool = _f(
        False,
        "Periodic saves barely pause training: each rank's shard is copied into host memory "
        "(~1x the shard) by a thread while the next forward and backward run (the optimizer "
        "step waits for the copy), then written; the commit happens at a later step boundary. "
        "Consolidated weights are still written before training goes on.",
    )
    max_shard_size: str = _f(
        "5GB", "Largest consolidated safetensors shard (HF size string, e.g. 500MB)."
    )
    consolidated_dtype: str | None = _f(
        None,
        "dtype of consolidated weights (default: the training dtype).",
        choices=("bf16", "fp16", "fp32"),
    )
    remote_output_dir: str | None = _f(
        None,
        "Also copy every committed checkpoint to this object-storage URI (s3://BUCKET/PREFIX; "
        "pip install boto3), in the background; committed there by its manifest uploaded last. "
        "Credentials and endpoint: the AWS chain (AWS_PROFILE, AWS_ENDPOINT_URL, ...).",
    )
    resume_from_checkpoint: str | None = _f(
        None, "PATH, 'latest' or 'auto' (resume if a checkpoint exists).", resume_may_change=True
    )
    resume_skip_checksum: bool = _f(
        False, "Verify only file sizes (not checksums) before resuming.", resume_may_change=True
    )
    ignore_unverified_checkpoints: bool = _f(
        False,
        "With --resume_from_checkpoint auto: start fresh even when "
        "--output_dir holds checkpoints of which none verifies (they are set "
        "aside under OUT/.abandoned, not deleted). Without it such a run exits 2 "
        "naming each checkpoint and its problem.",
        resume_may_change=True,
    )
    on_save_error: str = _f(
        "continue",
        "What a failed periodic save does; a failed final save always exits 1.",
        choices=("continue", "abort"),
        resume_may_change=True,
    )
    preempt_signals: str = _f(
        "SIGTERM,SIGUSR1",
        "Signals that stop training at the next step boundary with a committed "
        "checkpoint (partitioned only) and exit code 75, for requeueing; 'none' disables.",
    )


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


GROUPS = (("model", ModelArgs), ("data", DataArgs), ("train", TrainArgs), ("ckpt", CheckpointArgs))
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
DEFAULT_DDP_TIMEOUT = 900
# Below this a healthy peer that is merely slow (a checkpoint fsync, a
# page-cache stall) fails the run.
MIN_DDP_TIMEOUT = 10
# The collective timeout's older spelling, in minutes; still read when --ddp_timeout is not given.
LEGACY_TIMEOUT_ENV = "FINETUNE_DIST_TIMEOUT_MIN"


# --- flag values → RunConfig -----------------------------------------------------------------

TRACKERS = ("tensorboard", "wandb", "csv")


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


def resume_may_change() -> frozenset[str]:
    """The flags a resume may give another value than the checkpoint's run without a warning:
    where the run goes and how long, how often it logs, evaluates and saves, and how it checks
    what it resumes (declared on each field: ``resume_may_change=True``)."""
    return frozenset(
        f.name
        for group in (ModelArgs, DataArgs, TrainArgs, CheckpointArgs)
        for f in dataclasses.fields(group)
        if f.metadata.get("resume_may_change")
    )


def flag_defaults() -> dict[str, Any]:
    """Every flag's value when it is not given (``None`` = unset, filled by ``resolve``)."""
    return {f.name: f.default for _, cls in GROUPS for f in dataclasses.fields(cls)}


def precision_shorthand(precision: str, shorthand: str | None) -> tuple[str, str]:
    """--precision with the --bf16/--fp16 shorthand: the precision, and how errors name its flag."""
    if shorthand is None:
        return precision, f"precision {precision}"
    if precision not in ("auto", shorthand):
        raise ConfigError(f"Can't give both `--{shorthand}` and `--precision {precision}`")
    return shorthand, shorthand


def split_names(value: str | list | tuple | None) -> list[str]:
    """A module-name list flag's names: given space-separated (argparse's nargs), comma-separated or
    as a YAML list."""
    if value is None:
        return []
    parts = value if isinstance(value, (list, tuple)) else [value]
    return [name for part in parts for name in re.split(r"[,\s]+", str(part)) if name]


def check_size(text: str) -> None:
    """A --max_shard_size value: a positive HF size string like 5GB or 500MB."""
    # The parser split_torch_state_dict_into_shards itself uses, so what passes here works there.
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        ok = parse_size_to_int(text) > 0
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(
            f"`--max_shard_size` must be a positive size like 5GB or 500MB, got {text!r}"
        )


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


def data_format(path: str) -> str | None:
    """The `datasets` builder for a local data file, from its extension."""
    return DATA_EXTENSIONS.get(Path(path).suffix.lower())


def env_world_size() -> int:
    """Every supported launcher exports WORLD_SIZE before our code runs; plain python is 1."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1
