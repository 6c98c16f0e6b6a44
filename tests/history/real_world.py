"""The world of a history, for real: each run is ``finetune`` on 2 ranks (torchrun), the embedded
default model, OUT a real folder, the bucket a real S3 server (SeaweedFS on loopback), a fault
``FINETUNE_FAULT``'s (a kill is a real SIGKILL of the rank). The explorer's model (model.py) checks
it as it checks the fast form's world (world.py): the same ``outs``, the bucket's objects
(``bucket.snapshot()``), and each run's ``Outcome``, read here from what the run left (its
``events.jsonl``: its run id and what it resumed from; the manifests: its commits).

No --save_total_limit here: a commit that retention deletes within a run would be missing from
what the run left, and retention in the bucket has its own real-server tests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from history.memory_s3 import Stored
from history.world import BUCKET, KILLED, URI, Outcome, Start

from finetune.checkpoint_format.manifest import MANIFEST
from finetune.checkpoint_format.outdir import OutputDir, committed

from conftest import Running, child_env, finetune_cmd

PREFIX = URI.removeprefix(f"s3://{BUCKET}/")
TIMEOUT = 420
DEAD_ENDPOINT = "http://127.0.0.1:9"  # nothing listens: a bucket that does not answer
ROLLBACK_DONE = "a timeline this resume leaves"  # lineage.set_aside's log line


class RealBucket:
    """The bucket's objects as the model reads them, through boto3."""

    def __init__(self, server) -> None:
        self.client = server.client()

    def snapshot(self) -> dict[tuple[str, str], Stored]:
        found = {}
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
        for page in pages:
            for obj in page.get("Contents", []):
                got = self.client.get_object(Bucket=BUCKET, Key=obj["Key"])
                found[(BUCKET, obj["Key"])] = Stored(
                    got["Body"].read(), got.get("Metadata", {}), got["ETag"]
                )
        return found


class RealWorld:
    """Two OUTs and a prefix on a real server; ``run`` launches one run in them."""

    def __init__(self, root: Path, server) -> None:
        self.root = root
        self.server = server
        self.outs = {name: root / name for name in ("A", "B")}
        self.bucket = RealBucket(server)
        self.logs: list[str] = []

    def _highest_step(self) -> int:
        steps = [
            int(c.tag.removeprefix("global_step"))
            for out in self.outs.values()
            for c in committed(OutputDir(out))
        ]
        steps += [
            int(key.split("/")[1].removeprefix("global_step"))
            for (_, key) in self.bucket.snapshot()
            if key.startswith(f"{PREFIX}/global_step") and key.endswith(f"/{MANIFEST}")
        ]
        return max(steps, default=0)

    def run(self, start: Start) -> Outcome:
        out = self.outs[start.out]
        # every run ends past every step saved so far: the steps it trains past where it starts
        top = self._highest_step()
        flags = ["--save_checkpoint", "--save_steps", "2", "--remote_output_dir", URI]
        flags += ["--max_steps", str(top + start.steps), "--logging_steps", "1"]
        flags += ["--ddp_timeout", "60"]
        spec = {"fresh": None, "auto": "auto"}.get(start.spec)
        if start.spec.startswith("local:"):
            spec = str(out / f"global_step{start.spec.split(':')[1]}")
        elif start.spec.startswith("s3:"):
            spec = f"{URI}/global_step{start.spec.split(':')[1]}"
        if spec is not None:
            flags += ["--resume_from_checkpoint", spec]
        extra = {"FINETUNE_REMOTE_WAIT_S": "3"}
        if start.fault:
            site, at, kind = start.fault.split(":")
            step = f":{top + int(at)}" if int(at) else ""
            extra["FINETUNE_FAULT"] = f"{site}:0{step}:{kind}"
        if start.restart:
            extra.update(SLURM_RESTART_COUNT="1", SLURM_JOB_ID="7")
        env = child_env(self.server.env(**extra))
        if start.outage_at == 0:
            env["AWS_ENDPOINT_URL"] = DEAD_ENDPOINT
        before = _run_ids(out)
        named = self._named_save_id(out, spec) if spec not in (None, "auto") else None
        cmd = finetune_cmd("torchrun", 2, tuple(flags), out)
        result = Running(cmd, self.root, env, out).finish(TIMEOUT)
        self.logs.append(result.output[-4000:])
        killed = "injecting kill" in result.output
        outcome = Outcome(code=KILLED if killed else _rank_code(result), run_id="")
        errors = re.findall(r"^.*error: (.*)$", result.output, flags=re.MULTILINE)
        outcome.error = errors[-1] if errors else result.output[-2000:]
        ids = [r for r in _run_ids(out) if r not in before]
        if not ids:
            # stopped before its first event; a rollback that set the later commits aside had
            # decided its start (as the fast form's ``started``)
            if named is not None and ROLLBACK_DONE in result.output:
                outcome.started, outcome.started_from = True, named
            return outcome
        outcome.run_id = ids[-1]
        outcome.started = True
        mine = self._commits(out, outcome.run_id)
        outcome.commits = [c["save_id"] for c in mine]
        resumed = _resumed_from(out, outcome.run_id)
        if mine:
            outcome.started_from = mine[0].get("parent_save_id") if resumed else None
        elif resumed:
            manifest = out / resumed / MANIFEST
            data = json.loads(manifest.read_text()) if manifest.is_file() else {}
            outcome.started_from = data.get("save_id")
        return outcome

    def _named_save_id(self, out: Path, spec: str) -> str | None:
        """The save id of the checkpoint ``spec`` names, before the run."""
        if spec.startswith("s3://"):
            stored = self.bucket.snapshot().get(
                (BUCKET, f"{spec.removeprefix(f's3://{BUCKET}/')}/{MANIFEST}")
            )
            return json.loads(stored.data).get("save_id") if stored else None
        manifest = Path(spec) / MANIFEST
        return json.loads(manifest.read_text()).get("save_id") if manifest.is_file() else None

    def _commits(self, out: Path, run_id: str) -> list[dict]:
        """This run's commits, in OUT or in the bucket, oldest first."""
        found = {}
        for c in committed(OutputDir(out)):
            if (c.save_id or "").startswith(f"{run_id}-"):
                found[c.save_id] = json.loads((out / c.tag / MANIFEST).read_text())
        for (_, key), stored in self.bucket.snapshot().items():
            if key.startswith(f"{PREFIX}/global_step") and key.endswith(f"/{MANIFEST}"):
                manifest = json.loads(stored.data)
                if str(manifest.get("save_id", "")).startswith(f"{run_id}-"):
                    found[manifest["save_id"]] = manifest
        return sorted(found.values(), key=lambda m: m["commit_seq"])


def _rank_code(result) -> int:
    """The ranks' exit code: torchrun exits 1 for any failed rank, and reports each rank's own
    (rank 0's first)."""
    if result.returncode == 0:
        return 0
    found = re.search(r"failed \(exitcode: (-?\d+)\) local_rank: 0", result.output)
    found = found or re.search(r"exitcode\s*: (-?\d+)", result.output)
    return int(found.group(1)) if found else result.returncode


def _events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run_ids(out: Path) -> list[str]:
    return list(dict.fromkeys(e["run_id"] for e in _events(out) if e.get("run_id")))


def _resumed_from(out: Path, run_id: str) -> str | None:
    return next(
        (e["from"] for e in _events(out) if e["event"] == "resume" and e.get("run_id") == run_id),
        None,
    )
