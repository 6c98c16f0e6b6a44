"""scripts/slurm/finetune.sbatch's cap on requeues for a bucket unreachable at start, as a shell
unit: the real script run by bash outside SLURM, with an `srun` that stands for the ranks (it
writes OUT/exit_status.json and exits 75, as a start that waited for the bucket in vain does) and
an `scontrol` that records the requeues. A real SLURM job per start would cost a cluster and
minutes a test; the path from an unreachable bucket to exit 75 is tests/distributed/
test_remote_outage.py's, the requeue itself tests/slurm/test_sbatch.py's."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "scripts" / "slurm" / "finetune.sbatch"
JOB = "4242"
DEFAULT_CAP = 5  # the script's MAX_REMOTE_REQUEUES when unset, as docs/CLUSTERS.md states it

SRUN = """#!/usr/bin/env bash
# the ranks' end: exit_status.json as run.py writes it, for this launch's run id
printf '{"exit_code": 75, "reason": "%s", "run_id": "%s"}\\n' "$FAKE_REASON" "$FINETUNE_RUN_ID" \\
    > "$FAKE_OUT/exit_status.json"
exit 75
"""
SCONTROL = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
"""


@pytest.fixture
def job(tmp_path):
    """Start the script once per call, as SLURM would start the same job again after a requeue:
    (the reason the ranks give) → (exit code, stderr, whether it requeued)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    out, log = tmp_path / "out", tmp_path / "scontrol.log"
    starts = []

    def start(reason: str, **env: str) -> tuple[int, str, bool]:
        log.write_text("")
        proc = subprocess.run(
            ["bash", str(SCRIPT), "--output_dir", str(out)],
            cwd=tmp_path,
            env={
                **os.environ,
                "PATH": f"{bin_dir}:{os.environ['PATH']}",
                "PYTHON": sys.executable,
                "SLURM_JOB_ID": JOB,
                "SLURM_RESTART_COUNT": str(len(starts)),
                "SLURM_JOB_NODELIST": "localhost",
                "MASTER_ADDR": "127.0.0.1",
                "PROCS_PER_NODE": "1",
                "FAKE_REASON": reason,
                "FAKE_OUT": str(out),
                "FAKE_LOG": str(log),
                **env,
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
        starts.append(reason)
        requeued = f"requeue {JOB}" in log.read_text().splitlines()
        return proc.returncode, proc.stderr, requeued

    start.counter = tmp_path / f".finetune-{JOB}.remote-unavailable"
    start.out = out
    return start


def test_an_unreachable_bucket_is_requeued_at_most_the_cap_in_a_row(job):
    cap = {"MAX_REMOTE_REQUEUES": "2"}
    for n in (1, 2):
        code, err, requeued = job("remote unavailable", **cap)
        assert (code, requeued) == (75, True), err
        assert job.counter.read_text().strip() == str(n)
    code, err, requeued = job("remote unavailable", **cap)
    assert (code, requeued) == (75, False), err
    assert "unreachable at 3 starts in a row (MAX_REMOTE_REQUEUES=2)" in err
    assert not job.counter.exists()  # the job ends: nothing left behind


def test_a_start_that_gets_past_the_bucket_starts_the_count_again(job):
    cap = {"MAX_REMOTE_REQUEUES": "1"}
    for reason, requeued in (
        ("remote unavailable", True),
        ("preempted", True),  # preemptions are never capped, and end the run of outages
        ("remote unavailable", True),
        ("remote unavailable", False),
    ):
        code, err, did = job(reason, **cap)
        assert (code, did) == (75, requeued), (reason, err)
        if reason == "preempted":
            assert not job.counter.exists()
    status = json.loads((job.out / "exit_status.json").read_text())
    assert status["run_id"] == f"{JOB}.3"  # the script's run id for the fourth start


def test_the_documented_cap_is_the_scripts():
    docs = (REPO / "docs" / "CLUSTERS.md").read_text()
    assert f"MAX_REMOTE_REQUEUES` (default {DEFAULT_CAP})" in docs
    assert f"MAX_REMOTE_REQUEUES=${{MAX_REMOTE_REQUEUES:-{DEFAULT_CAP}}}" in SCRIPT.read_text()
