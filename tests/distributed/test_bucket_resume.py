"""Resume with a bucket chooses by verification, with every node's view (finetune/remote/fetch.py,
finetune/checkpoint/resume.py), with real ranks and a real S3 server (SeaweedFS on loopback): a
damaged local copy of the newest commit is fetched again from the bucket, not passed over for an
older local one and not re-saved over the bucket's intact copy; an explicit s3:// checkpoint with a
damaged local copy downloads; a node that holds only an older step, or whose OUT is gone, fetches
its share and resumes with the others from the bucket's newest commit."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from s3_server import require_s3

from finetune.io.remote import S3Storage

from conftest import REPO, Result, Running, child_env, finetune_cmd, free_port, node_launcher

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
    # only the damaged file came down: the intact ones of that very save were kept
    fetched = rf"fetched global_step4 from {PREFIX} into \S+: 1 of \d+ files downloaded"
    assert re.search(fetched, r.output), r.output[-4000:]
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
            *node_launcher(node, port),
            *SAVES,
            *("--deepspeed_config", NODE_LOCAL, "--remote_output_dir", NODES),
            *(*flags, "--output_dir", str(out)),
        ]
        runs.append(Running(cmd, tmp, child_env(env), out))
    return [run.finish(TIMEOUT) for run in runs]


def _both_pass(runs: list[Result]) -> None:
    assert all(r.returncode == 0 for r in runs), runs[0].output[-4000:] + runs[1].output[-3000:]


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_a_node_with_an_older_step_or_none_fetches_its_share_and_resumes_with_the_others(
    server, tmp_path, aws_env
):
    remote = S3Storage(NODES)
    node0, node1 = tmp_path / "node0", tmp_path / "node1"  # events.jsonl: node 0's only
    _both_pass(_two_nodes(tmp_path, "--max_steps", "4", env=server.env()))
    step4 = _save_id(remote, "global_step4")
    # Node 1 holds only step 2 (an older disk); node 0 and the bucket hold step 4: every node's
    # view goes into the choice, so both resume from step 4, node 1 fetching its share of it.
    shutil.rmtree(node1 / "global_step4")
    auto = ("--resume_from_checkpoint", "auto")
    _both_pass(_two_nodes(tmp_path, "--max_steps", "6", *auto, env=server.env()))
    assert _resumed_from(node0) == ["global_step4"]
    assert _set_aside(node0) == [], "node 0's step 4 was set aside"
    assert _save_id(remote, "global_step4") == step4, "the bucket's step 4 was saved again"
    fetched = _manifest(node1 / "global_step4")
    assert (fetched["save_id"], fetched["ranks"]) == (step4, [1]), "node 1's share of step 4"
    assert _manifest(node1 / "global_step6")["parent_save_id"] == step4
    assert remote.read_bytes("latest") == b"global_step6\n"
    # Node 1 replaced: a fresh disk.
    shutil.rmtree(node1)
    _both_pass(_two_nodes(tmp_path, "--max_steps", "8", *auto, env=server.env()))
    assert _resumed_from(node0) == ["global_step4", "global_step6"]
    fetched = _manifest(node1 / "global_step6")
    step6 = _save_id(remote, "global_step6")
    assert (fetched["save_id"], fetched["ranks"]) == (step6, [1]), "node 1's share of step 6"
    assert _manifest(node1 / "global_step8")["parent_save_id"] == step6
    assert remote.read_bytes("latest") == b"global_step8\n"
