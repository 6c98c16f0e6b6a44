"""Resume planning: pick a checkpoint (commit order, verified, with fallback), set aside the
timeline it abandons, convert it for another world size. Runs before the engine exists; the
Checkpointer's ``load`` then restores from the plan.

With a bucket (a ``Source``: --remote_output_dir, or an s3:// --resume_from_checkpoint), its
commits join the candidates in the one commit order, and a commit the bucket holds is never passed
over for an older one: where it does not verify on some rank (missing, damaged, another save), the
OUTs of those ranks fetch it, their copy set aside, and the plan resumes from it.

Every decision that leads to a collective is made from facts all ranks share: rank 0 (or, on
node-local storage, every node's leader) reads the filesystem and every rank receives the same
candidates; verification splits the files between ranks and all-gathers the problems found; a
failure on any rank reaches all of them (``dist.gather_outcomes``).

Another world size or --sequence_parallel_size than the save's: another_layout.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from finetune import distributed as dist
from finetune.checkpoint.another_layout import convert_for_this_world, say_layout_change
from finetune.checkpoint.compatible import check_compatible
from finetune.checkpoint_format.manifest import (
    MANIFEST,
    looks_like_checkpoint,
    read_manifest,
    verify,
)
from finetune.checkpoint_format.outdir import OutputDir, committed, find_checkpoint, step_of
from finetune.checkpoint_format.policy import Committed, newer_than, passed_over, resume_order
from finetune.checkpoint_format.state import TRAINER_STATE
from finetune.config import ConfigError, RunConfig
from finetune.distributed import logger
from finetune.io.faults import fault_point
from finetune.modeling import check_checkpoint_model
from finetune.weights import safe_load


class Source(Protocol):
    """Where a resume may take a commit that OUT lacks or holds damaged: the bucket of
    --remote_output_dir, or of an s3:// --resume_from_checkpoint (remote/fetch.py's
    ``BucketSource``)."""

    def commits(self) -> list[Committed]:
        """The commits it offers, the same on every rank."""

    def fetch(self, commit: Committed, need: bool) -> None:
        """Bring ``commit`` into this rank's OUT where ``need`` (the same on the ranks sharing
        it), the copy there set aside first; ConfigError or RankError on every rank when it
        fails. Collective."""

    def left_behind(self) -> set[str]:
        """The save ids of the commits it set aside (a rollback's), the same on every rank."""


@dataclass
class ResumePlan:
    """What to resume from, chosen before the engine exists (the Checkpointer's ``load``)."""

    folder: Path
    saved: dict[str, Any]  # trainer_state.json
    universal: Path | None  # set when the world size changed
    # the resumed-from checkpoint in OUT's commit order (None: outside OUT)
    head: Committed | None = None
    # the highest commit number seen, set-aside ones included: later commits go above it
    max_seq: int = 0


class Resumer:
    """Plans a run's resume (``plan_resume``); collective, before the engine exists."""

    def __init__(
        self,
        cfg: RunConfig,
        storage: OutputDir,
        node_local: bool = False,
        leader: bool | None = None,
        base: dict[str, Any] | None = None,
        reference: dict[str, Any] | None = None,
        signalled: Callable[[], bool] = lambda: False,
        group: list[int] | None = None,
        source: Source | None = None,
    ):
        """``node_local``: each node has its own OUT; ``leader``: this rank does rank 0's part for
        its OUT (rank 0, or each node's first rank; default rank 0); ``base``: with --use_peft, the
        base model's identity (lora.base_identity), the same on every rank; ``reference``: a
        preference objective's reference (reference.record); ``signalled``: whether
        this rank got a preemption signal (stops a universal conversion); ``source``: the bucket
        a commit missing or damaged in OUT is fetched from."""
        self.cfg = cfg
        self.storage = storage
        self.out = storage.root
        self.base, self.reference = base, reference
        self.signalled = signalled
        self.node_local = node_local
        self.leader = dist.is_main() if leader is None else leader
        # the ranks sharing this rank's OUT (node-local: its node's)
        self.group = group or list(range(dist.world_size()))
        self.source = source
        self.saved_worlds: dict[str, int | None] = {}  # node-local: each candidate's world size
        # the committed candidates: their save ids and places in the commit order (rank 0's)
        self.local: dict[str, Committed] = {}

    def plan_resume(self) -> ResumePlan | None:
        """Pick (and verify) what to resume from, before the engine exists. Collective.

        A checkpoint from another world size is converted once to DeepSpeed's universal format
        (cached in ``<checkpoint>/universal`` with its own manifest); the caller must then build
        the engine with ``checkpoint.load_universal``.
        """
        spec = self.cfg.ckpt.resume_from_checkpoint
        folder = self._resolve(spec) if spec is not None else None
        if folder is None:
            self._set_aside_other_timelines()
            return None

        def read_state() -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
            fault_point("resume.read_state")
            manifest = read_manifest(folder)
            # Only its identity travels to every rank: the file list is O(world size) entries.
            identity = (
                {k: manifest[k] for k in Committed.MANIFEST_KEYS if k in manifest}
                if manifest
                else None
            )
            return (
                json.loads((folder / TRAINER_STATE).read_text()),
                identity,
                folder.parent.resolve() == self.out.resolve(),
            )

        saved, manifest, in_out = dist.share_from(
            0,
            read_state,
            step=f"reading {folder.name}'s trainer state",
            deadline_s=dist.io_deadline(),
        )
        # From facts every rank shares (the saved state, the base's and the reference's
        # identities): raises alike everywhere, before anything is set aside.
        check_compatible(folder, saved, self.cfg, self.base, self.reference)
        # Before anything is set aside or built: another architecture or vocabulary is bad input.
        dist.run_agreed(lambda: check_checkpoint_model(folder, self.cfg.model), on=dist.is_main())
        head = None
        max_seq = 0
        if in_out:
            head = Committed.from_manifest(folder.name, manifest or {})
            max_seq = self._set_aside_newer(head)
        else:
            self._set_aside_other_timelines()
        universal = None
        if saved["world_size"] != dist.world_size():
            # (node-local: every node holds the whole checkpoint, _refuse_another_world checked)
            universal = convert_for_this_world(
                folder,
                manifest or {},
                checksums=not self.cfg.ckpt.resume_skip_checksum,
                leader=self.leader,
                signalled=self.signalled,
            )
        say_layout_change(saved, universal)
        return ResumePlan(folder, saved, universal, head, max_seq)

    # --- choosing ------------------------------------------------------------------------------

    def _resolve(self, spec: str) -> Path | None:
        """The folder to resume from: verified (collectively), falling back past damaged ones; a
        commit the bucket offers (``source``) is fetched into every OUT that lacks it or holds it
        damaged, and taken, rather than passed over."""
        candidates = self._with_bucket(spec)
        tried: list[tuple[Path, list[str]]] = []
        for folder, offered in candidates:
            if self.node_local and offered is None:
                # Before verifying it: a rank the checkpoint has no files for would fail every
                # candidate (and --ignore_unverified_checkpoints set healthy ones aside).
                self._refuse_another_world(folder)
            problems, bad = self._verify_collectively(folder, offered)
            if not problems or (offered is not None and self._fetched(folder, offered, bad, spec)):
                if tried:
                    dist.log_main(
                        logging.WARNING,
                        "resuming from %s, an older checkpoint than %s",
                        folder.name,
                        ", ".join(f.name for f, _ in tried),
                    )
                return folder
            if spec not in ("latest", "auto"):
                raise ConfigError(
                    f"--resume_from_checkpoint: {folder} does not verify: {'; '.join(problems[:3])}"
                )
            dist.log_main(
                logging.WARNING,
                "not resuming from %s: %s; trying an older checkpoint",
                folder.name,
                "; ".join(problems[:3]),
            )
            tried.append((folder, problems))
        if not candidates:
            if spec == "latest":
                raise ConfigError(
                    f"--resume_from_checkpoint latest: no complete checkpoint in {self.out}"
                )
            logger.info(
                "--resume_from_checkpoint %s: no checkpoint in %s, starting fresh", spec, self.out
            )
            return None
        return self._none_verifies(spec, tried)

    def _fetched(self, folder: Path, commit: Committed, bad: set[int], spec: str) -> bool:
        """Whether ``commit``, missing or damaged on the ranks ``bad``, is now in every OUT, fetched
        from the bucket where those ranks' OUT needed it, and checked there. A fetch that fails
        stops an explicit resume and passes ``auto`` on to an older checkpoint. Collective."""
        dist.log_main(
            logging.WARNING,
            "%s does not verify in %s on rank %s: fetching it from the bucket",
            folder.name,
            self.out,
            ", ".join(map(str, sorted(bad))),
        )
        try:
            self.source.fetch(commit, need=any(r in bad for r in self.group))
        except (ConfigError, dist.RankError) as e:
            if spec not in ("latest", "auto"):
                raise
            dist.log_main(logging.WARNING, "fetching %s failed (%s)", folder.name, e)
            return False
        # Every file was checked against the manifest's checksum as it came down: the rest of the
        # verification (sizes, what DeepSpeed's unpickling would refuse) is read once more.
        problems, _ = self._verify_collectively(folder, commit, checksums=False)
        if problems and spec not in ("latest", "auto"):
            raise ConfigError(
                f"--resume_from_checkpoint: {folder} does not verify once fetched: "
                f"{'; '.join(problems[:3])}"
            )
        return not problems

    def _none_verifies(self, spec: str, tried: list[tuple[Path, list[str]]]) -> None:
        """No candidate verifies: --ignore_unverified_checkpoints sets them aside and starts fresh
        (None); otherwise a ConfigError naming them. Collective."""
        if self.node_local:
            # Failing everywhere usually means ranks now sit on other nodes (or in another order)
            # than when they saved; starting fresh would silently redo the work.
            hint = (
                "no checkpoint verifies on every node; were the ranks placed on other nodes than "
                "when they were saved? Start the job on the same nodes, in the same order"
            )
        else:
            hint = "no checkpoint verifies"
        details = "; ".join(f"{f.name}: {p[0]}" for f, p in tried)
        if spec == "auto" and self.cfg.ckpt.ignore_unverified_checkpoints:
            for folder, _ in tried:
                self._set_aside([folder.name], "unverified", "does not verify")
            dist.log_main(
                logging.WARNING,
                "--ignore_unverified_checkpoints: %s (%s); set them aside and starting fresh",
                hint,
                details,
            )
            return None
        raise ConfigError(
            f"--resume_from_checkpoint {spec}: {hint} in {self.out} ({details}); nothing was "
            "changed. Pass --ignore_unverified_checkpoints to start fresh anyway (they are set "
            "aside under .abandoned, not deleted)"
        )

    def _agreed_candidates(self, spec: str) -> list[Path]:
        """Folders to try, best first, the same on every rank. Collective.

        latest/auto: committed checkpoints newest commit first (policy.resume_order), from rank
        0's listing; with node-local storage, the tags that every node holds *with the same save
        id* (each rank then looks in its own OUT); a PATH: the same folder on every rank.
        """
        if spec not in ("latest", "auto"):

            def explicit() -> str:
                path = find_checkpoint(spec)
                if path is None or not looks_like_checkpoint(path):
                    raise ConfigError(f"--resume_from_checkpoint: no checkpoint at {spec}")
                return str(path)

            return [
                Path(
                    dist.share_from(
                        0, explicit, step="finding the checkpoint", deadline_s=dist.io_deadline()
                    )
                )
            ]

        def listing() -> tuple[list[str], dict[str, Committed]]:
            fault_point("resume.list")
            found = committed(self.storage)
            return resume_order(self.storage.tags(), found), {c.tag: c for c in found}

        if not self.node_local:
            order, self.local = dist.share_from(
                0, listing, step="listing checkpoints", deadline_s=dist.io_deadline()
            )
            return [self.out / t for t in order]

        def node_listing() -> tuple[list[str], dict[str, str | None], dict[str, Committed]]:
            order, found = listing()
            return order, {t: c.save_id for t, c in found.items()}, found

        out = dist.gather_outcomes(
            node_listing,
            on=self.leader,
            share=True,
            step="listing checkpoints",
            deadline_s=dist.io_deadline(),
        )
        out.raise_any()
        views = [v[:2] for v in out.results if v is not None]
        self.local = next(v[2] for v in out.results if v is not None)
        self.saved_worlds = {t: c.world_size for t, c in self.local.items()}
        common = [
            t
            for t in views[0][0]
            if all(t in ids and ids[t] == views[0][1].get(t) for _, ids in views[1:])
            and all(t in order for order, _ in views[1:])
        ]
        offered = self.source is not None and self.source.commits()
        if not common and any(order for order, _ in views) and not offered:
            raise ConfigError(
                f"--resume_from_checkpoint {spec}: the nodes hold no checkpoint in common "
                f"({', '.join(str(len(o)) for o, _ in views)} per node, compared by save id): "
                "were the ranks placed on other nodes than when they were saved? Start the job "
                "on the same nodes, in the same order"
            )
        return [self.out / t for t in common]

    def _with_bucket(self, spec: str) -> list[tuple[Path, Committed | None]]:
        """The candidates (``_agreed_candidates``), each with the bucket's commit of it when the
        bucket offers that very save, and the bucket's other commits among them in the one commit
        order (a prefix holds one lineage): best first, the same on every rank. Collective."""
        offered = self.source.commits() if self.source is not None else []
        named = Path(spec)
        mine = [c for c in offered if c.tag == named.name and named.parent == self.out]
        if spec not in ("latest", "auto") and mine:
            # an s3:// checkpoint: fetched into OUT where no copy of it there verifies
            return [(named, mine[0])]
        local = self._agreed_candidates(spec)
        if not offered:
            return [(f, None) for f in local]
        bucket = {(c.tag, c.save_id): c for c in offered}
        # OUT's commits the bucket went on without (another disk's run resumed from before them)
        left = passed_over(list(self.local.values()), offered, self.source.left_behind())
        readable = [f for f in local if f.name in self.local and f.name not in left]
        ranked = [
            (
                self.local[f.name].order_key,
                f,
                bucket.pop((f.name, self.local[f.name].save_id), None),
            )
            for f in readable
        ]
        ranked += [(c.order_key, self.out / c.tag, c) for c in bucket.values()]
        ranked.sort(key=lambda r: r[0], reverse=True)
        taken = {f.name for _, f, _ in ranked}
        # then the folders whose manifest does not read
        rest = [f for f in local if f.name not in taken and f.name not in left]
        return [(f, c) for _, f, c in ranked] + [(f, None) for f in rest]

    def _refuse_another_world(self, folder: Path) -> None:
        """Node-local checkpoints resume only on the world size that saved them: ConfigError (exit
        2, nothing touched) naming both, from the manifests the leaders listed
        (alike everywhere)."""
        saved = self.saved_worlds.get(folder.name)
        if folder.name not in self.saved_worlds:  # an explicit PATH: rank 0's manifest says
            saved = dist.share_from(
                0,
                lambda: (read_manifest(folder) or {}).get("world_size"),
                step=f"reading {folder.name}'s manifest",
                deadline_s=dist.io_deadline(),
            )
        if saved is None or saved == dist.world_size():
            return

        def whole() -> bool:  # every rank's files here (a copy fetched whole from a bucket)
            manifest = read_manifest(folder) or {}
            return "ranks" not in manifest and manifest.get("world_size") == saved

        # each node's leader looks at its own copy: every node must hold the whole checkpoint
        if dist.any_rank(self.leader and not whole()):
            raise ConfigError(_node_local_world(folder, saved))

    def _verify_collectively(
        self, folder: Path, commit: Committed | None = None, checksums: bool | None = None
    ) -> tuple[list[str], set[int]]:
        """Every rank checks a share of the rank files (rank 0 also the shared ones): the problems
        found, and the ranks that found them, the same on every rank. ``commit``: the copy must be
        of that save. Collective. Any error while checking (EIO, ESTALE, …) is a problem found,
        reported by every rank."""
        if checksums is None:
            checksums = not self.cfg.ckpt.resume_skip_checksum

        def mine() -> list[str]:
            fault_point("resume.verify", step_of(folder.name))
            manifest = read_manifest(folder)
            if manifest is None:
                return [
                    f"{MANIFEST} missing or unreadable (an incomplete save?) on rank {dist.rank()}"
                ]
            if commit is not None and manifest.get("save_id") != commit.save_id:
                return [
                    f"on rank {dist.rank()}, a copy of another save ({manifest.get('save_id')}) "
                    f"than the bucket's ({commit.save_id})"
                ]
            # Node-local: each rank its own files on its node, each leader its node's shared files;
            # a whole checkpoint (shared storage, or a node's copy of one saved by another world
            # size): the ranks sharing it split its ranks' files.
            saved = int(manifest.get("world_size", 1))
            if self.node_local and "ranks" in manifest:
                if saved != dist.world_size():  # (a bucket's commit: fetched whole)
                    return [f"on rank {dist.rank()}, a node's files of a {saved}-rank checkpoint"]
                ranks = [dist.rank()]
            else:
                me = self.group.index(dist.rank())
                ranks = list(range(me, saved, len(self.group)))
            problems = verify(
                folder,
                checksums=checksums,
                ranks=ranks,
                shared=self.leader,
            ).problems
            # Intact, but would DeepSpeed's unpickling refuse it? Every rank learns before the load.
            return problems or safe_load.refusals(folder, ranks)

        out = dist.gather_outcomes(
            mine, share=True, step=f"verifying {folder.name}", deadline_s=dist.io_deadline()
        )
        problems = [p for rank_problems in out.results if rank_problems for p in rank_problems]
        bad = {r for r, rank_problems in enumerate(out.results) if rank_problems} | set(out.errors)
        return problems + [
            f"rank {r} could not check it: {e}" for r, e in sorted(out.errors.items())
        ], bad

    # --- the abandoned timeline -------------------------------------------------------------------

    def _set_aside_newer(self, point: Committed) -> int:
        """Committed checkpoints after the resume point are another timeline: set aside (renamed
        under .abandoned, kept, never counted by retention), so later saves of the same steps
        neither overwrite them nor count them. Leaders, agreed. Returns the highest commit number
        seen."""

        def newer() -> list[tuple[str, int]]:
            return [(c.tag, c.seq or 0) for c in newer_than(point, committed(self.storage))]

        out = dist.gather_outcomes(
            newer,
            on=self.leader,
            share=True,
            step="listing newer checkpoints",
            deadline_s=dist.io_deadline(),
        )
        out.raise_any()
        found = [item for r in out.results if r for item in r]
        tags = sorted({t for t, _ in found})
        if tags:
            self._set_aside(tags, "abandoned", f"committed after the resume point {point.tag}")
        return max([point.seq or 0] + [seq for _, seq in found])

    def _set_aside_other_timelines(self) -> None:
        """A run that saves but does not continue from a checkpoint in OUT (a fresh start, or a
        PATH elsewhere) would overwrite same-step checkpoints of OUT's earlier runs: they are set
        aside first (kept, not counted). Leaders, agreed."""
        if not self.cfg.ckpt.save_checkpoint:
            return
        out = dist.gather_outcomes(
            lambda: [c.tag for c in committed(self.storage)],
            on=self.leader,
            share=True,
            step="listing checkpoints",
            deadline_s=dist.io_deadline(),
        )
        out.raise_any()
        tags = sorted({t for r in out.results if r for t in r})
        if tags:
            self._set_aside(
                tags, "earlier-run", "this run does not continue it; delete it if it is not wanted"
            )

    def _set_aside(self, tags: list[str], label: str, why: str) -> None:
        def move() -> list[tuple[str, str]]:
            fault_point("resume.set_aside")
            return [
                (t, self.storage.set_aside(t, f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"))
                for t in tags
                if self.storage.exists(t)
            ]

        out = dist.gather_outcomes(
            move,
            on=self.leader,
            share=True,
            step="setting checkpoints aside",
            deadline_s=dist.io_deadline(),
        )
        out.raise_any()
        for moved in out.results:
            for tag, where in moved or []:
                logger.warning(
                    "set aside %s (%s): now %s in %s; not deleted, not counted",
                    tag,
                    why,
                    where,
                    self.out,
                )


def _node_local_world(folder: Path, saved: int) -> str:
    return (
        f"--resume_from_checkpoint: {folder} was saved by {saved} ranks on node-local storage, "
        f"this run has {dist.world_size()}; resuming it on another world size needs every "
        "node's files in one folder (copy them together, or resume from the bucket of "
        "--remote_output_dir, which fetches the whole checkpoint to every node); nothing was "
        "changed"
    )
