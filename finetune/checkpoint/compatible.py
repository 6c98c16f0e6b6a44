"""What a resume holds the run to, before anything is set aside or built: the flags the checkpoint
was saved with (another value is warned of, unless a resume may change it), a LoRA checkpoint's
base and adapter shapes (lora.py), and a preference objective's reference (reference.py). Every
refusal is a ConfigError naming the flag (exit 2), raised alike on every rank: it reads only facts
every rank shares (the saved trainer state, the identities computed on rank 0 and shared)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from finetune import distributed as dist
from finetune.config import RunConfig, resume_may_change
from finetune.lora import check_resumable
from finetune.reference import check_resume


def check_compatible(
    folder: Path,
    saved: dict[str, Any],
    cfg: RunConfig,
    base: dict[str, Any] | None,
    reference: dict[str, Any] | None,
) -> None:
    """``saved``: the checkpoint's trainer_state.json; ``base``: the LoRA base's identity;
    ``reference``: the objective's reference record (reference.record)."""
    check_resumable(folder, saved, cfg.model, base)
    check_resume(folder, saved, cfg, reference)
    warn_changed_flags(saved, cfg)


def warn_changed_flags(saved: dict[str, Any], cfg: RunConfig) -> None:
    """Warn of each flag the checkpoint was saved with another value of (unless a resume may
    change it), naming both."""
    for group, now in cfg.to_json_dict().items():
        for key, value in now.items():
            before = saved.get("args", {}).get(group, {}).get(key, value)
            if before != value and key not in resume_may_change():
                dist.log_main(
                    logging.WARNING,
                    "resume: --%s is %r now, was %r in the checkpoint",
                    key,
                    value,
                    before,
                )
