"""Node-local checkpoint storage: two "nodes" on loopback (torchrun --nnodes 2), each its own
OUT."""

from __future__ import annotations

import json

import pytest

from conftest import (
    REPO,
    Running,
    assert_verifies,
    child_env,
    finetune_cmd,
    free_port,
    node_launcher,
)

pytestmark = pytest.mark.distributed

TIMEOUT = 420
CONFIG = str(REPO / "configs" / "ds_zero3_node_local.json")
COMMON = [
    "--logging_steps",
    "1",
    "--eval_steps",
    "100000",
    "--save_checkpoint",
    "--save_steps",
    "2",
]


def _two_nodes(
    tmp_path,
    name: str,
    *flags: str,
    env: dict | None = None,
    swap: bool = False,
    expect: int = 0,
    config: str = CONFIG,
) -> list:
    """One torchrun per node (1 process each), same master, each node its own --output_dir
    (``swap``: each node gets the other's, as if the ranks had landed on the other nodes)."""
    port = str(free_port())
    runs = []
    for node in (0, 1):
        out = tmp_path / f"{name}-node{1 - node if swap else node}"
        cmd = [
            *node_launcher(node, port),
            "--deepspeed_config",
            config,
            *flags,
            "--output_dir",
            str(out),
        ]
        runs.append(Running(cmd, tmp_path, child_env(env), out))
    results = [r.finish(TIMEOUT) for r in runs]
    for r in results:
        assert r.returncode == expect, r.output[-4000:]
    return results


def test_each_node_commits_its_part_and_latest_waits_for_all(tmp_path):
    # Rank 1 (node 1) fails to write at step 4: node 0 wrote everything, and must not commit either.
    node0, node1 = _two_nodes(
        tmp_path,
        "run",
        *COMMON,
        "--max_steps",
        "6",
        env={"FINETUNE_FAULT": "save.write_rank_files:1:4"},
    )
    for node, result in enumerate((node0, node1)):
        out = result.out_dir
        assert sorted(p.name for p in out.glob("global_step*")) == ["global_step2", "global_step6"]
        assert (out / "latest").read_text().strip() == "global_step6"
        assert not (out / ".staging").exists() or not any((out / ".staging").iterdir())
        manifest = json.loads((out / "global_step6" / "manifest.json").read_text())
        assert manifest["world_size"] == 2 and manifest["ranks"] == [node]
        rank_files = sorted(p.name for p in (out / "global_step6").glob("zero_pp_rank_*"))
        assert rank_files == [
            f"zero_pp_rank_{node}_mp_rank_00_model_states.pt",
            f"zero_pp_rank_{node}_mp_rank_00_optim_states.pt",
        ]
        assert (out / "global_step6" / "trainer_state.json").exists()  # every node can resume alone
        assert_verifies(out / "global_step6")
    assert "save of global_step4 failed on rank 1" in node0.output
    # The ranks now land on each other's node: resuming must not silently start over.
    swapped = _two_nodes(
        tmp_path,
        "run",
        *COMMON,
        "--max_steps",
        "8",
        "--resume_from_checkpoint",
        "auto",
        swap=True,
        expect=1,
    )  # finetune exits 2; torchrun reports any failure as 1
    assert "no checkpoint verifies on every node" in swapped[0].output
    assert (node0.out_dir / "latest").read_text().strip() == "global_step6"  # nothing was written


def test_node_local_resume_matches_an_uninterrupted_run(tmp_path):
    first = _two_nodes(tmp_path, "resume", *COMMON, "--max_steps", "4")
    again = _two_nodes(
        tmp_path, "resume", *COMMON, "--max_steps", "6", "--resume_from_checkpoint", "auto"
    )
    assert "Resumed from" in again[0].output
    reference = _two_nodes(tmp_path, "reference", *COMMON, "--max_steps", "6")
    losses = {r["step"]: r["loss"] for r in again[0].metrics() if "loss" in r}
    want = {r["step"]: r["loss"] for r in reference[0].metrics() if "loss" in r}
    assert [losses[s] for s in (5, 6)] == [want[s] for s in (5, 6)]  # bitwise on CPU
    assert first[0].out_dir == again[0].out_dir


def test_an_output_dir_that_is_not_shared_is_refused_without_node_local_config(tmp_path):
    """The shared layout with a folder each node sees alone: rank 0 would write manifests listing
    files it cannot see. Exit 2 (torchrun says 1) naming the flag, before any training."""
    runs = _two_nodes(
        tmp_path,
        "apart",
        *COMMON,
        "--max_steps",
        "2",
        expect=1,
        config=str(REPO / "configs" / "ds_zero3.json"),
    )
    assert (
        "--output_dir" in runs[0].output
        and "is not the same folder on every rank" in runs[0].output
    )
    assert not list((tmp_path / "apart-node0").glob("global_step*"))


def test_a_node_local_checkpoint_resumed_on_more_ranks_is_refused_first_and_never_set_aside(
    tmp_path,
):
    """Saved by one rank, resumed by two on the same node-local folder: rank 1 has no files, so
    every candidate failed verification ("no such file") before the clear node-local error was
    reached, and with --ignore_unverified_checkpoints every healthy checkpoint was set aside and
    the run started fresh. Now the world-size error comes first (exit 2), nothing is moved."""
    out = tmp_path / "out"

    def launch(nprocs: int, *flags: str, expect: int):
        cmd = finetune_cmd("forked", nprocs, ("--deepspeed_config", CONFIG, *COMMON, *flags), out)
        r = Running(cmd, tmp_path, child_env(), out).finish(TIMEOUT)
        assert r.returncode == expect, r.output[-4000:]
        return r

    launch(1, "--max_steps", "4", expect=0)
    before = sorted(p.name for p in out.iterdir())
    more = launch(
        2,
        "--max_steps",
        "6",
        "--resume_from_checkpoint",
        "auto",
        "--ignore_unverified_checkpoints",
        expect=2,
    )
    assert "was saved by 1 ranks on node-local storage, this run has 2" in more.output, more.output[
        -4000:
    ]
    assert "does not verify" not in more.output and "not resuming from" not in more.output
    assert sorted(p.name for p in out.iterdir()) == before  # nothing set aside, nothing written
    assert (out / "latest").read_text().strip() == "global_step4"
