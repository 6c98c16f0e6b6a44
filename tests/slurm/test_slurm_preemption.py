"""A SIGTERM to the whole SLURM job ends with a checkpoint of the step in flight, and the job
resumes.

Three ways clusters send it, on a real one-node cluster with KillWait=30 and a preemptable
partition (PreemptMode=REQUEUE, GraceTime=60): a plain `scancel` (every step and the batch shell,
SIGKILL after KillWait), `scancel --full --signal=TERM` (the batch shell's process group: srun
would SIGKILL the ranks if it got it), and preemption by a job in a higher-priority partition.
Each attempt: the job saves the step in flight, exit_status.json says 75, the checkpoint verifies,
the job is requeued (by finetune.sbatch; SLURM also allows it after `scancel`), resumes from that
checkpoint and finishes. `make check` runs one attempt of the preemption (test_sbatch.py sends TERM
and a plain scancel to a job too); `make faults` (FINETUNE_FAULTS_LONG=1) ten attempts of each.
"""

from __future__ import annotations

import json
import re
import sys
import time

import pytest

from finetune.metrics import read_metrics

from conftest import REPO, assert_verifies, child_env, last_logged_step, wait_until
from slurm_cluster import running_cluster

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "scripts" / "slurm" / "finetune.sbatch"
TIMEOUT = 300
TOTAL_STEPS = 14
PREEMPT_STEPS = 60  # the scheduler preempts on a later pass (~10 steps in, here): a longer run
SAMPLED = "preempt"  # the one way `make check` tries, once


def _cases() -> list:
    return [
        pytest.param(how, i, marks=[] if (how, i) == (SAMPLED, 0) else [pytest.mark.faults_long])
        for how in ("scancel", "full", "preempt")
        for i in range(10)
    ]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    yield from running_cluster(tmp_path_factory.mktemp("slurm"), grace_time=60, kill_wait=30)


def _signal(slurm, how: str, job: str, cwd) -> str | None:
    """Send the whole-job SIGTERM; returns the preempting job's id for "preempt"."""
    if how == "scancel":
        slurm.run("scancel", job)
    elif how == "full":
        slurm.run("scancel", "--full", "--signal=TERM", job)
    else:  # a job in the high-priority partition needs a core the low-priority job holds
        proc = slurm.run(
            "sbatch", "-p", "high", "-n1", "-o", "/dev/null", "--wrap", "sleep 1", cwd=cwd
        )
        return re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)
    return None


@pytest.mark.faults
@pytest.mark.parametrize("how,attempt", _cases())
def test_whole_job_sigterm_saves_the_step_in_flight_and_the_job_resumes(
    slurm, tmp_path, how, attempt, fault_record
):
    out = tmp_path / "out"
    partition = ["-p", "low"] if how == "preempt" else []
    total = PREEMPT_STEPS if how == "preempt" else TOTAL_STEPS
    proc = slurm.run(
        "sbatch",
        "-n2",
        *partition,
        str(SCRIPT),
        "--max_steps",
        str(total),
        "--logging_steps",
        "1",
        "--eval_steps",
        "100000",
        "--output_dir",
        str(out),
        env={**child_env(), "PYTHON": sys.executable},
        cwd=tmp_path,
    )
    job = re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)
    log = tmp_path / f"finetune-{job}.out"
    try:
        wait_until(lambda: last_logged_step(out) >= 2, TIMEOUT, "training to start", interval=0.2)
        before = last_logged_step(out)
        signalled = time.time()
        high = _signal(slurm, how, job, tmp_path)
        if high:  # preemption starts at the scheduler's next pass, not at the submission
            wait_until(
                lambda: log.exists() and "SIGTERM received" in log.read_text(),
                TIMEOUT,
                "the preemption's SIGTERM",
                interval=0.1,
            )
            waited = time.time() - signalled
            before, signalled = last_logged_step(out) - 1, time.time()  # the log may lag a step
            fault_record.update(preemption_after_s=round(waited, 1))

        def status():
            try:
                s = json.loads((out / "exit_status.json").read_text())
            except (OSError, ValueError):
                return None
            return s if s.get("run_id") == f"{job}.0" and s.get("exit_code") is not None else None

        st = wait_until(status, TIMEOUT, "exit_status.json of the signalled run", interval=0.1)
        exited = time.time()
        assert st["exit_code"] == 75, st
        assert exited - signalled < slurm.kill_wait, (
            "saved and exited before SLURM's SIGKILL could come"
        )
        step = int(st["checkpoint"].removeprefix("global_step"))
        # the first step boundary after the signal
        assert before <= step <= before + 2, (before, st)
        committed = (out / "latest").stat().st_mtime
        assert_verifies(out / st["checkpoint"])
        fault_record.update(
            time_to_exit_s=round(exited - signalled, 1),
            time_to_checkpoint_s=round(committed - signalled, 1),
        )
        print(
            f"{how} attempt {attempt}: SIGTERM at step {before}, committed global_step{step} "
            f"{committed - signalled:.1f} s and exit_status {exited - signalled:.1f} s "
            "after the signal"
        )

        # Requeued once (by the script; SLURM's own preemption requeue does not come on top of it),
        # resumed from exactly that checkpoint, finished.
        info = slurm.wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, TIMEOUT)
        text = log.read_text()
        assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, text[-4000:])
        assert text.count("requeueing job") == 1
        # "Resumed from …/global_stepN at step N"
        assert f"global_step{step} at step {step}" in text
        assert (out / "latest").read_text().strip() == f"global_step{total}"
        steps = [r["step"] for r in read_metrics(str(out)) if "loss" in r]
        assert sorted(set(steps)) == list(range(1, total + 1))
        if high:
            assert slurm.job(high)["JobState"] == "COMPLETED"
    finally:
        slurm.run("scancel", "--full", "--signal=KILL", job, check=False)
