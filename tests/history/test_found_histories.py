"""Histories the explorer (test_explorer.py) found breaking a promise, shrunk to their shortest
form, each replayed here on the same world and checked by the same model after every run. Each
failed before its fix; the test names say what went wrong."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from history.model import Model, outcome_line
from history.world import Start, World


@pytest.fixture(scope="module")
def module() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16))


@pytest.fixture
def world(module, monkeypatch):
    root = Path(
        tempfile.mkdtemp(prefix="history-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    yield World(root, module, monkeypatch)
    shutil.rmtree(root, ignore_errors=True)


def replay(world: World, starts: list[Start]) -> list[str]:
    """Each run, checked as the explorer checks it; the history as it went."""
    model, log = Model(), []
    for start in starts:
        expect = model.before_run(world, start)
        outcome = world.run(start)
        log.append(outcome_line(start, outcome))
        bad = model.after_run(world, start, expect, outcome) + model.check(world)
        assert not bad, f"{'; '.join(bad)}\nhistory:\n  " + "\n  ".join(log)
    return log


# name → the shrunk history (test_real_histories.py runs them for real too)
FOUND: dict[str, list[Start]] = {
    # The rollback set aside the bucket's step 2, whose name `latest` kept: `ls` named a
    # checkpoint that verify, export and auto no longer saw.
    "rollback_latest": [
        Start("A", "auto", 1),
        Start("A", "auto", 1),
        Start("A", "local:1", 1, fault="retention.history:0:kill"),
    ],
    # A's step 2 never reached the bucket (killed while copying it); B resumed from the bucket's
    # step 1 and committed its own step 2 there; A's next start took its local step 2, a fork.
    "fork_of_a_step": [
        Start("A", "auto", 1),
        Start("A", "auto", 1, fault="remote.upload:1:kill"),
        Start("B", "auto", 1),
        Start("A", "auto", 1),
    ],
    # A rolled back to step 1 (the bucket's steps 2 and 3 set aside) and was killed before its
    # first save; B, holding steps 2 and 3, resumed from its step 3.
    "rollback_undone_elsewhere": [
        Start("A", "auto", 1),
        Start("A", "auto", 1),
        Start("B", "auto", 1),
        Start("A", "local:1", 1, fault="save.check_space:1:kill"),
        Start("B", "auto", 1),
    ],
    # A's step 3 never reached the bucket (the bucket went down); B continued step 2 with
    # --save_total_limit 1, so the bucket holds B's step 3 only; A's next start took its own.
    "fork_past_retention": [
        Start("A", "auto", 1),
        Start("A", "auto", 1),
        Start("A", "auto", 1, outage_at=1),
        Start("B", "auto", 1, limit=1),
        Start("A", "auto", 1),
    ],
}


def test_a_rollback_points_the_buckets_latest_at_the_commit_it_resumes(world):
    replay(world, FOUND["rollback_latest"])


def test_a_requeue_does_not_take_its_own_disks_fork_of_a_step_the_bucket_holds(world):
    log = replay(world, FOUND["fork_of_a_step"])
    assert "from run003-2" in log[-1], log[-1]


def test_a_rollback_is_not_undone_by_a_requeue_on_another_disk(world):
    log = replay(world, FOUND["rollback_undone_elsewhere"])
    assert "from run001-1" in log[-1], log[-1]


def test_a_fork_stays_behind_when_retention_took_the_common_ancestor(world):
    log = replay(world, FOUND["fork_past_retention"])
    assert "from run004-3" in log[-1], log[-1]
