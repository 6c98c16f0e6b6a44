"""scripts/launch.sh as a user runs it: picks the launcher, logs to OUT/logs, forwards signals,
keeps 75."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import (
    REPO,
    Running,
    assert_verifies,
    child_env,
    free_port,
    last_logged_step,
    wait_until,
)

pytestmark = pytest.mark.distributed

LAUNCH = str(REPO / "scripts" / "launch.sh")
TIMEOUT = 300


def _env() -> dict:
    return {**child_env(), "PYTHON": sys.executable}


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_sigterm_to_launch_sh_commits_and_exits_75(tmp_path, launcher):
    out = tmp_path / "out"
    run = Running(
        [
            LAUNCH,
            "--launcher",
            launcher,
            "--nproc",
            "2",
            "--master_port",
            str(free_port()),
            "--max_steps",
            "3000",
            "--logging_steps",
            "1",
            "--eval_steps",
            "100000",
            "--save_checkpoint",
            # Steps of ~0.3 s: longer than launch.sh takes to find the ranks (a pgrep/ps walk), so
            # "the step in flight" below means the step the signal arrived in (at 32 a step took
            # ~0.1 s on a 2-core AMD EPYC, and the walk outlasted two of them).
            "--per_device_train_batch_size",
            "96",
            "--output_dir",
            str(out),
        ],
        tmp_path,
        _env(),
        out,
    )
    wait_until(lambda: last_logged_step(out) >= 3, TIMEOUT, "three logged steps")
    before = last_logged_step(out)
    os.kill(run.proc.pid, signal.SIGTERM)  # the script only, as `kill <pid>` or a scheduler would
    result = run.finish(TIMEOUT)
    assert result.returncode == 75, result.output[-4000:]  # even through torchrun, which says 1
    tag = (out / "latest").read_text().strip()
    assert before <= int(tag.removeprefix("global_step")) <= before + 2
    logs = list((out / "logs").glob("launch-*.log"))
    assert len(logs) == 1 and "forwarding to ranks" in logs[0].read_text()
    assert "Finished saving the checkpoint" in logs[0].read_text()
    assert_verifies(out / tag)


def test_launch_sh_rejects_bad_options_before_starting(tmp_path):
    for args, message in (
        (["--launcher", "mpirun"], "--launcher must be deepspeed or torchrun"),
        (["--nproc", "0"], "--nproc must be a positive integer"),
        (["--hostfile", "nope"], "--hostfile: file not found: nope"),
    ):
        proc = subprocess.run(
            [LAUNCH, *args, "--output_dir", "out"],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert not (tmp_path / "out").exists()
