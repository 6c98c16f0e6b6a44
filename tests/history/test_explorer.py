"""The history explorer, fast form: random histories of runs on two disks and one bucket prefix —
fresh starts, ``auto``, rollbacks to a local or an s3:// checkpoint, a fault at any site of a save,
a commit, retention, the copy or a start (kill -9, EIO, ENOSPC, a hang), the bucket down at a start
or in the middle of a run, a local checkpoint damaged or lost, a whole disk replaced — each checked
after every operation against model.py's promises. The runs are the real code (world.py) on a
fake engine and an in-memory bucket; hypothesis generates the histories and shrinks a failing one
to its shortest form, which then becomes a named test in test_found_histories.py.

``FINETUNE_HISTORIES`` sets how many histories (``make test``: the default; ``make faults``:
more); each has up to ``STEPS`` operations.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from history.model import Model, outcome_line
from history.world import START_SITES, Start, World, disturb
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from finetune.checkpoint_format.outdir import OutputDir, committed

HISTORIES = int(os.environ.get("FINETUNE_HISTORIES", "300"))
# other histories than the fixed ones each time (hypothesis prints the seed of one that fails)
FRESH = os.environ.get("FINETUNE_HISTORIES_FRESH") == "1"
STEPS = 8  # operations per history at most
SAVE_SITES = (
    "save.check_space",
    "save.snapshot",
    "save.makedirs",
    "save.write_rank_files",
    "save.fsync",
    "save.shared_files",
    "commit.manifest",
    "commit.rename",
    "commit.latest",
    "retention.delete",
)
COPY_SITES = ("remote.upload", "remote.commit")
STATS = {"histories": 0, "operations": 0, "runs": 0, "exits": {}}


def faults() -> st.SearchStrategy[str | None]:
    save = st.tuples(
        st.sampled_from(SAVE_SITES), st.integers(1, 4), st.sampled_from(["kill", "eio", "enospc"])
    )
    copy = st.tuples(
        st.sampled_from(COPY_SITES), st.integers(1, 4), st.sampled_from(["kill", "eio", "hang"])
    )
    start = st.tuples(st.sampled_from(START_SITES), st.just(0), st.sampled_from(["kill", "eio"]))
    fault = st.one_of(save, copy, start).map(lambda f: f"{f[0]}:{f[1]}:{f[2]}")
    return st.one_of(st.none(), st.none(), fault)


class Histories(RuleBasedStateMachine):
    world_args: tuple  # (module, monkeypatch), set by the test

    @initialize()
    def begin(self) -> None:
        module, monkeypatch = self.world_args
        self.root = Path(tempfile.mkdtemp(prefix="history-", dir=_scratch()))
        self.world = World(self.root, module, monkeypatch)
        self.model = Model()
        self.log: list[str] = []
        STATS["histories"] += 1

    def teardown(self) -> None:
        shutil.rmtree(getattr(self, "root", ""), ignore_errors=True)

    def _note(self, line: str) -> None:
        self.log.append(line)
        STATS["operations"] += 1

    def _fail(self, bad: list[str]) -> None:
        if bad:
            history = "\n  ".join(self.log)
            raise AssertionError(f"{'; '.join(bad)}\nhistory:\n  {history}")

    def _local_steps(self, out: str) -> list[int]:
        return sorted(
            int(c.tag.removeprefix("global_step"))
            for c in committed(OutputDir(self.world.outs[out]))
        )

    @rule(
        out=st.sampled_from("AB"),
        spec=st.sampled_from(["auto", "auto", "auto", "fresh", "local", "s3"]),
        pick=st.integers(0, 7),
        steps=st.integers(1, 4),
        limit=st.sampled_from([None, None, 1, 2]),
        fault=faults(),
        outage=st.sampled_from([None] * 8 + [0, 1, 2]),
        restart=st.sampled_from([True, True, True, False]),
    )
    def run(self, out, spec, pick, steps, limit, fault, outage, restart) -> None:
        self._run(out, spec, pick, steps, limit, fault, outage, restart)

    @rule(out=st.sampled_from("AB"), steps=st.integers(1, 4), fault=faults())
    def requeue(self, out, steps, fault) -> None:
        """The common case: a requeued job resumes with ``auto``."""
        self._run(out, "auto", 0, steps, None, fault, None, True)

    def _run(self, out, spec, pick, steps, limit, fault, outage, restart) -> None:
        if spec in ("local", "s3"):
            there = (
                self._local_steps(out)
                if spec == "local"
                else sorted(
                    int(t.removeprefix("global_step")) for t in Model.bucket_commits(self.world)
                )
            )
            if not there:
                spec, there = "auto", []
            else:
                spec = f"{spec}:{there[pick % len(there)]}"
        if outage is not None:
            fault = None  # one trouble at a time
        start = Start(out, spec, steps, limit, fault, outage, restart)
        expect = self.model.before_run(self.world, start)
        outcome = self.world.run(start)
        STATS["runs"] += 1
        STATS["exits"][str(outcome.code)] = STATS["exits"].get(str(outcome.code), 0) + 1
        self._note(outcome_line(start, outcome))
        self._fail(self.model.after_run(self.world, start, expect, outcome))

    @rule(
        out=st.sampled_from("AB"),
        how=st.sampled_from(["damage", "delete", "replace disk"]),
        pick=st.integers(0, 7),
    )
    def disturb(self, out, how, pick) -> None:
        """What happens to a disk between runs: 16 bytes of a rank file of a local checkpoint
        flipped, a checkpoint deleted by hand, or a fresh disk (the whole OUT gone)."""
        done = disturb(self.world.outs[out], how, pick)
        if done is not None:
            self._note(done)

    @invariant()
    def promises_hold(self) -> None:
        if hasattr(self, "world"):
            self._fail(self.model.check(self.world))


def _scratch() -> str | None:
    """A memory-backed folder where there is one: a history's many small fsyncs cost nothing."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


@pytest.fixture(scope="module")
def module() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16))


def test_histories_keep_every_promise(module, monkeypatch, request) -> None:
    Histories.world_args = (module, monkeypatch)
    run = Histories.TestCase
    run.settings = settings(
        max_examples=HISTORIES,
        stateful_step_count=STEPS,
        deadline=None,
        derandomize=not FRESH,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    )
    run("runTest").runTest()
    print(f"\nhistory explorer: {STATS}")
