"""The history explorer, slow form: histories of real runs (2 ranks under torchrun, a real S3
server, a real SIGKILL), checked after every operation by the fast form's model (model.py) and its
promises. The histories come from a seeded generator (``history(seed)``) of the operations the
fast form draws (auto starts, rollbacks to a local or an s3:// checkpoint, a kill at a save's,
commit's or copy's fault site, the bucket unreachable at a restart, a checkpoint damaged or
deleted, a disk replaced), and the fast form's regression histories (test_found_histories.py) run
for real. ``make check`` runs one of those (a kill mid-copy, a run on another disk, a requeue on
the first: 4 runs); ``make faults`` the rest."""

from __future__ import annotations

import random

import pytest
from history.model import Model, outcome_line
from history.real_world import RealWorld
from history.test_found_histories import FOUND
from history.world import Start, disturb
from s3_server import require_s3

pytestmark = [pytest.mark.distributed, pytest.mark.faults]
require_s3()  # skips the module without boto3 or the `weed` binary

BUCKET = "history"
KILL_SITES = (
    "save.write_rank_files",
    "commit.manifest",
    "commit.rename",
    "remote.upload",
    "remote.commit",
)


def history(seed: int, length: int) -> list[tuple]:
    """A run from nothing, then ``length - 1`` operations drawn from ``seed``: ("run", Start) or
    ("disturb", out, how, pick)."""
    rng = random.Random(seed)
    ops: list[tuple] = [("run", Start("A", "auto", 2, restart=False))]
    while len(ops) < length:
        out = rng.choice("AB")
        roll = rng.random()
        if roll < 0.15:
            how = rng.choice(["damage", "delete", "replace disk"])
            ops.append(("disturb", out, how, rng.randrange(8)))
            continue
        spec = "auto"
        if roll < 0.3:
            spec = rng.choice(["local", "s3"])  # a step chosen when it runs, from what is there
        fault = None
        if rng.random() < 0.4:
            fault = f"{rng.choice(KILL_SITES)}:{rng.randint(1, 2)}:kill"
        outage = 0 if rng.random() < 0.1 else None
        ops.append(("run", Start(out, spec, rng.randint(1, 3), None, fault, outage)))
    return ops


def replay(world: RealWorld, ops: list[tuple], pick: random.Random) -> None:
    model, log = Model(), []
    for op in ops:
        if op[0] == "disturb":
            done = disturb(world.outs[op[1]], op[2], op[3])
            log.append(done or f"{op[2]} {op[1]}: nothing there")
        else:
            start = _named(world, model, op[1], pick)
            expect = model.before_run(world, start)
            outcome = world.run(start)
            log.append(outcome_line(start, outcome))
            bad = model.after_run(world, start, expect, outcome)
            if bad:
                _fail(bad, log, world)
        bad = model.check(world)
        if bad:
            _fail(bad, log, world)


def _named(world: RealWorld, model: Model, start: Start, pick: random.Random) -> Start:
    """A rollback's checkpoint, chosen from what OUT or the bucket holds now (auto if none)."""
    if start.spec not in ("local", "s3"):
        return start
    if start.spec == "local":
        tags = [t for t in model.intact_in(world.outs[start.out]).values()]
    else:
        tags = list(model.intact_in_bucket(world).values())
    if not tags:
        return Start(start.out, "auto", start.steps, start.limit, start.fault, start.outage_at)
    step = pick.choice(sorted(tags)).removeprefix("global_step")
    return Start(
        start.out, f"{start.spec}:{step}", start.steps, start.limit, start.fault, start.outage_at
    )


def _fail(bad: list[str], log: list[str], world: RealWorld) -> None:
    history = "\n  ".join(log)
    raise AssertionError(
        f"{'; '.join(bad)}\nhistory:\n  {history}\nlast run's output:\n{world.logs[-1]}"
    )


@pytest.fixture
def world(server, aws_env, tmp_path) -> RealWorld:
    client = server.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=obj["Key"])
    return RealWorld(tmp_path, server)


@pytest.mark.faults_long
@pytest.mark.parametrize("seed", range(6))
def test_a_history_of_real_runs_keeps_every_promise(world, seed):
    replay(world, history(seed, 6), random.Random(seed))


@pytest.mark.parametrize(
    "name",
    [
        "fork_of_a_step",
        *(pytest.param(n, marks=pytest.mark.faults_long) for n in FOUND if n != "fork_of_a_step"),
    ],
)
def test_the_fast_forms_regressions_hold_for_real(world, name):
    replay(world, [("run", s) for s in FOUND[name]], random.Random(0))
