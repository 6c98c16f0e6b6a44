"""finetune.distributed's agreement primitive, in one process with the collectives stubbed: what
runs where. Real multi-rank behaviour is covered by tests/distributed."""

from __future__ import annotations

import threading

import pytest

from finetune import distributed as dist


class ThreadDevices:
    """An accelerator whose current device is per thread, as CUDA's is (a new thread starts on
    0)."""

    def __init__(self):
        self._local = threading.local()

    def device_name(self):
        return "cuda"

    def current_device(self):
        return getattr(self._local, "device", 0)

    def set_device(self, index):
        self._local.device = index


@pytest.fixture
def two_ranks(monkeypatch):
    """gather_outcomes as on a rank of two (its work in a thread), every peer answering like this
    one."""
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    monkeypatch.setattr(dist, "rank", lambda: 1)
    monkeypatch.setattr(dist, "all_gather_object", lambda obj: [obj, obj])


def test_agreed_work_runs_on_the_callers_device(monkeypatch, two_ranks):
    """Restoring a rank's CUDA RNG or loading an op inside gather_outcomes' thread must act on the
    rank's own GPU, not on device 0, where a new CUDA thread starts."""
    acc = ThreadDevices()
    monkeypatch.setattr("deepspeed.accelerator.get_accelerator", lambda: acc)
    acc.set_device(3)
    out = dist.gather_outcomes(acc.current_device, share=True)
    assert out.ok and out.result == 3
    assert acc.current_device() == 3


def test_agreed_work_on_cpu_needs_no_device(monkeypatch, two_ranks):
    out = dist.gather_outcomes(threading.current_thread, share=True)
    assert out.ok and out.result.name == "finetune-agreed"


# --- deadlines: a step that hangs fails on every rank; a slow one that makes progress does not ----


def test_a_step_that_makes_no_progress_fails_on_every_rank_after_its_deadline(two_ranks):
    """A syscall stuck in D-state (a dead mount) never returns: the ranks give up after the
    deadline, every one with the same failure naming the step, instead of polling for ever."""
    import time

    started = time.monotonic()
    out = dist.gather_outcomes(
        lambda: time.sleep(60), step="writing the manifest", deadline_s=0.5, poll_s=0.05
    )
    assert time.monotonic() - started < 5
    assert out.kinds == {0: "StepTimeout", 1: "StepTimeout"}
    assert "writing the manifest made no progress for 0.5 s" in out.errors[1]
    with pytest.raises(dist.StepTimeout):
        out.raise_any()


def test_a_slow_step_that_reports_progress_is_not_given_up(two_ranks):
    import time

    from finetune.io.progress import progress

    def slow():
        for _ in range(8):
            time.sleep(0.1)
            progress()
        return "done"

    out = dist.gather_outcomes(slow, share=True, step="verifying", deadline_s=0.35, poll_s=0.05)
    assert out.ok and out.results == ["done", "done"]


@pytest.mark.parametrize("carried", [True, False])
def test_progress_made_on_helper_threads_counts_when_carried(two_ranks, carried):
    """Files hashed on a pool's threads (manifest.check_files) report to the step that started
    them: carried, the slow step lives; without carry it would be given up."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from finetune.io.progress import carry, progress

    def piece(_):
        for _ in range(4):
            time.sleep(0.1)
            progress()

    def step():
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(carry(piece) if carried else piece, range(4)))
        return "done"

    out = dist.gather_outcomes(step, share=True, step="verifying", deadline_s=0.35, poll_s=0.05)
    assert out.ok is carried, out.errors


def test_one_process_gets_the_deadline_too(monkeypatch):
    import time

    monkeypatch.setattr(dist, "world_size", lambda: 1)
    out = dist.gather_outcomes(lambda: time.sleep(60), step="renaming", deadline_s=0.3, poll_s=0.05)
    assert out.kinds == {0: "StepTimeout"}


def test_rank_0_names_the_ranks_it_waits_for_at_most_once_a_minute(two_ranks, monkeypatch, caplog):
    import time

    monkeypatch.setattr(dist, "WAIT_LOG_S", 0.2)  # a minute, scaled down
    monkeypatch.setattr(dist, "rank", lambda: 0)
    with caplog.at_level("WARNING", logger="finetune"):
        out = dist.gather_outcomes(
            lambda: time.sleep(0.75), step="deleting older checkpoints", poll_s=0.02
        )
    assert out.ok
    lines = [r.getMessage() for r in caplog.records if "waiting for rank" in r.getMessage()]
    assert 2 <= len(lines) <= 4, lines  # every 0.2 s of 0.75 s, never once per poll (every 0.02 s)
    assert lines[0].startswith("waiting for rank 0, 1: deleting older checkpoints (")


def test_a_rank_still_busy_when_another_is_given_up_fails_too(monkeypatch):
    """Rank 0 hangs, rank 1 is still working (and progressing) at the deadline: the step failed,
    so rank 1's work is abandoned as well, never reported as a success with no result."""
    import time

    monkeypatch.setattr(dist, "world_size", lambda: 2)
    monkeypatch.setattr(dist, "rank", lambda: 1)
    # Rank 0's view: busy and stalled past the deadline; this rank (1) is busy but moving.
    monkeypatch.setattr(
        dist,
        "all_gather_object",
        lambda obj: (
            [(True, 99.0, 1.0, False), obj]
            if len(obj) == 4
            else [(("StepTimeout", "rank 0 hung"), None), obj]
        ),
    )
    out = dist.gather_outcomes(
        lambda: time.sleep(0.5) or "late", share=True, step="verifying", deadline_s=0.3, poll_s=0.02
    )
    assert 1 in out.errors and "given up" in out.errors[1] and out.result is None
