"""A save's steps that each storage's leader does alone, around the staging folder and OUT's lease,
each agreed (``dist.gather_outcomes``, polled with ``--ddp_timeout`` as deadline) so that its
outcome is every rank's: the free-space check, clearing a crashed save's staging, removing a
failed one's, reading back whether a publish happened, re-reading the lease. Collective, all.

Who leads (``Layout``): on shared storage one group, rank 0 leads (checked with one marker when
saving). Node-local (DeepSpeed's ``checkpoint.use_node_local_storage``): one group per set of ranks
that see the same folder, found with marker files; each group's first rank leads. ``tidy_storage``
is each leader's start-of-run tidy-up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from finetune import distributed as dist
from finetune.checkpoint.contents import CONSOLIDATED_PATTERNS, describe, fmt_bytes, space_report
from finetune.checkpoint_format.outdir import STAGING, Deleter, OutputDir, step_of
from finetune.config import ConfigError
from finetune.distributed import logger
from finetune.io import seams
from finetune.io.faults import fault_point
from finetune.lease import LeaseLost
from finetune.sharing import leads_storage, sharing_groups


class SaveError(RuntimeError):
    """A save failed on at least one rank; every rank raises it, nothing was committed."""


class Staging:
    """A save's steps around its staging folder and OUT's lease, each done by the storage's
    leader alone and agreed."""

    def __init__(
        self,
        storage: OutputDir,
        leader: bool,
        deleter: Deleter,
        space_needed: Callable[[], int],
        still_ours: Callable[[], bool],
    ):
        """``space_needed``: what a save needs on this storage; ``still_ours``: whether this run
        still holds OUT's lease (rank 0 asks it)."""
        self.storage = storage
        self.leader = leader
        self.deleter = deleter  # retention's purges: what they free counts as free space
        self.space_needed = space_needed
        self.still_ours = still_ours

    def ensure_lease(self, before: str, step: int | None) -> None:
        """Right before a commit, a publish, retention or a cleanup: rank 0 re-reads OUT's lease
        (``still_ours``). LeaseLost on every rank if another run holds it; SaveError on every rank
        if it could not be read (nothing is done then either). Polled. Collective."""

        def check() -> bool:
            fault_point("lease.check", step)
            return self.still_ours()

        out = dist.gather_outcomes(
            check,
            on=dist.is_main(),
            share=True,
            step="checking the output dir's lease",
            deadline_s=dist.io_deadline(),
        )
        if not out.ok:
            raise SaveError(
                f"could not check {self.storage.root}'s lease before {before} "
                f"({out.describe()}); not {before}"
            )
        if out.results[0] is False:
            raise LeaseLost(f"another run took over {self.storage.root}'s lease; not {before}")

    def ensure_lease_or_drop(self, before: str, tag: str) -> None:
        """``ensure_lease``; when the lease cannot be read, the save's staging goes too."""
        try:
            self.ensure_lease(before, step_of(tag))
        except SaveError as e:
            raise SaveError(f"{e}{self.drop(tag)}") from e

    def drop_consolidated(self, tag: str, error: str) -> None:
        """The consolidated write failed on some rank: leaders remove its partial safetensors
        (left unlisted when that fails: the checkpoint is complete without them)."""
        out = dist.gather_outcomes(
            lambda: self.storage.remove_matching(f"{STAGING}/{tag}", CONSOLIDATED_PATTERNS),
            on=self.leader,
            step=f"removing {tag}'s partial safetensors",
            deadline_s=dist.io_deadline(),
        )
        if not out.ok:
            dist.log_main(
                logging.WARNING, "could not remove partial safetensors files: %s", out.describe()
            )
        dist.log_main(
            logging.WARNING,
            "consolidated weights of %s not written (%s); committing the partitioned "
            "checkpoint without them: `finetune export` can rebuild them from it",
            tag,
            error,
        )

    def check_space(self, tag: str) -> None:
        """Leaders: enough free space for this storage's share? Agreed; SaveError on
        every rank if not."""
        need = self.space_needed()

        def problem() -> str | None:
            fault_point("save.check_space", step_of(tag))
            if seams.enabled(seams.SKIP_SPACE_CHECK):
                return None  # lets tests hit a real ENOSPC mid-write
            free = self.storage.free_bytes()
            if free < need <= free + self.deleter.pending_bytes:
                # retention is still deleting older checkpoints: what it frees counts
                self.deleter.drain()
                free = self.storage.free_bytes()
            return None if free >= need else f"{fmt_bytes(free)} free, need ~{fmt_bytes(need)}"

        out = dist.gather_outcomes(
            problem,
            on=self.leader,
            share=True,
            step=f"checking free space for {tag}",
            deadline_s=dist.io_deadline(),
        )
        bad = {r: p for r, p in enumerate(out.results) if p}
        bad.update(out.errors)
        if bad:
            raise SaveError(
                f"not saving {tag}: not enough free space in {self.storage.root} ({describe(bad)})"
            )

    def clear(self, tag: str) -> None:
        """Leaders remove what a crashed save of the same step left in staging, before DeepSpeed's
        collective write. Polled; SaveError on every rank if it failed. Collective."""

        def clear() -> None:
            fault_point("save.clear_staging", step_of(tag))
            self.storage.remove(f"{STAGING}/{tag}")

        out = dist.gather_outcomes(
            clear, on=self.leader, step=f"clearing {STAGING}/{tag}", deadline_s=dist.io_deadline()
        )
        if not out.ok:
            raise SaveError(f"save of {tag} failed on {out.describe()}; latest is unchanged")

    def drop(self, tag: str, written: bool = False) -> str:
        """Leaders remove a failed save's staging (polled: it can be large). Collective. Returns
        what that freed, the free space left and what a save needs, for the error line ("" when
        the removal failed: it is logged here). ``written``: every file of the save was written
        (only its publishing failed), so DeepSpeed's recovery scripts are whole and kept."""
        try:
            self.ensure_lease(f"removing {STAGING}/{tag}", step_of(tag))
        except SaveError as e:  # left for the next start to tidy
            dist.log_main(logging.WARNING, "%s", e)
            return ""

        def remove() -> tuple[int, int | None]:
            fault_point("save.drop_staging", step_of(tag))
            freed = self.storage.remove(f"{STAGING}/{tag}") or 0
            freed += self.storage.finish_staging(saved=written) or 0
            try:
                free = self.storage.free_bytes()
            except OSError:
                free = None  # the folder is gone all the same: report what is known
            return freed, free

        out = dist.gather_outcomes(
            remove,
            on=self.leader,
            share=True,
            step=f"removing {STAGING}/{tag}",
            deadline_s=dist.io_deadline(),
        )
        if not out.ok:
            dist.log_main(
                logging.WARNING,
                "could not remove %s/%s (%s); it is removed at the next start",
                STAGING,
                tag,
                out.describe(),
            )
            return ""
        freed = {r: v for r, v in enumerate(out.results) if v is not None}
        return f"; {space_report(freed, self.space_needed())}" if freed else ""

    def in_place(self, tag: str, save_id: str) -> bool:
        """Whether every storage holds this save under its name: after a failed publish, that only
        ``latest`` failed. Leaders read their manifest; agreed. Collective."""
        out = dist.gather_outcomes(
            lambda: (self.storage.read_manifest(tag) or {}).get("save_id") == save_id,
            on=self.leader,
            share=True,
            step=f"reading {tag}'s manifest",
            deadline_s=dist.io_deadline(),
        )
        placed = [v for v in out.results if v is not None]
        return out.ok and bool(placed) and all(placed)


# -------------------- who leads which storage, and the start-of-run tidy-up --------------------


def node_local(ds_config: dict[str, object]) -> bool:
    """Whether DeepSpeed's ``checkpoint.use_node_local_storage`` is on."""
    return bool((ds_config.get("checkpoint") or {}).get("use_node_local_storage", False))


@dataclass
class Layout:
    """Which ranks share which OUT: one group on shared storage, one per node on
    node-local disks."""

    groups: list[list[int]]
    node_local: bool

    @classmethod
    def discover(cls, out: OutputDir, ds_config: dict[str, object], saving: bool = True) -> Layout:
        """Collective. Node-local: found out with marker files, not guessed from host names. Shared
        (the default) and saving: checked with one marker, since rank 0 alone writes the manifest
        of every rank's files: an OUT that is in fact local to each node would give checkpoints
        that verify nowhere."""
        local = node_local(ds_config)
        if local:
            groups = sharing_groups(out.storage, "output_dir")
            return cls(groups, local)
        if saving and dist.world_size() > 1:
            apart = dist.any_rank(leads_storage(out.storage, "output_dir") and not dist.is_main())
            if apart:
                raise ConfigError(
                    f"--output_dir {out.root} is not the same folder on every rank (some ranks "
                    "cannot see rank 0's files): use storage all ranks share, or node-local "
                    "checkpoints (--deepspeed_config configs/ds_zero3_node_local.json)"
                )
        return cls([list(range(dist.world_size()))], local)

    @property
    def my_group(self) -> list[int]:
        return next(g for g in self.groups if dist.rank() in g)

    @property
    def leader(self) -> bool:
        """Whether this rank does rank 0's part for its OUT (rank 0, or each node's first rank)."""
        return dist.rank() == self.my_group[0]

    @property
    def share(self) -> float:
        """This storage's share of a save: its ranks' fraction of the world."""
        return len(self.my_group) / max(dist.world_size(), 1)


def tidy_storage(storage: OutputDir, layout: Layout) -> None:
    """At start, each storage's leader removes what crashed saves left (staging, trash, temp
    files) and logs it. Collective. Only safe while this run holds OUT's lease."""

    def tidy() -> list[tuple[str, int]]:
        fault_point("staging.tidy")
        return storage.housekeeping()

    out = dist.gather_outcomes(
        tidy,
        on=layout.leader,
        step="removing crashed saves' leftovers",
        deadline_s=dist.io_deadline(),
    )
    if out.result:
        freed = sum(size for _, size in out.result)
        logger.warning(
            "removed %d leftover(s) of crashed saves from %s, %.1f MB freed: %s",
            len(out.result),
            storage.root,
            freed / 1e6,
            ", ".join(rel for rel, _ in out.result),
        )
    if not out.ok:
        dist.log_main(
            logging.WARNING,
            "could not tidy leftovers of crashed saves (%s); continuing",
            out.describe(),
        )
