"""scripts/slurm/*.sbatch, and the SLURM example in docs/CLUSTERS.md, on a real one-node SLURM
cluster the tests start."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from finetune.metrics import read_metrics

from conftest import REPO, assert_verifies, child_env, last_logged_step, wait_until
from slurm_cluster import running_cluster

pytestmark = pytest.mark.distributed

SCRIPTS = REPO / "scripts" / "slurm"
JOB_TIMEOUT = 420


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    yield from running_cluster(tmp_path_factory.mktemp("slurm"))


def _job_env() -> dict:
    # sbatch exports the submitting environment (as a user's activated venv would be).
    return {**child_env(), "PYTHON": sys.executable}


def _submit(slurm, cwd, script: str, sbatch_opts: list[str], flags: list[str]) -> str:
    """sbatch -n2 [opts] scripts/slurm/<script> [flags]; returns the job id."""
    proc = slurm.run(
        "sbatch",
        "-n2",
        *sbatch_opts,
        str(SCRIPTS / script),
        *flags,
        check=False,
        env=_job_env(),
        timeout=JOB_TIMEOUT,
        cwd=cwd,
    )
    m = re.search(r"Submitted batch job (\d+)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    return m.group(1)


def test_multinode_script_on_one_node_trains_and_commits(slurm, tmp_path):
    """The multi-node file (it runs finetune.sbatch from beside itself) with -N1 -n2."""
    out = tmp_path / "out"
    job = _submit(
        slurm,
        tmp_path,
        "finetune-multinode.sbatch",
        ["-N1"],
        ["--max_steps", "4", "--logging_steps", "1", "--output_dir", str(out)],
    )
    # polled every second: `sbatch --wait` polls at growing intervals (it returned ~30 s after
    # this ~10 s job had ended)
    info = slurm.wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, JOB_TIMEOUT)
    log = (tmp_path / f"finetune-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-4000:]
    assert "1 node(s) x 2 process(es)" in log
    assert (out / "latest").read_text().strip() == "global_step4"
    assert_verifies(out / "global_step4")
    state = json.loads((out / "global_step4" / "trainer_state.json").read_text())
    assert state["world_size"] == 2  # two srun tasks became two ranks
    assert (out / "logs" / f"slurm-{job}.log").stat().st_size > 0
    assert json.loads((out / "exit_status.json").read_text())["run_id"] == f"{job}.0"


def _seconds(runtime: str) -> int:
    """scontrol's RunTime ([D-]HH:MM:SS) in seconds."""
    days, _, hms = runtime.rpartition("-")
    h, m, sec = (int(x) for x in hms.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + sec


def test_preemption_time_limit_warning_and_scancel_each_save_requeue_and_resume(slurm, tmp_path):
    """One job, three starts, each ended a different way, each costing at most one step: TERM sent
    by hand (as on preemption), a plain scancel, then the real time-limit warning
    (--signal=USR1@110; the limit is set once the third start trains, so that a slow start-up
    cannot meet the warning before its first step; slurmctld sends it at its next check of time
    limits). Each saves, exits 75, the job requeues itself, and the next start resumes from
    exactly that checkpoint: every step is trained once, none skipped. (A USR1 sent by hand
    reaches the ranks as the warning's does, to the job's steps: the warning is that case;
    tests/distributed/test_preemption.py sends SIGUSR1 to a rank by hand.)"""
    out = tmp_path / "out"
    job = _submit(
        slurm,
        tmp_path,
        "finetune.sbatch",
        ["--signal=USR1@110"],
        [
            "--max_steps",
            "100000",
            "--logging_steps",
            "1",
            "--eval_steps",
            "1000000",
            "--output_dir",
            str(out),
        ],
    )
    log = tmp_path / f"finetune-{job}.out"
    preempted_at: list[int] = []

    def train_past_the_last_checkpoint(restart: int) -> int:
        floor = preempted_at[-1] if preempted_at else 0
        wait_until(
            lambda: (
                slurm.job(job).get("Restarts") == str(restart)
                and last_logged_step(out) >= floor + 3
            ),
            JOB_TIMEOUT,
            f"restart {restart} to train",
            interval=0.2,
        )
        return last_logged_step(out)

    def requeued(restart: int, what: str) -> int:
        wait_until(
            lambda: int(slurm.job(job).get("Restarts", "0")) > restart,
            JOB_TIMEOUT,
            f"the job to requeue after {what}",
            interval=0.5,
        )
        status = json.loads((out / "exit_status.json").read_text())
        assert status["exit_code"] == 75 and status["run_id"] == f"{job}.{restart}", status
        assert_verifies(out / status["checkpoint"])
        return int(status["checkpoint"].removeprefix("global_step"))

    try:
        before = train_past_the_last_checkpoint(0)
        slurm.run("scancel", "--signal=TERM", job)
        step = requeued(0, "SIGTERM")
        assert before <= step <= before + 2  # the first step boundary after the signal
        preempted_at.append(step)
        # As docs/CLUSTERS.md says: a plain scancel saves and requeues (test_slurm_preemption.py
        # times it).
        train_past_the_last_checkpoint(1)
        slurm.run("scancel", job)
        preempted_at.append(requeued(1, "scancel"))
        # The time-limit warning, last, so that no start after it runs under the limit: a limit
        # 61-120 s past now (whole minutes) is within the warning's 110 s, so slurmctld sends it
        # at its next check of time limits (every 30 s), half a minute or more before the limit.
        before = train_past_the_last_checkpoint(2)
        ran = _seconds(slurm.job(job)["RunTime"])
        slurm.run("scontrol", "update", f"JobId={job}", f"TimeLimit={ran // 60 + 2}")
        step = requeued(2, "the time-limit warning")
        text = log.read_text()
        found = re.findall(
            r"preempted \(SIGUSR1 on rank \d[^)]*\): committed \S+/global_step(\d+);", text
        )
        assert found and int(found[-1]) == step > before, text[-4000:]
        preempted_at.append(step)
        # Stopping for good, as docs/CLUSTERS.md says: a scancel of the pending job ends it.
        slurm.run("scancel", job)
        slurm.wait_for_state(job, {"CANCELLED", "COMPLETED", "FAILED"}, 120)
    finally:
        slurm.run("scancel", "--full", "--signal=KILL", job, check=False)
    text = log.read_text()
    assert text.count("requeueing job") == 3, text[-4000:]
    for step in preempted_at[:-1]:
        assert (
            f"global_step{step} at step {step}" in text
        )  # "Resumed from …/global_stepN at step N"
    # One continuous run: every step trained once after its checkpoint, none skipped.
    steps = [r["step"] for r in read_metrics(str(out)) if "loss" in r]
    assert sorted(set(steps)) == list(range(1, max(steps) + 1)), steps
    assert max(steps) >= preempted_at[-1]


# --- docs/CLUSTERS.md's example, copied as written with only the flags changed -------------------

MARKER = "<!-- slurm-cpu-example"


def readme_example() -> str:
    text = (REPO / "docs" / "CLUSTERS.md").read_text()
    block = text[text.index(MARKER) :].split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(lines) == 1, lines
    return lines[0]


def test_readme_slurm_example_trains_and_commits(slurm, tmp_path):
    command = readme_example()
    assert "sbatch" in command and "scripts/slurm/finetune.sbatch" in command
    # Only finetune's flags change: fewer steps. The user's working directory has scripts/.
    command = re.sub(r"--max_steps \d+ --save_steps \d+", "--max_steps 6 --save_steps 3", command)
    (tmp_path / "scripts").symlink_to(REPO / "scripts")
    # as after `source .venv/bin/activate`
    env = slurm.env({**child_env(), "PYTHON": sys.executable})
    proc = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    job = re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)
    info = slurm.wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 420)
    # the log per job id, in the submit directory
    log = (tmp_path / f"finetune-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-4000:]
    assert "1 node(s) x 2 process(es)" in log
    out = tmp_path / "runs" / "slurm-demo"
    assert (out / "latest").read_text().strip() == "global_step6"
    assert sorted(p.name for p in out.glob("global_step*")) == ["global_step3", "global_step6"]
    state = json.loads((out / "global_step6" / "trainer_state.json").read_text())
    assert state["world_size"] == 2  # two srun tasks became two ranks
    assert_verifies(out / "global_step6")
    assert (out / "logs" / f"slurm-{job}.log").stat().st_size > 0
    assert json.loads((out / "exit_status.json").read_text())["run_id"] == f"{job}.0"
