"""Which ranks share which OUT, and the start-of-run tidy-up of each storage.

Shared storage: one group, rank 0 leads (checked with one marker when saving). Node-local
(DeepSpeed's ``checkpoint.use_node_local_storage``): one group per set of ranks that see the same
folder, found with marker files; each group's first rank leads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from finetune import distributed as dist
from finetune.checkpoint.outdir import OutputDir
from finetune.config import ConfigError
from finetune.distributed import logger
from finetune.io.faults import fault_point
from finetune.sharing import leads_storage, sharing_groups


def node_local(ds_config: dict) -> bool:
    return bool((ds_config.get("checkpoint") or {}).get("use_node_local_storage", False))


@dataclass
class Layout:
    """Which ranks share which OUT: one group on shared storage, one per node on
    node-local disks."""

    groups: list[list[int]]
    node_local: bool

    @classmethod
    def discover(cls, out: OutputDir, ds_config: dict, saving: bool = True) -> Layout:
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
        return len(self.my_group) / max(dist.world_size(), 1)


def tidy_storage(storage: OutputDir, layout: Layout) -> None:
    """At start, each storage's leader removes what crashed saves left (staging, trash, temp
    files) and logs it. Collective. Only safe while this run holds OUT's lease."""

    def tidy():
        fault_point("layout.tidy")
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
