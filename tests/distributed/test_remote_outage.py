"""A bucket that does not answer at start, through the CLI as a job runs it: a restart (its output
dir shows the prefix was used, or the job is a requeue) waits for it FINETUNE_REMOTE_WAIT_S, then
exits 75 with exit_status.json reason "remote unavailable", so the job script requeues it; a first
start with that endpoint is exit 2. The endpoint is a loopback port nothing listens on."""

from __future__ import annotations

import json

import pytest
from s3_server import free_ports

from finetune import run_config
from finetune.cli import parse_train_args

pytestmark = pytest.mark.distributed
# Exit 75 through DeepSpeed's launcher, which passes a rank's exit code on (torchrun reports 1).
pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")

PREFIX = "s3://ckpt/outage"
WAIT_S = 3
TIMEOUT = 300
FLAGS = ("--max_steps", "2", "--save_checkpoint", "--resume_from_checkpoint", "auto")


def down(**extra: str) -> dict[str, str]:
    """An endpoint nothing listens on, test credentials, and the short wait."""
    return {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_ports(1)[0]}",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_DEFAULT_REGION": "us-east-1",
        "FINETUNE_REMOTE_WAIT_S": str(WAIT_S),
        **extra,
    }


def assert_requeued(result, run_id: str) -> None:
    assert result.returncode == 75, result.output[-6000:]
    status = json.loads((result.out_dir / "exit_status.json").read_text())
    assert status["exit_code"] == 75 and status["reason"] == "remote unavailable", status
    assert status["during"] == "start-up" and status["run_id"] == run_id, status
    # gave up after the test's wait, not the default's; nothing trained, nothing saved
    assert f"still unreachable after {WAIT_S} s" in status["error"], status
    assert not (result.out_dir / "metrics.jsonl").exists()
    assert not list(result.out_dir.glob("global_step*"))


def test_a_restart_that_finds_the_bucket_down_exits_75_after_the_wait(run_finetune, tmp_path):
    """Two ranks; the output dir holds the previous run's run_config.yaml naming the prefix (its
    local checkpoints gone with the node): every rank's probe fails alike, every rank waits,
    every rank exits 75."""
    out = tmp_path / "out"
    out.mkdir()
    earlier = parse_train_args([*FLAGS, "--output_dir", str(out), "--remote_output_dir", PREFIX])
    run_config.write(earlier, str(out), "test")
    result = run_finetune(
        *FLAGS,
        "--remote_output_dir",
        PREFIX,
        env=down(FINETUNE_RUN_ID="restart-1"),
        timeout=TIMEOUT,
    )
    assert_requeued(result, "restart-1")
    assert f"--remote_output_dir {PREFIX}: cannot write there" in result.output


def test_a_requeued_job_resuming_from_the_bucket_exits_75_when_it_is_down(run_finetune, tmp_path):
    """A SLURM requeue on a fresh disk (nothing in OUT), resuming an explicit s3:// checkpoint:
    resume's look into the bucket waits, then exits 75."""
    result = run_finetune(
        "--max_steps",
        "2",
        "--save_checkpoint",
        "--resume_from_checkpoint",
        f"{PREFIX}/global_step2",
        launcher="python",
        nprocs=1,
        timeout=TIMEOUT,
        env=down(SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="1", FINETUNE_RUN_ID="4242.1"),
    )
    assert_requeued(result, "4242.1")
    assert "--resume_from_checkpoint" in result.output


def test_a_first_start_with_a_wrong_endpoint_is_exit_2_at_once(run_finetune):
    result = run_finetune(
        *FLAGS,
        "--remote_output_dir",
        PREFIX,
        launcher="python",
        nprocs=1,
        env=down(),
        timeout=TIMEOUT,
    )
    assert result.returncode == 2, result.output[-6000:]
    errors = [ln for ln in result.output.splitlines() if "finetune: error:" in ln]
    assert errors and all(f"--remote_output_dir {PREFIX}: cannot write there" in e for e in errors)
    assert "a restart waits" not in result.output
    assert not (result.out_dir / "exit_status.json").exists()
