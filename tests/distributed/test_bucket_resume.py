"""Resume with a bucket chooses by verification, with every node's view (finetune/remote/fetch.py,
finetune/checkpoint/resume.py), with real ranks and a real S3 server (SeaweedFS on loopback): a
damaged local copy of the newest commit is fetched again from the bucket, not passed over for an
older local one and not re-saved over the bucket's intact copy; an explicit s3:// checkpoint with a
damaged local copy downloads; a node whose OUT is gone fetches its share and resumes with the
others from the bucket's newest commit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from s3_server import require_s3

from finetune.io.remote import S3Storage

from conftest import BIN, REPO, Result, Running, child_env, finetune_cmd, free_port

pytestmark = pytest.mark.distributed
require_s3()  # skips the module without boto3 or the `weed` binary

BUCKET = "bresume"
TIMEOUT = 420
PREFIX = f"s3://{BUCKET}/shared"
NODES = f"s3://{BUCKET}/nodes"
SAVES = ("--save_checkpoint", "--save_steps", "2", "--logging_steps", "1")
NODE_LOCAL = str(REPO / "configs" / "ds_zero3_node_local.json")


def _save_id(remote: S3Storage, tag: str) -> str:
    return json.loads(remote.read_bytes(f"{tag}/manifest.json"))["save_id"]


def _resumed_from(out: Path) -> list[str]:
    events = [json.loads(line) for line in (out / "events.jsonl").open()]
    return [e["from"] for e in events if e["event"] == "resume"]


def _damage(folder: Path) -> None:
    """Flip 16 bytes in the middle of the checkpoint's first optimizer file."""
    path = sorted(folder.rglob("*optim_states.pt"))[0]
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    path.write_bytes(bytes(data))


def _set_aside(out: Path) -> list[str]:
    abandoned = out / ".abandoned"
    return sorted(p.name for p in abandoned.iterdir()) if abandoned.is_dir() else []


def _run(server, tmp: Path, out: Path, *flags: str) -> Result:
    cmd = finetune_cmd("deepspeed", 2, (*SAVES, "--remote_output_dir", PREFIX, *flags), out)
    return Running(cmd, tmp, child_env(server.env()), out).finish(TIMEOUT)


@pytest.fixture(scope="module")
def first(server, tmp_path_factory) -> Path:
    """4 steps on 2 ranks with a shared OUT, steps 2 and 4 saved to OUT and PREFIX; the OUT as it
    was then (each case resumes from a copy of it)."""
    tmp = tmp_path_factory.mktemp("first")
    r = _run(server, tmp, tmp / "out", "--max_steps", "4")
    assert r.returncode == 0, r.output[-6000:]
    assert sorted(p.name for p in (tmp / "out").glob("global_step*")) == [
        "global_step2",
        "global_step4",
    ]
    return tmp / "out"


def test_an_explicit_s3_checkpoint_with_a_damaged_local_copy_downloads(
    first, server, tmp_path, aws_env
):
    # First, and training no further: the bucket's step 4 stays the newest commit for the next case.
    remote = S3Storage(PREFIX)
    before = _save_id(remote, "global_step4")
    out = tmp_path / "out"
    shutil.copytree(first, out)
    _damage(out / "global_step4")
    r = _run(
        server,
        tmp_path,
        out,
        "--max_steps",
        "4",
        "--resume_from_checkpoint",
        f"{PREFIX}/global_step4",
    )
    assert r.returncode == 0, r.output[-6000:]
    assert _resumed_from(out) == ["global_step4"], r.output[-4000:]
    assert any(n.startswith("global_step4-unverified") for n in _set_aside(out)), _set_aside(out)
    local = json.loads((out / "global_step4" / "manifest.json").read_text())
    assert local["save_id"] == before == _save_id(remote, "global_step4")


def test_auto_fetches_a_damaged_newest_commit_from_the_bucket_and_keeps_its_copy_there(
    first, server, tmp_path, aws_env
):
    remote = S3Storage(PREFIX)
    before = _save_id(remote, "global_step4")
    out = tmp_path / "out"
    shutil.copytree(first, out)
    _damage(out / "global_step4")
    r = _run(server, tmp_path, out, "--max_steps", "6", "--resume_from_checkpoint", "auto")
    assert r.returncode == 0, r.output[-6000:]
    assert _resumed_from(out) == ["global_step4"], r.output[-4000:]
    assert f"fetched global_step4 from {PREFIX}" in r.output
    assert any(n.startswith("global_step4-unverified") for n in _set_aside(out)), _set_aside(out)
    local = json.loads((out / "global_step4" / "manifest.json").read_text())
    assert local["save_id"] == before
    assert _save_id(remote, "global_step4") == before, "the bucket's intact copy was replaced"


def _two_nodes(tmp: Path, *flags: str, env: dict) -> list[Result]:
    """A job on two torchrun "nodes" of one rank each, each its own node-local OUT."""
    port = str(free_port())
    runs = []
    for node in (0, 1):
        out = tmp / f"node{node}"
        cmd = [
            *(
                str(BIN / "torchrun"),
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "1",
            ),
            *("--master_addr", "127.0.0.1", "--master_port", port, "-m", "finetune"),
            *SAVES,
            *("--deepspeed_config", NODE_LOCAL, "--remote_output_dir", NODES),
            *(*flags, "--output_dir", str(out)),
        ]
        runs.append(Running(cmd, tmp, child_env(env), out))
    return [run.finish(TIMEOUT) for run in runs]


def test_a_replaced_node_fetches_its_share_and_resumes_with_the_others(server, tmp_path, aws_env):
    first = _two_nodes(tmp_path, "--max_steps", "4", env=server.env())
    assert all(r.returncode == 0 for r in first), first[0].output[-4000:] + first[1].output[-3000:]
    shutil.rmtree(tmp_path / "node1")  # node 1 replaced: a fresh disk
    again = _two_nodes(
        tmp_path, "--max_steps", "6", "--resume_from_checkpoint", "auto", env=server.env()
    )
    assert all(r.returncode == 0 for r in again), again[0].output[-4000:] + again[1].output[-3000:]
    assert _resumed_from(tmp_path / "node0") == ["global_step4"]
    manifest = json.loads((tmp_path / "node1" / "global_step4" / "manifest.json").read_text())
    assert manifest["ranks"] == [1], "node 1's share of the bucket's step 4"
    assert S3Storage(NODES).read_bytes("latest") == b"global_step6\n"
