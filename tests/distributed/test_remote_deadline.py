"""Every wait of the copy to --remote_output_dir has a deadline, and its end a reason: 2 real ranks
(independent processes: no launcher kills a rank left hanging, so one shows as a hang) against a
real S3 server (SeaweedFS on loopback), --ddp_timeout 20. An upload that hangs for good on rank 0
(the thread asleep, as in D-state) and an upload that fails every try on rank 1 each end the run
with exit 1 on both ranks, exit_status.json's reason naming the bucket copy (not a crash) and the
final checkpoint committed in OUT; the ranks exit past the stuck thread."""

from __future__ import annotations

import json

import pytest
from faults.harness import DDP_TIMEOUT, Ranks, output_dir_problems, run_ranks, train_args
from s3_server import require_s3

from finetune.exit_status import REMOTE_COPY_FAILED
from finetune.io import seams

pytestmark = pytest.mark.distributed
require_s3()  # skips the module without boto3 or the `weed` binary

BUCKET = "deadlines"
STEPS = 4  # a save every step; the fault at the final one's copy


def run(tmp_path, aws_env, name: str, **env: str) -> Ranks:
    args = train_args(STEPS, "--remote_output_dir", f"s3://{BUCKET}/{name}")
    return run_ranks(tmp_path, 2, args, tmp_path / "out", aws_env.env(**env))


def check_kept_locally(r: Ranks, name: str) -> dict:
    """Both ranks exit 1; exit_status.json names the copy; OUT's final checkpoint committed and
    intact; never committed in the bucket. Returns exit_status.json."""
    from finetune.io.remote import S3Storage

    assert r.codes == [1, 1], r.output[-6000:]
    status = json.loads((r.out_dir / "exit_status.json").read_text())
    assert status["exit_code"] == 1 and status["reason"] == REMOTE_COPY_FAILED, status
    assert status["checkpoint"] == f"global_step{STEPS}" and status["step"] == STEPS, status
    assert (r.out_dir / "latest").read_text().strip() == f"global_step{STEPS}"
    assert not output_dir_problems(r.out_dir), output_dir_problems(r.out_dir)
    remote = S3Storage(f"s3://{BUCKET}/{name}")
    assert remote.read_bytes(f"global_step{STEPS}/manifest.json") is None
    assert remote.read_bytes("latest") != f"global_step{STEPS}\n".encode()
    return status


def test_a_hung_upload_ends_the_run_with_exit_1_naming_the_copy(tmp_path, aws_env):
    r = run(tmp_path, aws_env, "hung", **{seams.FAULT: f"remote.upload:0:{STEPS}:hang"})
    fired = r.fired("remote.upload")
    assert fired, r.output[-6000:]
    status = check_kept_locally(r, "hung")
    assert status["error"].startswith(
        f"remote copy of global_step{STEPS} did not finish: no progress for {DDP_TIMEOUT} s "
        f"(rank 0: uploading global_step{STEPS}/"
    ), status
    # given up at the deadline, and no rank's exit waits for the thread still asleep
    assert r.exited_by() - fired[0] < DDP_TIMEOUT + 20, r.exited_by() - fired[0]


def test_an_upload_that_fails_every_try_ends_the_run_with_exit_1_naming_the_copy(tmp_path, aws_env):
    fault = {seams.FAULT: f"remote.upload:1:{STEPS}:eio", seams.REMOTE_RETRY_S: "0.1"}
    status = check_kept_locally(run(tmp_path, aws_env, "failing", **fault), "failing")
    assert status["error"].startswith(
        f"remote copy of global_step{STEPS} did not finish: 6 tries failed (rank 1: OSError: "
    ), status
