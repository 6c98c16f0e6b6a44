"""The bucket keeps one run's history (finetune/remote/lineage.py), with real ranks and a real S3
server (SeaweedFS on loopback): a new run on a prefix that holds another run's checkpoints is
refused before it writes there; a rollback on a fresh disk sets aside the timeline it leaves, so
that the next requeue's `auto` (another fresh disk) resumes the new timeline, not the old; and
retention in the bucket deletes only what the lineage wrote."""

from __future__ import annotations

import json

import pytest
from s3_server import require_s3

from finetune.io.remote import S3Storage

from conftest import Running, child_env, finetune_cmd

pytestmark = pytest.mark.distributed
# The refused run's exit 2 goes through DeepSpeed's launcher, which passes a rank's exit code on
# (torchrun reports any failure as 1); the others take torchrun, the cheaper launch.
require_s3()  # skips the module without boto3 or the `weed` binary

BUCKET = "lineage"
TIMEOUT = 420
PREFIX = f"s3://{BUCKET}/a"
SAVES = ("--save_checkpoint", "--save_steps", "2", "--logging_steps", "1")


def _objects(remote: S3Storage) -> dict[str, str]:
    """Every object under the prefix, by key, with its ETag."""
    pages = remote.client.get_paginator("list_objects_v2").paginate(
        Bucket=remote.uri.bucket, Prefix=remote.uri.key("")
    )
    return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}


def _save_id(remote: S3Storage, tag: str) -> str:
    return json.loads(remote.read_bytes(f"{tag}/manifest.json"))["save_id"]


@pytest.fixture(scope="module")
def run_a(server, tmp_path_factory):
    """Run A: 6 steps on 2 ranks, saving steps 2, 4 and 6 to PREFIX."""
    tmp = tmp_path_factory.mktemp("run-a")
    cmd = finetune_cmd(
        "forked", 2, ("--max_steps", "6", *SAVES, "--remote_output_dir", PREFIX), tmp / "out"
    )
    r = Running(cmd, tmp, child_env(server.env()), tmp / "out").finish(TIMEOUT)
    assert r.returncode == 0, r.output[-6000:]
    return r


def test_a_new_run_on_a_prefix_with_another_runs_checkpoints_is_exit_2_and_writes_nothing(
    run_a, server, run_finetune, tmp_path, aws_env
):
    remote = S3Storage(PREFIX)
    before = {k: v for k, v in _objects(remote).items() if not k.endswith("/lease.json")}
    b = run_finetune(
        "--max_steps",
        "4",
        *SAVES,
        "--learning_rate",
        "3e-3",
        "--remote_output_dir",
        PREFIX,
        out_dir=tmp_path / "b",
        nprocs=1,
        env=server.env(),
        timeout=TIMEOUT,
    )
    assert b.returncode == 2, b.output[-6000:]
    assert (
        f"--remote_output_dir {PREFIX} holds another run's checkpoints (newest global_step6)"
        in b.output
    )
    after = {k: v for k, v in _objects(remote).items() if not k.endswith("/lease.json")}
    assert after == before, "the refused run changed the bucket"
    assert not list((tmp_path / "b").glob("global_step*"))


def test_a_rollback_on_a_fresh_disk_is_where_the_next_auto_requeue_resumes(
    run_a, server, run_finetune, tmp_path, aws_env
):
    remote = S3Storage(PREFIX)
    abandoned = _save_id(remote, "global_step6")
    remote.write_bytes("global_step1/notes.txt", b"a person's folder, not finetune's")
    # a fresh disk, rolled back to step 2; saves step 4 again, then is preempted (the run ends)
    back = run_finetune(
        "--max_steps",
        "4",
        *SAVES,
        "--remote_output_dir",
        PREFIX,
        "--resume_from_checkpoint",
        f"{PREFIX}/global_step2",
        out_dir=tmp_path / "rollback",
        env=server.env(),
        timeout=TIMEOUT,
    )
    assert back.returncode == 0, back.output[-6000:]
    assert "a timeline this resume leaves: global_step4-" in back.output
    assert remote.read_bytes("global_step6/manifest.json") is None, "step 6 is set aside"
    assert remote.read_bytes(f".abandoned/global_step6-{abandoned}/manifest.json") is not None
    # retention after the new commit deleted nothing it did not write; what it wrote says so
    assert remote.read_bytes("global_step1/notes.txt") is not None
    lineage = json.loads(remote.read_bytes("global_step4/manifest.json"))["lineage"]
    assert remote.head("global_step4/trainer_state.json")["Metadata"]["lineage"] == lineage
    new_four = _save_id(remote, "global_step4")
    assert (
        new_four
        == json.loads((tmp_path / "rollback" / "global_step4" / "manifest.json").read_text())[
            "save_id"
        ]
    )
    # the requeue: another fresh disk, `auto`
    again = run_finetune(
        "--max_steps",
        "6",
        *SAVES,
        "--remote_output_dir",
        PREFIX,
        "--resume_from_checkpoint",
        "auto",
        out_dir=tmp_path / "requeue",
        env=server.env(),
        timeout=TIMEOUT,
    )
    assert again.returncode == 0, again.output[-6000:]
    fetched = json.loads((tmp_path / "requeue" / "global_step4" / "manifest.json").read_text())
    assert fetched["save_id"] == new_four, "auto went back to the abandoned timeline"
    events = [json.loads(line) for line in (tmp_path / "requeue" / "events.jsonl").open()]
    assert [e["from"] for e in events if e["event"] == "resume"] == ["global_step4"]
    # its own step 6 is committed in the bucket, above the set-aside one
    six = json.loads(remote.read_bytes("global_step6/manifest.json"))
    assert six["save_id"] != abandoned and six["lineage"] == fetched["lineage"]
