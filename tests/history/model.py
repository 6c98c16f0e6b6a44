"""What must hold after every operation of a history, from a model the size of a page: which
commits exist, in the order they were made, which each continued (its parent), their lineage, and
which are no longer part of the history. The bucket is read directly (its objects, hashed here),
never through the code under test; a local copy counts as intact when the checkpoint format's
``verify`` passes it.

A commit is *live* while it belongs to the prefix's lineage and nothing has left it behind: a
rollback (a start from a named checkpoint) leaves every commit made after the one it names; the
bucket leaves a commit that never reached it once it holds another continuation of the same
ancestor (a run on another disk carried on without it).

The promises, checked after each operation:

  (i)   a run continued what it should: ``auto`` the newest live commit intact in its OUT or in
        the bucket (a fresh start if there is none), a named checkpoint that one; or it exited
        with a documented code for its situation;
  (ii)  no live commit that reached the bucket is gone from it, unless retention
        (--save_total_limit) took it with a newer live one kept there;
  (iii) every manifest in the bucket verifies against its objects (sizes and checksums);
  (iv)  no run exits 0 with its final checkpoint absent from the bucket;
  (v)   ``verify``, ``ls`` (the bucket's ``latest``) and ``auto`` from a fresh disk name the same
        checkpoint: the newest live commit in the bucket.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from history.world import BUCKET, KILLED, URI, Outcome, Start, World

from finetune.checkpoint_format.manifest import MANIFEST, verify
from finetune.checkpoint_format.outdir import OutputDir, committed
from finetune.io.durable import hash_bytes

PREFIX = URI.removeprefix(f"s3://{BUCKET}/")


@dataclass(frozen=True)
class Commit:
    save_id: str
    seq: int  # its commit number
    parent: str | None  # the commit this one continued (None: the first of a lineage)
    lineage: str


@dataclass
class Model:
    commits: dict[str, Commit] = field(default_factory=dict)  # in the order they were made
    left: set[str] = field(default_factory=set)  # left behind by a rollback
    seen_in_bucket: set[str] = field(default_factory=set)  # committed there at some point
    limited: bool = False  # a run applied --save_total_limit

    def ancestors(self, sid: str) -> list[str]:
        line, parent = [], self.commits[sid].parent
        while parent is not None and parent in self.commits:
            line.append(parent)
            parent = self.commits[parent].parent
        return line

    def live(self, in_bucket: set[str]) -> list[str]:
        """The live commits, newest first (``in_bucket``: the bucket's intact commits)."""
        lines = {x: set(self.ancestors(x)) for x in in_bucket if x in self.commits}
        # the prefix's lineage is its newest commit's; none yet: any run's may be continued
        there = [sid for sid in self.commits if sid in in_bucket]
        lineage = self.commits[there[-1]].lineage if there else None
        live = []
        for sid, commit in self.commits.items():
            if lineage not in (None, commit.lineage) or sid in self.left:
                continue
            if sid not in in_bucket:  # passed over: the bucket holds another branch of its line
                mine = {sid, *self.ancestors(sid)}
                if any(x not in mine and sid not in line for x, line in lines.items()):
                    continue
            live.append(sid)
        return live[::-1]

    # --- what the world holds, read directly -----------------------------------------------------

    @staticmethod
    def bucket_commits(world: World) -> dict[str, dict]:
        """tag → manifest of every committed checkpoint in the bucket."""
        found = {}
        for (bucket, key), stored in world.bucket.snapshot().items():
            parts = key.split("/")
            if bucket == BUCKET and len(parts) == 3 and parts[0] == PREFIX and parts[2] == MANIFEST:
                if parts[1].startswith("global_step"):
                    found[parts[1]] = json.loads(stored.data)
        return found

    @staticmethod
    def bucket_problems(world: World, tag: str, manifest: dict) -> list[str]:
        objects = world.bucket.snapshot()
        problems = []
        for name, want in manifest["files"].items():
            stored = objects.get((BUCKET, f"{PREFIX}/{tag}/{name}"))
            if stored is None:
                problems.append(f"{tag}/{name} missing")
            elif (
                len(stored.data) != int(want["size"]) or hash_bytes(stored.data) != want["checksum"]
            ):
                problems.append(f"{tag}/{name} differs from the manifest")
        return problems

    def intact_in_bucket(self, world: World) -> dict[str, str]:
        """save id → tag of the bucket's commits that verify."""
        return {
            m.get("save_id"): tag
            for tag, m in self.bucket_commits(world).items()
            if not self.bucket_problems(world, tag, m)
        }

    @staticmethod
    def intact_in(out: Path) -> dict[str, str]:
        """save id → tag of OUT's commits that verify."""
        return {
            c.save_id: c.tag
            for c in committed(OutputDir(out))
            if verify(out / c.tag, checksums=True).ok
        }

    def expected_auto(self, world: World, out: Path) -> str | None:
        in_bucket = set(self.intact_in_bucket(world))
        visible = set(self.intact_in(out)) | in_bucket
        return next((sid for sid in self.live(in_bucket) if sid in visible), None)

    # --- a run -----------------------------------------------------------------------------------

    def before_run(self, world: World, start: Start) -> dict:
        """What the run should do, decided from the world before it runs."""
        out = world.outs[start.out]
        named = None
        if start.spec.startswith(("local:", "s3:")):
            where, step = start.spec.split(":")
            tag = f"global_step{step}"
            if where == "local":
                holds = {t: sid for sid, t in self.intact_in(out).items()}
            else:
                holds = {t: sid for sid, t in self.intact_in_bucket(world).items()}
            named = holds.get(tag)
        return {
            "auto": self.expected_auto(world, out) if start.spec == "auto" else None,
            "named": named,
            "prefix_used": bool(self.bucket_commits(world)),
        }

    def after_run(self, world: World, start: Start, expect: dict, outcome: Outcome) -> list[str]:
        """Check the run's outcome against ``expect`` (promises i and iv), then record it."""
        bad = []
        code = outcome.code
        faulty = start.fault is not None or start.outage_at is not None
        if start.outage_at == 0 and outcome.started:
            bad.append("a run started while the bucket was down")
        if code == 2 and not faulty:
            refusals = ("holds another run's checkpoints", "another run's history")
            damaged = start.spec.startswith("local:") and expect["named"] is None
            if damaged and "does not verify" in outcome.error:
                pass  # a local folder named explicitly that does not verify: the user's to fix
            elif start.spec == "auto" and expect["auto"] is None and "verifies" in outcome.error:
                pass  # only damaged copies, none in the bucket: the documented refusal
            elif not any(r in outcome.error for r in refusals):
                bad.append(f"exit 2 for no documented reason: {outcome.error}")
            elif start.spec == "fresh" and not expect["prefix_used"]:
                bad.append("a fresh start refused on a prefix with no commits")
        if start.spec == "fresh" and expect["prefix_used"] and outcome.started:
            bad.append("a fresh start ran on a prefix holding commits")
        if not faulty and code not in (0, 2):
            bad.append(f"exit {code} with no fault: {outcome.error}")
        # a first start's OUT may still show the prefix was used: a restart's exit then
        first = not start.restart and not prefix_used_by(world.outs[start.out])
        if start.outage_at == 0 and code != (2 if first else 75):
            when = "a first start" if first else "a restart"
            bad.append(f"exit {code} for a bucket down at {when}")
        if outcome.started:
            want = expect["auto"] if start.spec == "auto" else expect["named"]
            if start.spec != "fresh" and (want is not None or start.spec == "auto"):
                if outcome.started_from != want:
                    bad.append(f"continued {outcome.started_from}, not {want}")
            self._record(start, outcome)
        if code == 0 and outcome.started:
            final = outcome.commits[-1] if outcome.commits else outcome.started_from
            there = self.intact_in_bucket(world)
            if final not in there:
                bad.append(f"exit 0 with its final checkpoint {final} not intact in the bucket")
        self.seen_in_bucket |= set(self.intact_in_bucket(world)) & set(self.commits)
        return bad

    def _record(self, start: Start, outcome: Outcome) -> None:
        parent = outcome.started_from
        if parent is None:  # a fresh start: a new lineage
            lineage = outcome.run_id
        else:
            lineage = self.commits[parent].lineage if parent in self.commits else outcome.run_id
        if start.spec.startswith(("local:", "s3:")) and parent in self.commits:
            # a rollback: what was made after the named commit is left behind, for good (set
            # aside in the bucket; its data go when the step is saved again)
            made = list(self.commits)
            self.left -= {parent, *self.ancestors(parent)}  # named: its line is live again
            self.left |= set(made[made.index(parent) + 1 :])
            self.seen_in_bucket -= self.left
        for sid in outcome.commits:
            self.commits[sid] = Commit(sid, int(sid.rsplit("-", 1)[-1]), parent, lineage)
            parent = sid
        self.limited |= start.limit is not None

    # --- after every operation -------------------------------------------------------------------

    def check(self, world: World) -> list[str]:
        """Promises ii, iii and v."""
        from finetune.remote.verify import locate

        bad = []
        manifests = self.bucket_commits(world)
        for tag, manifest in manifests.items():
            for problem in self.bucket_problems(world, tag, manifest):
                bad.append(f"(iii) the bucket's {tag} does not verify: {problem}")
        intact = self.intact_in_bucket(world)
        live = self.live(set(intact))
        kept = [sid for sid in live if sid in intact]
        for i, sid in enumerate(live):
            if sid in self.seen_in_bucket and sid not in intact:
                newer_kept = any(k in intact for k in live[:i])
                if not (self.limited and newer_kept):
                    bad.append(f"(ii) {sid}, live, is gone from the bucket")
                self.seen_in_bucket.discard(sid)  # retention's: not to be found there again
        newest = intact[kept[0]] if kept else None
        if manifests:
            try:
                named = locate(URI)[1]
            except Exception as e:  # noqa: BLE001 — reported as the violation it is
                named = f"error: {e}"
            if named != newest:
                bad.append(f"(v) verify names {named}, the newest live commit is {newest}")
            latest = world.bucket.snapshot().get((BUCKET, f"{PREFIX}/latest"))
            latest_tag = latest.data.decode().strip() if latest else None
            if latest_tag != newest:
                bad.append(f"(v) the bucket's latest names {latest_tag}, not {newest}")
        return bad


def prefix_used_by(out: Path) -> bool:
    """What a start reads to tell a restart: OUT holds a commit or names the prefix."""
    from finetune.remote.prefix import restarted

    return restarted(out, URI, env={})


def outcome_line(start: Start, outcome: Outcome) -> str:
    code = outcome.code if outcome.code != KILLED else "killed"
    return f"{start} -> exit {code}, from {outcome.started_from}, committed {outcome.commits}"
