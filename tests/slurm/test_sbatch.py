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


def _submit(slurm, cwd, script: str, sbatch_opts: list[str], flags: list[str], wait: bool):
    """sbatch -n2 [opts] scripts/slurm/<script> [flags]; returns (job id, sbatch's
    CompletedProcess)."""
    proc = slurm.run(
        "sbatch",
        *(["--wait"] if wait else []),
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
    return m.group(1), proc


def test_multinode_script_on_one_node_trains_and_commits(slurm, tmp_path):
    """The multi-node file (it runs finetune.sbatch from beside itself) with -N1 -n2."""
    out = tmp_path / "out"
    job, proc = _submit(
        slurm,
        tmp_path,
        "finetune-multinode.sbatch",
        ["-N1"],
        ["--max_steps", "4", "--logging_steps", "1", "--output_dir", str(out)],
        wait=True,
    )
    log = (tmp_path / f"finetune-{job}.out").read_text()
    assert proc.returncode == 0, log[-4000:]
    assert "1 node(s) x 2 process(es)" in log
    assert (out / "latest").read_text().strip() == "global_step4"
    assert_verifies(out / "global_step4")
    state = json.loads((out / "global_step4" / "trainer_state.json").read_text())
    assert state["world_size"] == 2  # two srun tasks became two ranks
    assert (out / "logs" / f"slurm-{job}.log").stat().st_size > 0
    assert json.loads((out / "exit_status.json").read_text())["run_id"] == f"{job}.0"


def test_preempted_job_saves_requeues_itself_and_finishes(slurm, tmp_path):
    """TERM (as on preemption) and then USR1 (the time-limit warning) each cost at most one step."""
    out = tmp_path / "out"
    total = 160
    job, _ = _submit(
        slurm,
        tmp_path,
        "finetune.sbatch",
        [],
        [
            "--max_steps",
            str(total),
            "--logging_steps",
            "1",
            "--eval_steps",
            "100000",
            "--output_dir",
            str(out),
        ],
        wait=False,
    )
    preempted_at = []
    for restart, sig in ((0, "TERM"), (1, "USR1")):
        # Training (not just started) in this incarnation of the job: past the last preemption's
        # step.
        floor = preempted_at[-1] if preempted_at else 0
        wait_until(
            lambda restart=restart, floor=floor: (
                slurm.job(job).get("Restarts") == str(restart)
                and last_logged_step(out) >= floor + 3
            ),
            JOB_TIMEOUT,
            f"restart {restart} to train",
            interval=0.2,
        )
        before = last_logged_step(out)
        slurm.run("scancel", f"--signal={sig}", job)
        # The job requeues itself: it comes back with one more restart.
        wait_until(
            lambda restart=restart: int(slurm.job(job).get("Restarts", "0")) > restart,
            JOB_TIMEOUT,
            f"the job to requeue after SIG{sig}",
            interval=0.5,
        )
        status = json.loads((out / "exit_status.json").read_text())
        assert status["exit_code"] == 75 and status["run_id"] == f"{job}.{restart}", status
        step = int(status["checkpoint"].removeprefix("global_step"))
        assert before <= step <= before + 2  # the first step boundary after the signal
        assert_verifies(out / status["checkpoint"])
        preempted_at.append(step)
    info = slurm.wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, JOB_TIMEOUT)
    log = (tmp_path / f"finetune-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-4000:]
    assert log.count("requeueing job") == 2
    for step in preempted_at:
        assert f"global_step{step} at step {step}" in log  # "Resumed from …/global_stepN at step N"
    assert (out / "latest").read_text().strip() == f"global_step{total}"
    # One continuous run: every step trained once after its checkpoint, none skipped.
    steps = [r["step"] for r in read_metrics(str(out)) if "loss" in r]
    assert sorted(set(steps)) == list(range(1, total + 1))


def test_time_limit_warning_saves_and_the_requeued_job_resumes(slurm, tmp_path):
    """The real warning: --time=2 --signal=USR1@50 (slurmctld sends it 40-70 s in, its timer
    granularity), to a job that would train far longer. It saves, requeues, and the next run
    resumes."""
    out = tmp_path / "out"
    job, _ = _submit(
        slurm,
        tmp_path,
        "finetune.sbatch",
        ["--time=2", "--signal=USR1@50"],
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
        wait=False,
    )
    log = tmp_path / f"finetune-{job}.out"
    wait_until(
        lambda: int(slurm.job(job).get("Restarts", "0")) >= 1,
        JOB_TIMEOUT,
        "the warning and the requeue",
        interval=1,
    )
    text = log.read_text()
    m = re.search(r"preempted \(SIGUSR1 on rank \d[^)]*\): committed (\S+)/global_step(\d+);", text)
    assert m, text[-4000:]
    step = int(m.group(2))
    assert step > 0 and "requeueing job" in text
    assert_verifies(out / f"global_step{step}")
    # The requeued run (a new time limit) continues from exactly that checkpoint; then stop it.
    wait_until(
        lambda: f"global_step{step} at step {step}" in log.read_text(), JOB_TIMEOUT, "the resume"
    )
    wait_until(lambda: last_logged_step(out) > step, JOB_TIMEOUT, "a step after the resume")
    # Stopping for good, as docs/CLUSTERS.md says: a plain scancel saves and requeues
    # (test_preemption.py); a scancel of the pending job ends it.
    slurm.run("scancel", job)
    wait_until(
        lambda: int(slurm.job(job).get("Restarts", "0")) >= 2,
        120,
        "the requeue after scancel",
        interval=0.5,
    )
    slurm.run("scancel", job)
    slurm.wait_for_state(job, {"CANCELLED", "COMPLETED", "FAILED"}, 120)


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
