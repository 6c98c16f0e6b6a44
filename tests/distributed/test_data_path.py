"""The data path in real 2-rank runs: one build of the tokenized cache, reuse on restart, and a
batch that fails on one rank stopping every rank with that error."""

from __future__ import annotations

import json
import time

import pytest

from finetune.data.cache import INFO, SUBDIR, TMP_PREFIX

pytestmark = pytest.mark.distributed
# Runs that fail, are killed or are signalled go through DeepSpeed's launcher, which passes
# a rank's exit code on and forwards signals its own way (torchrun reports any failure as 1);
# the others take the fixtures' torchrun.

PC = ("--prompt_column", "question", "--completion_column", "answer")


def test_two_ranks_on_an_empty_cache_build_one_entry_and_a_restart_reuses_it(
    run_finetune, data_files, tmp_path
):
    cache = tmp_path / "cache"
    args = (
        "--train_file",
        str(data_files["pc_csv"]),
        *PC,
        "--dataset_cache_dir",
        str(cache),
        "--per_device_train_batch_size",
        "4",
        "--logging_steps",
        "1",
        "--save_checkpoint",
    )
    r = run_finetune(*args, "--max_steps", "3")
    assert r.returncode == 0, r.output[-4000:]
    entries = list((cache / SUBDIR).iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(TMP_PREFIX), entries
    info = entries[0] / INFO
    built = (info.stat().st_mtime_ns, json.loads(info.read_text())["built_at"])
    again = run_finetune(*args, "--max_steps", "5", "--resume_from_checkpoint", "auto")
    assert again.returncode == 0, again.output[-4000:]
    assert [p.name for p in (cache / SUBDIR).iterdir()] == [entries[0].name]
    assert (info.stat().st_mtime_ns, json.loads(info.read_text())["built_at"]) == built, (
        "the restart rebuilt"
    )
    assert [x["step"] for x in again.train_rows()] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("rank,step", [(1, 3), (0, 1)])
def test_a_batch_failing_on_one_rank_stops_every_rank_with_its_error(
    run_finetune, data_files, rank, step
):
    start = time.monotonic()
    r = run_finetune(
        "--train_file",
        str(data_files["pc_csv"]),
        *PC,
        "--per_device_train_batch_size",
        "4",
        "--logging_steps",
        "1",
        "--max_steps",
        "8",
        env={"FINETUNE_FAIL_BATCH": f"{rank}:{step}"},
        timeout=300,
    )
    assert r.returncode != 0
    assert "injected by FINETUNE_FAIL_BATCH" in r.output  # the failing rank's own error
    # what the other rank raised
    assert f"RankError: rank {rank} failed: OSError" in r.output, r.output[-4000:]
    assert [x["step"] for x in r.train_rows()] == list(range(1, step))
    assert time.monotonic() - start < 240, "ranks waited instead of agreeing"


def test_each_node_with_its_own_cache_folder_builds_its_own_entry(tmp_path, data_files):
    """Two "nodes" (torchrun --nnodes 2 on loopback), each with a node-local --dataset_cache_dir:
    rank 1 cannot see rank 0's folder, so it leads its own node and builds there."""
    from conftest import Running, child_env, free_port, node_launcher

    port, runs = str(free_port()), []
    for node in (0, 1):
        cmd = [
            *node_launcher(node, port),
            "--train_file",
            str(data_files["pc_csv"]),
            *PC,
            "--per_device_train_batch_size",
            "4",
            "--max_steps",
            "2",
            "--dataset_cache_dir",
            str(tmp_path / f"cache{node}"),
            "--output_dir",
            str(tmp_path / f"out{node}"),
        ]
        runs.append(Running(cmd, tmp_path, child_env(), tmp_path / f"out{node}"))
    for r in [run.finish(420) for run in runs]:
        assert r.returncode == 0, r.output[-4000:]
    entries = [
        sorted(p.name for p in (tmp_path / f"cache{node}" / SUBDIR).iterdir()) for node in (0, 1)
    ]
    assert (
        entries[0] == entries[1]
        and len(entries[0]) == 1
        and not entries[0][0].startswith(TMP_PREFIX)
    )
