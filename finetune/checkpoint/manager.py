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

Test seam: ``FINETUNE_FAIL_SAVE="<rank>[:<step>]"`` makes that rank's checkpoint writes fail
with EIO (at every save, or only the save of that step); ``FINETUNE_SKIP_SPACE_CHECK=1`` skips
the free-space pre-check so a test can provoke a real ENOSPC in the middle of a write.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune import distributed as dist
from finetune.checkpoint.manifest import (
    MANIFEST,
    looks_like_checkpoint,
    verify,
    HashingWriter,
    build_manifest,
    hash_file,
    read_manifest,
    write_json_durably,
)
from finetune.checkpoint.state import TRAINER_STATE, TrainingState, rng_state, set_rng_state
from finetune.checkpoint.storage import STAGING, LocalStorage, find_checkpoint, fsync_path, step_of, tag_for
from finetune.config import ConfigError, RunConfig, zero_stage
from finetune.distributed import logger

FAIL_ENV = "FINETUNE_FAIL_SAVE"
SKIP_SPACE_CHECK_ENV = "FINETUNE_SKIP_SPACE_CHECK"
# Adam keeps fp32 master weights + two moments (12 B/param); the module states add a copy.
BYTES_PER_PARAM_ESTIMATE = 16
SPACE_MARGIN = 1.10


UNIVERSAL = "universal"


@dataclass
class ResumePlan:
    folder: Path
    saved: dict  # trainer_state.json
    universal: Path | None  # set when the world size changed


class SaveError(RuntimeError):
    """A save failed on at least one rank; every rank raises it, nothing was committed."""


def versions() -> dict:
    import deepspeed
    import transformers

    import finetune

    return {"finetune": finetune.__version__, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__}


class GuardedWriter:
    """Wraps DeepSpeed's checkpoint engine: durable, checksummed writes; failures recorded, not raised."""

    def __init__(self, inner):
        self.inner = inner
        self.reset(None)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reset(self, staging: Path | None, step: int | None = None) -> None:
        self.staging, self.step = staging, step
        self.error: str | None = None
        self.files: dict[str, tuple[int, str]] = {}

    def makedirs(self, path, exist_ok=False):
        try:
            os.makedirs(path, exist_ok=exist_ok)
        except OSError as e:
            self._fail(path, e)

    def save(self, state_dict, path) -> None:
        if self.error is not None:
            return
        w = None
        try:
            self._maybe_inject_failure()
            with open(path, "wb") as f:
                w = HashingWriter(f)
                torch.save(state_dict, w, _use_new_zipfile_serialization=getattr(self.inner, "zipfile_serialization", True))
                f.flush()
                os.fsync(f.fileno())
            self.files[os.path.relpath(path, self.staging)] = (w.size, w.digest())
        except Exception as e:  # noqa: BLE001 — any failure is reported to all ranks by the manager
            self._fail(path, w.os_error if w is not None and w.os_error else e)

    def guard(self, fn):
        """Wrap a DeepSpeed write helper so it records a failure instead of raising.

        DeepSpeed's rank-0-only ``_copy_recovery_script`` runs *before* the barrier that ends
        ``save_checkpoint``; had it raised on a full disk, rank 0 would skip that barrier and the
        ranks would fall out of step (seen here as a gloo collective mismatch).
        """
        def guarded(path, *args, **kwargs):
            try:
                return fn(path, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 — reported to all ranks by the manager
                self._fail(path, e)

        return guarded

    def _fail(self, path, e: BaseException) -> None:
        if self.error is None:
            self.error = f"{type(e).__name__} writing {path}: {getattr(e, 'strerror', None) or e}"

    def _maybe_inject_failure(self) -> None:
        spec = os.environ.get(FAIL_ENV)
        if not spec:
            return
        rank, _, step = spec.partition(":")
        if int(rank) == dist.rank() and (not step or int(step) == self.step):
            raise OSError(errno.EIO, f"injected I/O error ({FAIL_ENV}={spec})")


class CheckpointManager:
    def __init__(self, cfg: RunConfig, tokenizer, storage: LocalStorage | None = None):
        self.cfg, self.tokenizer, self.engine = cfg, tokenizer, None
        self.out = Path(cfg.ckpt.output_dir)
        self.storage = storage or LocalStorage(self.out)

    def attach(self, engine) -> None:
        """Take over the engine's checkpoint writes (call once, after deepspeed.initialize)."""
        self.engine = engine
        self.writer = GuardedWriter(engine.checkpoint_engine)
        engine.checkpoint_engine = self.writer
        if hasattr(engine, "_copy_recovery_script"):
            engine._copy_recovery_script = self.writer.guard(engine._copy_recovery_script)

    # --- save ------------------------------------------------------------------------------

    def save(self, state: TrainingState, final: bool) -> Path:
        """Save and commit a checkpoint of ``state``; raises SaveError on every rank if any failed."""
        tag, clock = tag_for(state.global_step), _Clock()
        self._check_space(tag)
        clock.lap("check")
        self._write(tag, state)
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

    def _write(self, tag: str, state: TrainingState) -> None:
        """Every rank: DeepSpeed's files, then our own. Failures are recorded in ``self.writer``."""
        staging_root = self.out / STAGING
        if dist.is_main():
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
        if self.cfg.ckpt.save_consolidated:
            self._write_consolidated(folder)
        self.writer.save(rng_state(), str(folder / f"rng_state_{dist.rank()}.pt"))
        if dist.is_main() and self.writer.error is None:
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
            if dist.is_main():
                self.storage.remove(f"{STAGING}/{tag}")
                self.storage.finish_staging()
            dist.barrier()  # nobody moves on while the staging folder is being removed
            raise SaveError(f"save of {tag} failed on {_describe(bad)}; latest is unchanged")
        files: dict[str, tuple[int, str]] = {}
        for _, rank_files in outcomes:
            files.update(rank_files)
        return files

    def _commit(self, tag: str, files: dict[str, tuple[int, str]]) -> None:
        error = None
        if dist.is_main():
            try:
                self._commit_rank0(tag, files)
            except OSError as e:
                error = f"{type(e).__name__}: {e}"
                self.storage.remove(f"{STAGING}/{tag}")
                self.storage.finish_staging()
        error = dist.all_gather_object(error)[0]  # collective: everyone learns rank 0's outcome
        if error:
            raise SaveError(f"commit of {tag} failed on rank 0: {error}; latest is unchanged")

    def _commit_rank0(self, tag: str, files: dict[str, tuple[int, str]]) -> None:
        commit_staged(self.storage, tag, files, dist.world_size(), versions())

    def _retain(self, newest: str) -> None:
        limit = self.cfg.ckpt.save_total_limit
        if limit and dist.is_main():
            complete = [t for t in self.storage.tags() if self.storage.exists(f"{t}/{MANIFEST}")]
            for tag in select_for_deletion(complete, limit, {newest, self.storage.read_latest()}):
                logger.info("save_total_limit %d: deleting %s", limit, tag)
                self.storage.remove(tag)
        dist.barrier()

    # --- resume ----------------------------------------------------------------------------

    def plan_resume(self) -> ResumePlan | None:
        """Pick (and verify) what to resume from, before the engine exists. Collective.

        A checkpoint from another world size is converted once to DeepSpeed's universal format
        (cached in ``<checkpoint>/universal``); the caller must then build the engine with
        ``checkpoint.load_universal``.
        """
        spec = self.cfg.ckpt.resume_from_checkpoint
        if spec is None:
            return None
        folder = self._resolve(spec)
        if folder is None:
            logger.info("--resume_from_checkpoint %s: no checkpoint in %s, starting fresh", spec, self.out)
            return None
        saved = json.loads((folder / TRAINER_STATE).read_text())
        self._check_compatible(saved)
        universal = None
        if saved["world_size"] != dist.world_size():
            universal = self._universal(folder)
            dist.log_main(logging.INFO, "Resuming a %d-rank checkpoint on %d ranks: loading DeepSpeed's universal "
                          "format from %s; the data order continues from global sample %d of epoch %d.",
                          saved["world_size"], dist.world_size(), universal, saved["sampler"]["consumed"],
                          saved["sampler"]["epoch"])
        return ResumePlan(folder, saved, universal)

    def _universal(self, folder: Path) -> Path:
        """Rank 0 converts with DeepSpeed's ds_to_universal (staged, then renamed); others wait."""
        target = folder / UNIVERSAL
        error = None
        if dist.is_main() and not target.is_dir():
            start = time.perf_counter()
            from finetune.checkpoint.export import to_universal

            failure = to_universal(folder, target)  # staged in universal.tmp, renamed into place on success
            if failure is None:
                logger.info("Converted %s to the universal format in %.1f seconds.", folder.name,
                            time.perf_counter() - start)
            else:
                error = [failure]
        error = dist.all_gather_object(error)[0]  # collective: everyone waits for rank 0's conversion
        if error:
            raise RuntimeError(f"DeepSpeed's ds_to_universal failed on {folder}: {error[0]}")
        return target

    def resume(self, trainer, plan: ResumePlan | None) -> bool:
        """Restore ``trainer`` from ``plan``; False when starting fresh."""
        if plan is None:
            return False
        start, folder = time.perf_counter(), plan.folder
        load_dir, tag = (str(folder), UNIVERSAL) if plan.universal else (str(folder.parent), folder.name)
        load_path, _ = self.engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {folder}")
        trainer.state = TrainingState.from_state_dict(plan.saved)
        trainer.data.sampler.load_state_dict(trainer.state.sampler)
        rng_file = folder / f"rng_state_{dist.rank()}.pt"
        if rng_file.exists():
            set_rng_state(torch.load(rng_file, weights_only=True))
        else:
            logger.warning("no RNG state for rank %d in %s (it had %d ranks); this rank keeps its seeded RNG",
                           dist.rank(), folder.name, plan.saved["world_size"])
        if dist.is_main():
            _truncate_metrics(self.out / "metrics.jsonl", trainer.state.global_step)
        dist.barrier()
        logger.info("Resumed from %s at step %d (epoch %.2f) in %.2f seconds.", folder, trainer.state.global_step,
                    trainer.state.epoch, time.perf_counter() - start)
        return True

    def _resolve(self, spec: str) -> Path | None:
        """The folder to resume from: verified (collectively), falling back past damaged ones.

        Rank 0 alone looks at the filesystem and sends every rank the same candidate list: ranks
        that listed for themselves could disagree (node-local storage, a concurrent delete) and
        then run different numbers of the verification collective below.
        """
        candidates, error = dist.all_gather_object(self._candidates(spec) if dist.is_main() else None)[0]
        if error:
            raise ConfigError(error)
        for folder in map(Path, candidates):
            problems = self._verify_collectively(folder)
            if not problems:
                return folder
            if spec not in ("latest", "auto"):
                raise ConfigError(f"--resume_from_checkpoint: {folder} does not verify: {'; '.join(problems[:3])}")
            dist.log_main(logging.WARNING, "not resuming from %s: %s; trying an older checkpoint",
                          folder.name, "; ".join(problems[:3]))
        if spec == "latest":
            raise ConfigError(f"--resume_from_checkpoint latest: no complete checkpoint in {self.out}")
        return None

    def _candidates(self, spec: str) -> tuple[list[str], str | None]:
        """Rank 0: folders to try, best first, or an error message for every rank to raise."""
        if spec in ("latest", "auto"):
            tags = resume_candidates(self.storage.read_latest(), self.storage.tags())
            return [str(self.out / t) for t in tags], None
        path = find_checkpoint(spec)
        if path is None or not looks_like_checkpoint(path):
            return [], f"--resume_from_checkpoint: no checkpoint at {spec}"
        return [str(path)], None

    def _verify_collectively(self, folder: Path) -> list[str]:
        """Every rank checks a share of the rank files (rank 0 also the shared ones). Collective."""
        manifest = read_manifest(folder)
        if manifest is None:
            problems = [f"{MANIFEST} missing or unreadable (an incomplete save?)"]
        else:
            mine = list(range(dist.rank(), int(manifest.get("world_size", 1)), dist.world_size()))
            problems = verify(folder, checksums=not self.cfg.ckpt.resume_skip_checksum, ranks=mine,
                              shared=dist.is_main()).problems
        return [p for rank_problems in dist.all_gather_object(problems) for p in rank_problems]

    def _check_compatible(self, saved: dict) -> None:
        for group, now in self.cfg.to_json_dict().items():
            for key, value in now.items():
                before = saved.get("args", {}).get(group, {}).get(key, value)
                if before != value and key not in IGNORED_ON_RESUME:
                    dist.log_main(logging.WARNING, "resume: --%s is %r now, was %r in the checkpoint", key, value, before)


def commit_staged(storage: LocalStorage, tag: str, files: dict[str, tuple[int, str]], world_size: int,
                  versions: dict) -> None:
    """Rank 0's commit of ``.staging/<tag>``. Each step is atomic; a crash between any two leaves
    ``latest`` naming a complete checkpoint (the old one, or the new one once it is in place).

    The manifest is written *inside* the staged folder before the rename, so the folder never
    appears under its final name without the file that marks it complete.
    """
    staged = storage.root / STAGING / tag
    write_json_durably(staged / MANIFEST, build_manifest(tag, files, world_size, versions))
    fsync_path(staged)
    # Never overwrite in place: a folder of the same step (an abandoned timeline's) is swapped out.
    storage.replace_dir(f"{STAGING}/{tag}", tag)
    storage.write_latest(tag)
    storage.finish_staging()


IGNORED_ON_RESUME = {"resume_from_checkpoint", "output_dir", "max_steps", "num_train_epochs", "save_steps",
                     "save_total_limit", "logging_steps", "eval_steps", "on_save_error", "save_checkpoint",
                     "resume_skip_checksum"}


def resume_candidates(latest: str | None, tags: list[str]) -> list[str]:
    """Tags to try, best first: the one `latest` names, then the others newest first."""
    ordered = sorted(tags, key=step_of, reverse=True)
    if latest in ordered:
        ordered.remove(latest)
        ordered.insert(0, latest)
    return ordered


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


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop rows logged after the resumed step (a crashed run's tail), so the file reads as one run."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(r + "\n" for r in rows))
    os.replace(tmp, path)
