"""The checkpoint flags (``CheckpointArgs``): where and when checkpoints are saved, what they
hold, the bucket they are copied to, resuming, preemption; and their checks, on the values alone."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from finetune.config.fields import ConfigError, flag, require_positive


@dataclass(frozen=True)
class CheckpointArgs:
    output_dir: str = flag(
        "output", "Where metrics.jsonl and checkpoints go.", resume_may_change=True
    )
    save_checkpoint: bool = flag(
        False,
        "Save checkpoints (always a final one; periodic with --save_steps).",
        resume_may_change=True,
    )
    save_steps: int | None = flag(
        None, "Also save every N optimizer steps.", resume_may_change=True
    )
    save_total_limit: int | None = flag(
        None,
        "Keep the K newest checkpoints, and the best one (--metric_for_best_model) besides; never "
        "deletes the newest complete one.",
        resume_may_change=True,
    )
    save_consolidated: bool = flag(
        False, "Also gather the weights into HF safetensors in the checkpoint folder."
    )
    async_save: bool = flag(
        False,
        "Periodic saves barely pause training: each rank's shard is copied into host memory "
        "(~1x the shard) by a thread while the next forward and backward run (the optimizer "
        "step waits for the copy), then written; the commit happens at a later step boundary. "
        "Consolidated weights are still written before training goes on.",
    )
    max_shard_size: str = flag(
        "5GB", "Largest consolidated safetensors shard (HF size string, e.g. 500MB)."
    )
    consolidated_dtype: str | None = flag(
        None,
        "dtype of consolidated weights (default: the training dtype).",
        choices=("bf16", "fp16", "fp32"),
    )
    remote_output_dir: str | None = flag(
        None,
        "Also copy every committed checkpoint to this object-storage URI (s3://BUCKET/PREFIX; "
        "pip install boto3), in the background; committed there by its manifest uploaded last. "
        "Credentials and endpoint: the AWS chain (AWS_PROFILE, AWS_ENDPOINT_URL, ...).",
    )
    resume_from_checkpoint: str | None = flag(
        None, "PATH, 'latest' or 'auto' (resume if a checkpoint exists).", resume_may_change=True
    )
    resume_skip_checksum: bool = flag(
        False, "Verify only file sizes (not checksums) before resuming.", resume_may_change=True
    )
    ignore_unverified_checkpoints: bool = flag(
        False,
        "With --resume_from_checkpoint auto: start fresh even when "
        "--output_dir holds checkpoints of which none verifies (they are set "
        "aside under OUT/.abandoned, not deleted). Without it such a run exits 2 "
        "naming each checkpoint and its problem.",
        resume_may_change=True,
    )
    on_save_error: str = flag(
        "continue",
        "What a failed periodic save does; a failed final save always exits 1.",
        choices=("continue", "abort"),
        resume_may_change=True,
    )
    preempt_signals: str = flag(
        "SIGTERM,SIGUSR1",
        "Signals that stop training at the next step boundary with a committed "
        "checkpoint (partitioned only) and exit code 75, for requeueing; 'none' disables.",
    )

    @classmethod
    def check(cls, v: Mapping[str, Any]) -> None:
        """The checkpoint flags' own rules, on the flag values before any file is read (the
        remote URI and the signals are read by the modules that know them: flag_checks): each
        failure names its flag."""
        require_positive(v, ("save_steps", "save_total_limit"))
        if v["max_shard_size"] is not None:
            check_size(v["max_shard_size"])
        if v["remote_output_dir"] and not v["save_checkpoint"]:
            raise ConfigError(
                "`--remote_output_dir` copies checkpoints: it needs `--save_checkpoint`"
            )
        if (
            v["save_steps"] or v["save_total_limit"] or v["save_consolidated"] or v["async_save"]
        ) and not v["save_checkpoint"]:
            raise ConfigError(
                "`--save_steps`, `--save_total_limit`, `--save_consolidated` and `--async_save` "
                "need `--save_checkpoint`"
            )
        if v["ignore_unverified_checkpoints"] and v["resume_from_checkpoint"] != "auto":
            raise ConfigError(
                "`--ignore_unverified_checkpoints` needs `--resume_from_checkpoint auto`"
            )


# HF's size units (huggingface_hub's parse_size_to_int, what save_pretrained's max_shard_size
# takes), decimal as there: 5GB is 5 * 10**9 bytes.
SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def size_bytes(text: str) -> int:
    """Bytes of a size like 5GB, 500MB or 1.5GB, as huggingface_hub parses it (importing that
    parser costs an export 0.1 s). ValueError for anything else."""
    text = text.strip()
    unit = SIZE_UNITS.get(text[-2:].upper())
    if unit is None:
        raise ValueError(f"{text!r}: not a size in TB, GB, MB or KB")
    return int(float(text[:-2].strip()) * unit)


def check_size(text: str) -> None:
    """A --max_shard_size value: a positive HF size string like 5GB or 500MB."""
    try:
        ok = size_bytes(text) > 0
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(
            f"`--max_shard_size` must be a positive size like 5GB or 500MB, got {text!r}"
        )
