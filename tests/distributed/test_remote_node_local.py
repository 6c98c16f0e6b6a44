"""Two "nodes" with no shared filesystem (torchrun --nnodes 2 on loopback, each its own node-local
--output_dir) and one bucket (SeaweedFS on loopback): each node's leader uploads its node's
manifest, rank 0 commits the merged one; after a kill -9 of the whole job and both local folders
deleted, the next run resumes from the bucket at the same world size (bit for bit against an
uninterrupted run), and a run on one node resumes from it through the universal format."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from s3_server import require_s3

from finetune.io.remote import S3Storage

from conftest import (
    REPO,
    Running,
    child_env,
    finetune_cmd,
    free_port,
    node_launcher,
    wait_until,
)

pytestmark = pytest.mark.distributed
require_s3()  # skips the module without boto3 or the `weed` binary

TIMEOUT = 420
BUCKET = "nodes"
URI = f"s3://{BUCKET}/job"
CONFIG = str(REPO / "configs" / "ds_zero3_node_local.json")
# a constant learning rate: a run resumed at step K trains the steps an uninterrupted one does
COMMON = (
    "--logging_steps",
    "1",
    "--eval_steps",
    "100000",
    "--save_checkpoint",
    "--save_steps",
    "2",
    "--lr_scheduler_type",
    "constant",
    "--deepspeed_config",
    CONFIG,
)


def start_two_nodes(tmp_path, name: str, *flags: str, env: dict) -> list[Running]:
    port = str(free_port())
    runs = []
    for node in (0, 1):
        out = tmp_path / f"{name}-node{node}"
        cmd = [*node_launcher(node, port), *COMMON, *flags, "--output_dir", str(out)]
        runs.append(Running(cmd, tmp_path, child_env(env), out))
    return runs


def losses(out) -> dict[int, float]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def verify(uri: str, *flags: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "finetune", "verify", uri, *flags],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_two_nodes_without_shared_storage_resume_from_the_bucket(server, tmp_path, monkeypatch):
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    env = server.env()
    reference = [
        r.finish(TIMEOUT)
        for r in start_two_nodes(tmp_path, "reference", "--max_steps", "8", env=env)
    ]
    assert all(r.returncode == 0 for r in reference), reference[0].output[-4000:]
    want = losses(reference[0].out_dir)

    # Killed (-9, the whole job) once the bucket holds a commit; saves slowed so that it is early.
    first = start_two_nodes(
        tmp_path,
        "job",
        "--max_steps",
        "8",
        "--remote_output_dir",
        URI,
        env=server.env(FINETUNE_SLOW_SAVE="0.3"),
    )
    remote = S3Storage(URI)
    wait_until(lambda: remote.read_bytes("latest"), TIMEOUT, "a first commit in the bucket")
    for run in first:
        run.kill()
    latest = remote.read_bytes("latest").decode().strip()
    step = int(latest.removeprefix("global_step"))
    assert step < 8, "killed before the end"
    full = verify(URI, "--full", env=env)
    assert full.returncode == 0 and full.stdout.startswith(f"OK {URI}/{latest}: "), full
    manifest = json.loads(remote.read_bytes(f"{latest}/manifest.json"))
    assert manifest["world_size"] == 2 and "ranks" not in manifest, "the merged manifest"
    assert {n for n in manifest["files"] if n.startswith("zero_pp_rank_")} == {
        f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"
        for r in (0, 1)
        for kind in ("model", "optim")
    }
    for run in first:  # the nodes' disks are gone
        shutil.rmtree(run.out_dir)

    again = [
        r.finish(TIMEOUT)
        for r in start_two_nodes(
            tmp_path,
            "job",
            "--max_steps",
            "8",
            "--resume_from_checkpoint",
            "auto",
            "--remote_output_dir",
            URI,
            env=env,
        )
    ]
    assert all(r.returncode == 0 for r in again), again[0].output[-6000:] + again[1].output[-3000:]
    assert f"fetched {latest} from {URI}" in again[0].output
    for node, run in enumerate(again):
        local = json.loads((run.out_dir / latest / "manifest.json").read_text())
        assert local["ranks"] == [node] and local["save_id"] == manifest["save_id"]
    got = losses(again[0].out_dir)
    assert sorted(got) == list(range(step + 1, 9))
    assert all(got[s] == want[s] for s in got), (got, want)  # bit for bit on CPU
    assert remote.read_bytes("latest") == b"global_step8\n"
    assert verify(URI, "--full", env=env).returncode == 0

    # One node: a shared --output_dir on 1 rank, from the bucket, through the universal format.
    one = tmp_path / "one"
    cmd = finetune_cmd(
        "forked",
        1,
        (
            "--max_steps",
            "10",
            "--save_checkpoint",
            "--logging_steps",
            "1",
            "--resume_from_checkpoint",
            f"{URI}/global_step8",
        ),
        one,
    )
    r = Running(cmd, tmp_path, child_env(env), one).finish(TIMEOUT)
    assert r.returncode == 0, r.output[-6000:]
    assert "universal" in r.output and sorted(losses(one)) == [9, 10], r.output[-3000:]
    # One node with node-local storage (a smaller allocation, its own empty disk): the whole
    # checkpoint is fetched there (not a node's cut), converted there, and resumed.
    local = tmp_path / "one-local"
    cmd = finetune_cmd(
        "forked",
        1,
        (
            "--max_steps",
            "10",
            "--save_checkpoint",
            "--logging_steps",
            "1",
            "--deepspeed_config",
            CONFIG,
            "--resume_from_checkpoint",
            "auto",
            "--remote_output_dir",
            URI,
        ),
        local,
    )
    r = Running(cmd, tmp_path, child_env(env), local).finish(TIMEOUT)
    assert r.returncode == 0, r.output[-6000:]
    fetched = json.loads((local / "global_step8" / "manifest.json").read_text())
    assert "ranks" not in fetched and fetched["world_size"] == 2, "the whole checkpoint"
    assert (local / "global_step8" / "universal").is_dir() and sorted(losses(local)) == [9, 10]
    assert remote.read_bytes("latest") == b"global_step10\n"
