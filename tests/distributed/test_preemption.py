"""Preemption under real launchers: a signal → every rank commits the same step → exit 75 →
resume."""

from __future__ import annotations

import json
import os
import signal

import pytest

from finetune.preemption import EXIT_PREEMPTED

from conftest import assert_verifies, last_logged_step, wait_until

pytestmark = pytest.mark.distributed
# DeepSpeed's launcher forwards signals to the ranks its own way: the preemption tests keep it
# unless they name torchrun.

TIMEOUT = 300
# Many steps so the run is still training when the signal comes; logging every step shows progress.
LONG = [
    "--max_steps",
    "3000",
    "--logging_steps",
    "1",
    "--save_checkpoint",
    "--eval_steps",
    "100000",
]


def _assert_preempted_and_committed(
    result, steps_before_signal: int, launcher_code: int = EXIT_PREEMPTED
):
    assert result.returncode == launcher_code, result.output[-4000:]
    out = result.out_dir
    status = json.loads((out / "exit_status.json").read_text())
    assert status["exit_code"] == EXIT_PREEMPTED and status["reason"] == "preempted"
    tag = (out / "latest").read_text().strip()
    assert status["checkpoint"] == tag
    step = int(tag.removeprefix("global_step"))
    # Nothing lost but the step in flight: the save is at the first boundary after the signal.
    assert step >= steps_before_signal
    assert last_logged_step(out) == step  # and training did not go on past it
    assert_verifies(out / tag)
    assert not (out / ".staging").exists() or not any((out / ".staging").iterdir())
    return step


def test_sigusr1_to_one_rank_under_deepspeed_saves_once_and_resumes(
    start_finetune, run_finetune, tmp_path
):
    """One rank signalled (twice: again while saving): all ranks commit one step, then resume to the
    end."""
    # each file takes ≥ 1 s: a save lasts ≥ 4 s
    run = start_finetune(*LONG, env={"FINETUNE_SLOW_SAVE": "1"}, launcher="deepspeed")
    wait_until(lambda: last_logged_step(run.out_dir) >= 3, TIMEOUT, "three logged steps")
    ranks = run.rank_pids()
    assert sorted(ranks) == [0, 1], ranks
    before = last_logged_step(run.out_dir)
    # rank 1 only: rank 0 learns it through the step-boundary all-reduce
    os.kill(ranks[1], signal.SIGUSR1)
    wait_until(lambda: (run.out_dir / ".staging").exists(), 60, "the save to start", interval=0.005)
    for pid in ranks.values():  # a second signal in the middle of the save must not break it
        os.kill(pid, signal.SIGTERM)
    result = run.finish(TIMEOUT)
    step = _assert_preempted_and_committed(result, before)
    assert "SIGUSR1 received" in result.output and "received again" in result.output
    assert "preempted (SIGUSR1 on rank 1)" in result.output
    assert result.output.count("Finished saving the checkpoint") == 1

    resumed = run_finetune(
        "--max_steps",
        str(step + 3),
        "--logging_steps",
        "1",
        "--save_checkpoint",
        "--resume_from_checkpoint",
        "auto",
        timeout=TIMEOUT,
    )
    assert resumed.returncode == 0, resumed.output[-4000:]
    rows = [r for r in resumed.metrics() if "loss" in r]
    assert [r["step"] for r in rows][-3:] == [step + 1, step + 2, step + 3]
    assert json.loads((resumed.out_dir / "exit_status.json").read_text())["reason"] == "finished"


def test_sigterm_to_torchrun_saves_and_exit_status_says_preempted(start_finetune):
    """torchrun forwards SIGTERM to its workers but reports any failure as exit 1: exit_status.json
    keeps 75."""
    run = start_finetune(*LONG, launcher="torchrun", env={"FINETUNE_RUN_ID": "torchrun-test"})
    wait_until(lambda: last_logged_step(run.out_dir) >= 3, TIMEOUT, "three logged steps")
    before = last_logged_step(run.out_dir)
    os.kill(run.proc.pid, signal.SIGTERM)
    result = run.finish(TIMEOUT)
    # torchrun's code; the file has ours
    _assert_preempted_and_committed(result, before, launcher_code=1)
    assert json.loads((run.out_dir / "exit_status.json").read_text())["run_id"] == "torchrun-test"


def test_preemption_disabled_leaves_the_signal_fatal(start_finetune):
    run = start_finetune(*LONG, "--preempt_signals", "none", launcher="torchrun")
    wait_until(lambda: last_logged_step(run.out_dir) >= 2, TIMEOUT, "two logged steps")
    os.kill(run.rank_pids()[0], signal.SIGTERM)
    result = run.finish(TIMEOUT)
    assert result.returncode != 0
    assert not (run.out_dir / "latest").exists()
    # Killed by the signal: the file still says "running" (what job scripts then read as a failure).
    assert json.loads((run.out_dir / "exit_status.json").read_text())["exit_code"] is None
