"""Resume: pick a checkpoint (verified, with fallback), convert it for another world size, load it.

Every decision that leads to a collective is made from facts all ranks share: rank 0 lists the
filesystem and sends the same candidates to every rank; verification splits the files between ranks
and all-gathers the problems found.
"""

from __future__ import annotations

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
    read_manifest,
    verify,
)
from finetune.checkpoint.state import TRAINER_STATE, TrainingState, set_rng_state
from finetune.checkpoint.storage import LocalStorage, find_checkpoint, step_of
from finetune.config import ConfigError, RunConfig
from finetune.distributed import logger

UNIVERSAL = "universal"


@dataclass
class ResumePlan:
    folder: Path
    saved: dict  # trainer_state.json
    universal: Path | None  # set when the world size changed


class Resumer:
    def __init__(self, cfg: RunConfig, storage: LocalStorage, node_local: bool = False, leader: bool | None = None):
        """``node_local``: each node has its own OUT; ``leader``: this rank does rank 0's part for
        its OUT (rank 0, or each node's first rank; default rank 0)."""
        self.cfg, self.storage, self.out = cfg, storage, storage.root
        self.node_local = node_local
        self.leader = dist.is_main() if leader is None else leader

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
            if self.node_local:
                raise ConfigError(f"--resume_from_checkpoint: {folder} was saved by {saved['world_size']} ranks on "
                                  "node-local storage; resuming it on another world size needs every node's files in "
                                  "one folder (copy them together, then resume from that folder on shared storage)")
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

    def resume(self, engine, trainer, plan: ResumePlan | None) -> bool:
        """Restore ``trainer`` from ``plan``; False when starting fresh."""
        if plan is None:
            return False
        start, folder = time.perf_counter(), plan.folder
        load_dir, tag = (str(folder), UNIVERSAL) if plan.universal else (str(folder.parent), folder.name)
        load_path, _ = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True,
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
        if dist.is_main():  # metrics.jsonl is rank 0's, whatever the storage
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
        candidates, error = self._agreed_candidates(spec)
        if error:
            raise ConfigError(error)
        for folder in candidates:
            problems = self._verify_collectively(folder)
            if not problems:
                return folder
            if spec not in ("latest", "auto"):
                raise ConfigError(f"--resume_from_checkpoint: {folder} does not verify: {'; '.join(problems[:3])}")
            dist.log_main(logging.WARNING, "not resuming from %s: %s; trying an older checkpoint",
                          folder.name, "; ".join(problems[:3]))
        if spec == "latest":
            raise ConfigError(f"--resume_from_checkpoint latest: no complete checkpoint in {self.out}")
        if self.node_local and candidates:
            # Node-local: failing everywhere usually means ranks now sit on other nodes (or in
            # another order) than when they saved; starting fresh would silently redo the work.
            raise ConfigError(f"--resume_from_checkpoint {spec}: no checkpoint verifies on every node; were the "
                              "ranks placed on other nodes than when they were saved? Start the job on the same "
                              "nodes, in the same order")
        return None

    def _agreed_candidates(self, spec: str) -> tuple[list[Path], str | None]:
        """Folders to try, best first, the same on every rank (or an error for all to raise). Collective.

        latest/auto: tags from rank 0's listing, or with node-local storage the tags every node
        has (each rank then looks in its own OUT); a PATH: the same folder on every rank.
        """
        if not self.node_local or spec not in ("latest", "auto"):
            kind, items, error = dist.all_gather_object(self._candidates(spec) if dist.is_main() else None)[0]
        else:
            listings = [x for x in dist.all_gather_object(
                (self.storage.read_latest(), self.storage.tags()) if self.leader else None) if x is not None]
            common = set(listings[0][1]).intersection(*(set(tags) for _, tags in listings[1:]))
            kind, items, error = "tags", resume_candidates(listings[0][0], sorted(common)), None
            if not common and any(tags for _, tags in listings):
                # Starting fresh here would silently redo the work; the rank→node mapping changed.
                error = (f"--resume_from_checkpoint {spec}: the nodes hold no checkpoint in common "
                         f"({', '.join(str(len(t)) for _, t in listings)} per node): were the ranks placed on "
                         "other nodes than when they were saved? Start the job on the same nodes, in the same order")
        return [self.out / i if kind == "tags" else Path(i) for i in items], error

    def _candidates(self, spec: str) -> tuple[str, list[str], str | None]:
        """Rank 0: ("tags" or "paths", what to try best first, an error message for every rank to raise)."""
        if spec in ("latest", "auto"):
            return "tags", resume_candidates(self.storage.read_latest(), self.storage.tags()), None
        path = find_checkpoint(spec)
        if path is None or not looks_like_checkpoint(path):
            return "paths", [], f"--resume_from_checkpoint: no checkpoint at {spec}"
        return "paths", [str(path)], None

    def _verify_collectively(self, folder: Path) -> list[str]:
        """Every rank checks a share of the rank files (rank 0 also the shared ones). Collective."""
        manifest = read_manifest(folder)
        if manifest is None:
            problems = [f"{MANIFEST} missing or unreadable (an incomplete save?) on rank {dist.rank()}"]
        else:
            # Node-local: each rank its own files on its node, each leader its node's shared files.
            mine = [dist.rank()] if self.node_local else \
                list(range(dist.rank(), int(manifest.get("world_size", 1)), dist.world_size()))
            problems = verify(folder, checksums=not self.cfg.ckpt.resume_skip_checksum, ranks=mine,
                              shared=self.leader).problems
        return [p for rank_problems in dist.all_gather_object(problems) for p in rank_problems]

    def _check_compatible(self, saved: dict) -> None:
        for group, now in self.cfg.to_json_dict().items():
            for key, value in now.items():
                before = saved.get("args", {}).get(group, {}).get(key, value)
                if before != value and key not in IGNORED_ON_RESUME:
                    dist.log_main(logging.WARNING, "resume: --%s is %r now, was %r in the checkpoint", key, value, before)


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


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop rows logged after the resumed step (a crashed run's tail), so the file reads as one run."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(r + "\n" for r in rows))
    os.replace(tmp, path)
