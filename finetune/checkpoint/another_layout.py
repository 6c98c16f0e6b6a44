"""Resuming on another layout than the one that saved: another world size (ZeRO-3's partitions
change: DeepSpeed's universal format, converted once and reused) or another
--sequence_parallel_size (the partitions do not depend on it; the data-parallel ranks, and so the
rows a step takes, do). The data order continues from the saved global sample either way: the
sampler deals the rows left in the epoch over the data-parallel ranks there are now.

A universal conversion stopped for a preemption signal raises ``ConversionStopped`` on every
rank; what the run does then (exit 75, requeue) is the loop's to decide (build.py).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetune import distributed as dist
from finetune.checkpoint_format.outdir import step_of
from finetune.distributed import logger
from finetune.io.faults import fault_point
from finetune.weights.universal import UNIVERSAL, to_universal, verify_universal


class ConversionStopped(Exception):
    """The universal conversion was stopped for a preemption signal (``signalled``), the pieces
    it finished kept for the next start; raised alike on every rank."""


def convert_for_this_world(
    folder: Path,
    manifest: dict[str, Any],
    checksums: bool,
    leader: bool,
    signalled: Callable[[], bool],
) -> Path:
    """``folder`` in the universal format (its ``universal/``), for a world size other than the one
    that saved it. The ``leader`` (rank 0, or each node's first rank on node-local storage)
    converts with DeepSpeed's ZeRO-3 conversion in resumable pieces (universal.py), staged, then
    renamed, with a manifest of its own; an existing conversion is reused only if it verifies
    against that manifest (``checksums``: its files' too). The other ranks wait in short polling
    collectives, however long it takes. A preemption signal on any rank (``signalled``) stops it
    (the pieces done are kept for the next start): ConversionStopped on every rank. Collective."""
    target = folder / UNIVERSAL
    cancel = threading.Event()

    def convert() -> str:
        fault_point("resume.universal", step_of(folder.name))
        if target.is_dir():
            problems = verify_universal(target, manifest.get("save_id"), checksums, cancel)
            if not problems:
                return "reused"
            logger.warning("not reusing %s: %s; converting again", target, "; ".join(problems[:3]))
            shutil.rmtree(target)
        start = time.perf_counter()
        summary = to_universal(folder, target, cancel)
        logger.info(
            "Converted %s to the universal format in %.1f seconds (%s).",
            folder.name,
            time.perf_counter() - start,
            summary,
        )
        return "converted"

    out = dist.gather_outcomes(
        convert,
        on=leader,
        step=f"converting {folder.name} for {dist.world_size()} ranks",
        stop=signalled,
        cancel=cancel,
    )
    if not out.ok and (cancel.is_set() or "Interrupted" in out.kinds.values()):
        # Stopped for a signal (or its converter died of one first): the pieces are kept.
        raise ConversionStopped(
            f"preempted while converting {folder.name} to the universal format: {out.describe()}"
        )
    # a conversion that finished despite a signal goes on: the first boundary stops
    out.raise_any()
    return target


def say_layout_change(saved: dict[str, Any], universal: Path | None) -> None:
    """Rank 0 says how the layout changed since the save (``saved``: its trainer_state.json;
    ``universal``: the conversion loaded, when the world size changed), and where the data order
    continues; nothing when it did not change."""
    sampler = saved["sampler"]
    if universal is not None:
        dist.log_main(
            logging.INFO,
            "Resuming a %d-rank checkpoint on %d ranks: loading DeepSpeed's universal format from "
            "%s; the data order continues from global sample %d of epoch %d.",
            saved["world_size"],
            dist.world_size(),
            universal,
            sampler["consumed"],
            sampler["epoch"],
        )
    was = int(saved.get("args", {}).get("train", {}).get("sequence_parallel_size", 1))
    if was != dist.sequence_parallel_size():
        dist.log_main(
            logging.INFO,
            "Resuming a checkpoint saved with --sequence_parallel_size %d on %d ranks (%d "
            "data-parallel) with %d on %d (%d data-parallel); the data order continues from "
            "global sample %d.",
            was,
            saved["world_size"],
            saved["world_size"] // was,
            dist.sequence_parallel_size(),
            dist.world_size(),
            dist.data_parallel_size(),
            sampler["consumed"],
        )
