"""CheckpointManager: crash-safe saves, retention and resume.

A save is snapshot → write → agree → commit:
  write   every rank calls ``engine.save_checkpoint`` into ``OUT/.staging/<tag>`` (a collective),
          through a checkpoint engine that fsyncs and checksums each file as it is written and
          *records* a failure instead of raising, so every rank still reaches DeepSpeed's barriers;
          then each rank writes its RNG state, rank 0 the tokenizer, config and trainer_state.json;
  agree   one all-gather of every rank's outcome: all succeeded, or everyone learns who failed;
  commit  rank 0 writes manifest.json into the staged folder, renames it to ``OUT/<tag>`` (the
          folder appears complete, in one step) and atomically replaces ``OUT/latest``.
A crash at any instant leaves ``latest`` naming a complete checkpoint, or absent.

Node-local storage (DeepSpeed's ``checkpoint.use_node_local_storage``): each node has its own
OUT, so every node's first rank (its *leader*) does there what rank 0 does on shared storage,
for the files of that node's ranks; its manifest lists those ranks. The commit has two phases:
all leaders write their manifests into staging and agree, and only then does any leader rename
its folder and advance its ``latest``. Resume takes the newest tag that verifies on every node.

Test seams: ``FINETUNE_FAIL_SAVE`` (see writer.py); ``FINETUNE_SKIP_SPACE_CHECK=1`` skips
the free-space pre-check so a test can provoke a real ENOSPC in the middle of a write.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import torch

from finetune import distributed as dist
from finetune.checkpoint.manifest import (
    MANIFEST,
    build_manifest,
    hash_file,
    read_manifest,
    write_json_durably,
)
from finetune.checkpoint.resume import ResumePlan, Resumer
from finetune.checkpoint.state import TRAINER_STATE, TrainingState, rng_state
from finetune.checkpoint.storage import (
    STAGING,
    LocalStorage,
    fsync_path,
    step_of,
    tag_for,
)
from finetune.checkpoint.writer import GuardedWriter
from finetune.config import RunConfig, zero_stage
from finetune.distributed import logger

SKIP_SPACE_CHECK_ENV = "FINETUNE_SKIP_SPACE_CHECK"
# Adam keeps fp32 master weights + two moments (12 B/param); the module states add a copy.
BYTES_PER_PARAM_ESTIMATE = 16
SPACE_MARGIN = 1.10


class SaveError(RuntimeError):
    """A save failed on at least one rank; every rank raises it, nothing was committed."""


def versions() -> dict:
    import deepspeed
    import transformers

    import finetune

    return {"finetune": finetune.__version__, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__}


def node_local(ds_config: dict) -> bool:
    return bool((ds_config.get("checkpoint") or {}).get("use_node_local_storage", False))


class CheckpointManager:
    def __init__(self, cfg: RunConfig, tokenizer, storage: LocalStorage | None = None):
        self.cfg, self.tokenizer, self.engine = cfg, tokenizer, None
        self.out = Path(cfg.ckpt.output_dir)
        self.storage = storage or LocalStorage(self.out)
        self.node_local = node_local(cfg.ds_config)
        # Node-local: which ranks share an OUT is found out (marker files), not guessed from host names.
        self.groups = dist.sharing_groups(self.out, "output_dir") if self.node_local else [list(range(dist.world_size()))]
        self.my_group = next(g for g in self.groups if dist.rank() in g)
        self.leader = dist.rank() == self.my_group[0]  # rank 0's role, for this rank's storage
        self.resumer = Resumer(cfg, self.storage, self.node_local, self.leader)

    def attach(self, engine) -> None:
        """Take over the engine's checkpoint writes (call once, after deepspeed.initialize)."""
        self.engine = engine
        self.writer = GuardedWriter(engine.checkpoint_engine)
        engine.checkpoint_engine = self.writer
        if hasattr(engine, "_copy_recovery_script"):
            engine._copy_recovery_script = self.writer.guard(engine._copy_recovery_script)

    # --- save ------------------------------------------------------------------------------

    def save(self, state: TrainingState, final: bool, consolidated: bool | None = None) -> Path:
        """Save and commit a checkpoint of ``state``; raises SaveError on every rank if any failed.

        ``consolidated`` overrides --save_consolidated (a preemption save skips the gather).
        """
        tag, clock = tag_for(state.global_step), _Clock()
        self._check_space(tag)
        clock.lap("check")
        self._write(tag, state, self.cfg.ckpt.save_consolidated if consolidated is None else consolidated)
        clock.lap("write")
        files = self._agree_written(tag)
        clock.lap("agree")
        self._commit(tag, files)
        clock.lap("commit")
        self._retain(tag)
        clock.lap("retain")
        total = sum(size for size, _ in files.values())
        logger.info("Finished saving the checkpoint %s in %.2f seconds (%.1f MB, %.1f MB/s; %s)%s.", tag, clock.total,
                    total / 1e6, total / 1e6 / max(clock.total, 1e-9), clock, " [final]" if final else "")
        return self.out / tag

    def _check_space(self, tag: str) -> None:
        if os.environ.get(SKIP_SPACE_CHECK_ENV) == "1":
            return  # test seam: lets tests hit a real ENOSPC mid-write
        need = self._estimate_bytes()
        free = self.storage.free_bytes()
        errors = dist.all_gather_object(None if free >= need else f"{free / 1e9:.2f} GB free, need ~{need / 1e9:.2f} GB")
        bad = {r: e for r, e in enumerate(errors) if e}
        if bad:
            raise SaveError(f"not saving {tag}: not enough free space in {self.out} ({_describe(bad)})")

    def _estimate_bytes(self) -> int:
        """The previous checkpoint's size, else a per-parameter estimate for Adam under ZeRO."""
        for tag in reversed(self.storage.tags()):
            manifest = read_manifest(self.out / tag)
            if manifest:
                return int(manifest["total_bytes"] * SPACE_MARGIN)
        from finetune.modeling import count_parameters

        return int(count_parameters(self.engine.module) * BYTES_PER_PARAM_ESTIMATE * SPACE_MARGIN)

    def _write(self, tag: str, state: TrainingState, consolidated: bool) -> None:
        """Every rank: DeepSpeed's files, then our own. Failures are recorded in ``self.writer``."""
        staging_root = self.out / STAGING
        if self.leader:
            self.storage.remove(f"{STAGING}/{tag}")  # leftovers of a crashed save of the same step
        self.writer.reset(staging_root / tag, state.global_step)
        try:
            # Collective: every rank must call it (a rank-0-only call hangs under ZeRO-3).
            self.engine.save_checkpoint(str(staging_root), tag=tag, save_latest=False)
        except Exception as e:
            # Every write inside is guarded, so this is unexpected, and this rank may have skipped
            # one of DeepSpeed's collectives: agreeing now could hang. Fail the run loudly instead;
            # nothing was committed, so `latest` still names a complete checkpoint.
            raise RuntimeError(f"DeepSpeed's save_checkpoint raised on rank {dist.rank()}; stopping because "
                               f"the ranks may be out of step: {type(e).__name__}: {e}") from e
        folder = staging_root / tag
        if consolidated:
            self._write_consolidated(folder)
        self.writer.save(rng_state(), str(folder / f"rng_state_{dist.rank()}.pt"))
        if self.leader and self.writer.error is None:
            try:
                self._write_rank0_files(folder, state)
            except Exception as e:  # noqa: BLE001 — recorded; the agree step decides for all ranks
                self.writer._fail(folder, e)

    def _write_consolidated(self, folder: Path) -> None:
        """Collective: every rank gathers, even one whose own writes already failed."""
        from finetune.checkpoint.consolidate import save_consolidated
        from finetune.modeling import DTYPES

        dtype = DTYPES[self.cfg.ckpt.consolidated_dtype or self.cfg.train.precision]
        try:
            self.writer.files.update(save_consolidated(self.engine.module, folder, dtype, self.cfg.ckpt.max_shard_size))
        except Exception as e:  # noqa: BLE001 — recorded; the agree step decides for all ranks
            self.writer._fail(folder, e)

    def _write_rank0_files(self, folder: Path, state: TrainingState) -> None:
        module = self.engine.module
        config = copy.deepcopy(module.config)
        config.use_cache = True  # turned off for training only; inference wants it
        config.save_pretrained(folder)
        if getattr(module, "generation_config", None) is not None and module.can_generate():
            module.generation_config.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        write_json_durably(folder / TRAINER_STATE, self._trainer_state(state))
        for path in folder.rglob("*"):
            rel = str(path.relative_to(folder))
            if path.is_file() and rel not in self.writer.files:
                self.writer.files[rel] = hash_file(path)
                fsync_path(path)

    def _trainer_state(self, state: TrainingState) -> dict:
        return {**state.state_dict(), "world_size": dist.world_size(), "zero_stage": zero_stage(self.cfg.ds_config),
                "dtype": self.cfg.train.precision, "args": self.cfg.to_json_dict(), "versions": versions(),
                "lr_scheduler": "in DeepSpeed's model_states files (lr_scheduler key)"}

    def _agree_written(self, tag: str) -> dict[str, tuple[int, str]]:
        """Collective: every rank's outcome. On any failure, clean up and raise on every rank."""
        outcomes = dist.all_gather_object((self.writer.error, self.writer.files))
        bad = {r: err for r, (err, _) in enumerate(outcomes) if err}
        if bad:
            self._drop_staging(tag)
            dist.barrier()  # nobody moves on while the staging folder is being removed
            raise SaveError(f"save of {tag} failed on {_describe(bad)}; latest is unchanged")
        files: dict[str, tuple[int, str]] = {}
        for r, (_, rank_files) in enumerate(outcomes):
            if r in self.my_group:  # on shared storage, every rank
                files.update(rank_files)
        return files

    def _drop_staging(self, tag: str) -> None:
        """Leaders: remove a failed save's staging. Best effort: callers go on to a collective."""
        if self.leader:
            try:
                self.storage.remove(f"{STAGING}/{tag}")
                self.storage.finish_staging()
            except OSError as e:
                logger.warning("could not remove %s/%s: %s", STAGING, tag, e)

    def _commit(self, tag: str, files: dict[str, tuple[int, str]]) -> None:
        """Leaders: manifests into staging, agree, then rename and advance ``latest``. Collective."""
        ranks = self.my_group if self.node_local else None
        error = None
        if self.leader:
            try:
                prepare_staged(self.storage, tag, files, dist.world_size(), versions(), ranks)
            except Exception as e:  # noqa: BLE001 — leader-only work: every failure must reach the gather
                error = f"{type(e).__name__}: {e}"
        errors = {r: e for r, e in enumerate(dist.all_gather_object(error)) if e}
        if errors:
            self._drop_staging(tag)
            dist.barrier()
            raise SaveError(f"commit of {tag} failed on {_describe(errors)}; latest is unchanged")
        if self.leader:
            try:
                publish_staged(self.storage, tag)
            except Exception as e:  # noqa: BLE001 — leader-only work: every failure must reach the gather
                error = f"{type(e).__name__}: {e}"
        errors = {r: e for r, e in enumerate(dist.all_gather_object(error)) if e}
        if errors:
            # Only a rename or the `latest` write failed, after every node had its files complete.
            self._drop_staging(tag)  # a no-op where the rename happened
            dist.barrier()
            raise SaveError(f"commit of {tag} failed on {_describe(errors)}; `latest` may now differ between "
                            "nodes (resume takes the newest checkpoint complete on all of them)")

    def _retain(self, newest: str) -> None:
        limit = self.cfg.ckpt.save_total_limit
        if limit and self.leader:
            complete = [t for t in self.storage.tags() if self.storage.exists(f"{t}/{MANIFEST}")]
            for tag in select_for_deletion(complete, limit, {newest, self.storage.read_latest()}):
                logger.info("save_total_limit %d: deleting %s", limit, tag)
                self.storage.remove(tag)
        dist.barrier()

    # --- resume ----------------------------------------------------------------------------

    # --- resume (see resume.py) --------------------------------------------------------------

    def plan_resume(self) -> ResumePlan | None:
        """What to resume from, decided before the engine exists. Collective."""
        return self.resumer.plan_resume()

    def resume(self, trainer, plan: ResumePlan | None) -> bool:
        """Restore ``trainer`` from ``plan``; False when starting fresh."""
        return self.resumer.resume(self.engine, trainer, plan)


def commit_staged(storage: LocalStorage, tag: str, files: dict[str, tuple[int, str]], world_size: int,
                  versions: dict, ranks: list[int] | None = None) -> None:
    """A leader's commit of ``.staging/<tag>``. Each step is atomic; a crash between any two leaves
    ``latest`` naming a complete checkpoint (the old one, or the new one once it is in place).
    """
    prepare_staged(storage, tag, files, world_size, versions, ranks)
    publish_staged(storage, tag)


def prepare_staged(storage: LocalStorage, tag: str, files: dict[str, tuple[int, str]], world_size: int,
                   versions: dict, ranks: list[int] | None = None) -> None:
    """The manifest, written *inside* the staged folder before the rename, so the folder never
    appears under its final name without the file that marks it complete. ``ranks``: the ranks
    whose files this storage holds (node-local storage); None = all of them."""
    staged = storage.root / STAGING / tag
    write_json_durably(staged / MANIFEST, build_manifest(tag, files, world_size, versions, ranks))
    fsync_path(staged)


def publish_staged(storage: LocalStorage, tag: str) -> None:
    # Never overwrite in place: a folder of the same step (an abandoned timeline's) is swapped out.
    storage.replace_dir(f"{STAGING}/{tag}", tag)
    storage.write_latest(tag)
    storage.finish_staging()


def select_for_deletion(complete: list[str], limit: int, protected: set) -> list[str]:
    """The oldest complete checkpoints beyond ``limit``, never a protected one (newest, latest)."""
    ordered = sorted(complete, key=step_of)
    excess = len(ordered) - limit
    return [t for t in ordered if t not in protected][:max(excess, 0)]


class _Clock:
    """Per-phase timings of one save, for the log line."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps: list[tuple[str, float]] = []

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps.append((name, now - self.last))
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.start

    def __str__(self) -> str:
        return " ".join(f"{name} {seconds:.2f}s" for name, seconds in self.laps)


def _describe(bad: dict[int, str]) -> str:
    return "; ".join(f"rank {r}: {e}" for r, e in sorted(bad.items()))
