"""What a checkpoint holds besides DeepSpeed's rank files, written at a save and read back at a
resume, as plain functions the Checkpointer calls: the leader's shared files (config, tokenizer,
trainer_state.json), the consolidated weights, each rank's RNG and log window (``restore``), and
the records a save carries from its snapshot to its commit, and what one save cost this rank (phase
timings for the "Finished saving" line, and its I/O).

A write the other ranks would not see never raises here: its failure comes back as a value for
the save's agree step. ``write_consolidated`` and ``restore`` are collective.

Test seam: ``FINETUNE_SAVE_IO=<dir>`` writes each rank's record to ``<dir>/<tag>-rank<r>.json``.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from finetune import distributed as dist
from finetune.checkpoint.writer import Files
from finetune.checkpoint_format.outdir import STAGING, OutputDir
from finetune.checkpoint_format.state import TRAINER_STATE, LogWindow, set_rng_state
from finetune.distributed import logger
from finetune.io import seams
from finetune.io.durable import WriteCancelled, bytes_hashed
from finetune.io.faults import fault_point
from finetune.ops import replay_adam_steps
from finetune.weights.adapter import ADAPTER_WEIGHTS, write_adapter_config

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from torch.distributed.checkpoint.stateful import Stateful
    from transformers import PreTrainedTokenizerBase

    from finetune.checkpoint.resume import ResumePlan

RANK_WINDOW = "log_window"  # in rng_state_{r}.pt: rank r's own log window (state.py)
CONSOLIDATED_PATTERNS = (
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    ADAPTER_WEIGHTS,
)


def versions() -> dict[str, str]:
    """The versions a checkpoint was written with (its manifest and trainer_state.json)."""
    import deepspeed
    import transformers

    import finetune

    return {
        "finetune": finetune.__version__,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
    }


@dataclass
class Snapshot:
    """What a save captures before writing: this rank's RNG, and (leaders) the trainer state."""

    step: int
    rng: dict[str, object] | None = None
    trainer_state: dict[str, object] | None = None


@dataclass
class Pending:
    """A save between its write and its commit (--async_save: written on a thread meanwhile)."""

    step: int
    tag: str
    clock: Clock
    io: SaveIO
    consolidated: bool
    final: bool
    background: bool
    eval: dict[str, float] | None = None  # its step's evaluation (the manifest's), taken then


def trainer_state(
    states: dict[str, Stateful], window: LogWindow, run_info: dict[str, object]
) -> dict[str, object]:
    """trainer_state.json: ``states["progress"]``'s keys at the top level (where checkpoints have
    always had them), every other state under its name, the world's log window, ``run_info``."""
    others = {name: state.state_dict() for name, state in states.items() if name != "progress"}
    return {
        **states["progress"].state_dict(),
        **others,
        "window": window.state_dict(),
        **run_info,
        "world_size": dist.world_size(),
        "versions": versions(),
    }


def write_consolidated(
    module: torch.nn.Module,
    folder: Path,
    dtype: torch.dtype,
    max_shard_size: str | None,
    adapters: bool,
) -> tuple[Files, dict[str, object] | None, str | None]:
    """Collective: every rank gathers, even one whose own writes already failed. Returns (the
    files written, the adapter's summary for the manifest, the consolidation's error or None)."""
    from finetune.weights.adapter import save_adapter
    from finetune.weights.consolidate import ConsolidationFailed, save_consolidated

    try:
        if adapters:  # the adapters alone, as peft saves them (the base is elsewhere, unchanged)
            files, summary = save_adapter(module, folder, dtype)
            return files, summary, None
        return save_consolidated(module, folder, dtype, max_shard_size), None, None
    except ConsolidationFailed as e:
        # every rank is past the gathers: recorded, only safetensors dropped
        return {}, None, str(e)
    except Exception as e:
        # Escaped mid-gather (a transport error): this rank may have left the others inside a
        # collective, so agreeing now could hang. Fail loudly; nothing was committed.
        raise RuntimeError(
            f"the consolidated save raised on rank {dist.rank()} mid-gather; stopping because "
            f"the ranks may be out of step: {type(e).__name__}: {e}"
        ) from e


def write_shared(
    storage: OutputDir,
    module: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    folder: Path,
    snap: Snapshot,
    consolidated_dtype: torch.dtype | None,
    adapters: bool,
    cancelled: threading.Event,
) -> Files:
    """A leader's files: config, tokenizer, trainer_state.json; hashes only what it wrote here.
    ``consolidated_dtype``: the consolidated weights' dtype, which config.json then records (None:
    no consolidated weights). Returns the files (never records them: a write that hung past its
    deadline and returns later must not touch a later save's list)."""
    fault_point("save.shared_files", snap.step)
    _save_config(module, folder, consolidated_dtype)
    written = [folder / "config.json"]
    if getattr(module, "generation_config", None) is not None and module.can_generate():
        module.generation_config.save_pretrained(folder)
        written.append(folder / "generation_config.json")
    written += [Path(p) for p in tokenizer.save_pretrained(folder)]
    if adapters:  # what export and PeftModel.from_pretrained need to rebuild the adapters
        written.append(write_adapter_config(module, folder))
    if cancelled.is_set():  # given up on (a hung write above): write no more
        raise WriteCancelled(f"{folder}: the save was given up")
    files: Files = {}
    staged = f"{STAGING}/{folder.name}"
    for name in dict.fromkeys(path.name for path in written):
        if storage.is_file(f"{staged}/{name}"):
            files[name] = storage.storage.checksum(f"{staged}/{name}")
            storage.storage.sync(f"{staged}/{name}")
    files[TRAINER_STATE] = storage.write_json(f"{staged}/{TRAINER_STATE}", snap.trainer_state)
    return files


def _save_config(module: torch.nn.Module, folder: Path, dtype: torch.dtype | None) -> None:
    config = copy.deepcopy(module.config)
    config.use_cache = True  # turned off for training only; inference wants it
    if dtype is not None:
        config.dtype = dtype  # config.json describes the safetensors beside it
    config.save_pretrained(folder)


def restored_window(world: LogWindow, own: dict[str, object] | None, same_world: bool) -> LogWindow:
    """This rank's log window after a resume. ``world``: trainer_state.json's (the world's sum;
    rank 0's own in checkpoints written before rank files kept theirs); ``own``: the rank file's.
    At the same world size each rank takes its own, so the next row sums exactly what the
    uninterrupted run's does; on another world size rank 0 takes the world's sum and the others
    start empty. Every rank keeps the window's step count, which decides (alike everywhere)
    whether a row is due at the end."""
    if same_world and own is not None:
        return LogWindow.from_state_dict(own)
    if dist.is_main():
        return world
    return LogWindow(
        steps=world.steps, skipped_steps=world.skipped_steps, lr=world.lr, grad_norm=world.grad_norm
    )


def is_consolidated(name: str) -> bool:
    """Whether ``name`` is one of the consolidated weights' files (CONSOLIDATED_PATTERNS)."""
    return name in ("model.safetensors", "model.safetensors.index.json", ADAPTER_WEIGHTS) or (
        name.startswith("model-") and name.endswith(".safetensors")
    )


def describe(bad: dict[int, str]) -> str:
    """Each failing rank's error, for a save's error line."""
    return "; ".join(f"rank {r}: {e}" for r, e in sorted(bad.items()))


def restore(
    plan: ResumePlan,
    engine: DeepSpeedEngine,
    states: dict[str, Stateful],
    out: Path,
    adapters: bool,
) -> None:
    """Restore the engine, the states (``states["progress"]``: trainer_state.json's top level;
    each other one its own key) and this rank's RNG and log window (``restored_window``) from
    ``plan``, and trim metrics.jsonl after its step. Collective."""
    progress = states["progress"]
    start = time.perf_counter()
    folder = plan.folder
    if plan.universal is not None:  # converted for this world size: its own folder inside
        load_dir = str(folder)
        tag = plan.universal.name
    else:
        load_dir = str(folder.parent)
        tag = folder.name
    # --use_peft: the rank files hold no frozen base weight, so the module's state
    # is partial (the adapters' own weights come from the optimizer's fp32
    # partitions, as in full fine-tuning).
    load_path, _ = engine.load_checkpoint(
        load_dir,
        tag=tag,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        **({"load_module_strict": False} if adapters else {}),
    )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint {folder}")
    # CPU Adam's running beta powers, as the uninterrupted run has them
    replay_adam_steps(engine)
    progress.load_state_dict(plan.saved)
    for name, state in states.items():
        if name != "progress":
            state.load_state_dict(plan.saved[name])
    rng_file = folder / f"rng_state_{dist.rank()}.pt"

    def load_rng() -> dict[str, object] | None:
        fault_point("resume.load_rng")
        if not rng_file.exists():  # (the plan's folder may be outside OUT: a local path)
            return None
        state = torch.load(rng_file, weights_only=True)
        set_rng_state(state)
        return state

    state = dist.run_agreed(
        load_rng, step="restoring each rank's RNG", deadline_s=dist.io_deadline()
    )
    if state is None:
        logger.warning(
            "no RNG state for rank %d in %s (it had %d ranks); this rank keeps its seeded RNG",
            dist.rank(),
            folder.name,
            plan.saved["world_size"],
        )
    progress.window = restored_window(
        progress.window,
        (state or {}).get(RANK_WINDOW),
        plan.saved["world_size"] == dist.world_size(),
    )
    from finetune.metrics import truncate_after

    def truncate() -> None:
        fault_point("resume.truncate_metrics")
        truncate_after(out / "metrics.jsonl", progress.global_step)

    # metrics.jsonl is rank 0's, whatever the storage; a crashed run's tail goes.
    dist.run_agreed(
        truncate,
        on=dist.is_main(),
        step="trimming metrics.jsonl",
        deadline_s=dist.io_deadline(),
    )
    logger.info(
        "Resumed from %s at step %d (epoch %.2f) in %.2f seconds.",
        folder,
        progress.global_step,
        progress.epoch,
        time.perf_counter() - start,
    )


# -------------------- what one save cost this rank --------------------


class SaveIO:
    """This rank's save I/O: bytes it wrote, bytes our code read back (hash_file), and the
    kernel's read counters for the whole process (/proc/self/io), as deltas over one save."""

    def __init__(self):
        self.io0 = _proc_io()
        self.hashed0 = bytes_hashed()

    def finish(self, tag: str, files: Files, seconds: float) -> dict[str, int | float | str]:
        """This rank's record of the save of ``tag`` (FINETUNE_SAVE_IO: also written there)."""
        io0 = self.io0
        io1 = _proc_io()
        record = {
            "tag": tag,
            "rank": dist.rank(),
            "world_size": dist.world_size(),
            "seconds": round(seconds, 4),
            "own_bytes": sum(size for size, _ in files.values()),
            "hashed_bytes": bytes_hashed() - self.hashed0,
            **{f"{k}_delta": io1[k] - io0[k] for k in io1 if k in io0},
        }
        folder = seams.value(seams.SAVE_IO)
        if folder:
            try:
                Path(folder).mkdir(parents=True, exist_ok=True)
                (Path(folder) / f"{tag}-rank{dist.rank()}.json").write_text(json.dumps(record))
            except OSError as e:
                logger.warning("%s: %s", seams.SAVE_IO, e)
        return record


def _proc_io() -> dict[str, int]:
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return {}
    return {
        k: int(v)
        for k, v in (line.split(": ") for line in lines)
        if k in ("rchar", "read_bytes", "wchar")
    }


WRITER_LAPS = ("write", "copy", "background")


class Clock:
    """Per-phase timings of one save, for the log line."""

    def __init__(self):
        self.start = time.perf_counter()
        self.last = self.start  # the end of the last lap
        self.laps: list[tuple[str, float]] = []

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps.append((name, now - self.last))
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.start

    @property
    def writer(self) -> float:
        """Seconds the save's rank files took to write: a synchronous save's "write" lap; an
        --async_save's "copy" (its snapshot planned) and "background" (until its writes were found
        done, at a step boundary)."""
        return sum(seconds for name, seconds in self.laps if name in WRITER_LAPS)

    def __str__(self) -> str:
        return " ".join(f"{name} {seconds:.2f}s" for name, seconds in self.laps)


def fmt_bytes(n: int | float) -> str:
    """A size for a log line: MB below a GB (two decimals: a small checkpoint's is not
    "0.01 GB"), else GB."""
    return f"{n / 1e6:.2f} MB" if abs(n) < 1e9 else f"{n / 1e9:.2f} GB"


def space_report(freed: dict[int, tuple[int, int | None]], need: int) -> str:
    """What removing a failed save's staging freed, what is free now and what a save needs, for the
    save's error line. ``freed``: leader rank → (bytes freed, bytes free now or None where the
    free space could not be read); several leaders (node-local storage) are named by rank."""
    parts = []
    for rank, (gone, free) in sorted(freed.items()):
        text = f"removing its staging freed {fmt_bytes(gone)}"
        if free is not None:
            text += f"; {fmt_bytes(free)} free now, a save needs ~{fmt_bytes(need)}"
            if free < need:
                text += " (the next save is refused until space is freed)"
        parts.append(f"rank {rank}: {text}" if len(freed) > 1 else text)
    return "; ".join(parts)


def finished(
    tag: str, clock: Clock, total: int, own: dict[str, int | float | str], final: bool
) -> str:
    """The log line of a committed save: its time, size, rate, phases and rank 0's own I/O."""
    return (
        f"Finished saving the checkpoint {tag} in {clock.total:.2f} seconds "
        f"({total / 1e6:.1f} MB, {total / 1e6 / max(clock.total, 1e-9):.1f} MB/s; {clock}; rank 0 "
        f"wrote {own['own_bytes'] / 1e6:.1f} MB and read back {own['hashed_bytes'] / 1e6:.2f} MB)"
        f"{' [final]' if final else ''}."
    )
