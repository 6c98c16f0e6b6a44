"""Resume on another world size through DeepSpeed's universal checkpoint format (2→1 and 1→2)."""

from __future__ import annotations

import json
import re

import pytest

from finetune.io import seams

pytestmark = pytest.mark.distributed

TIMEOUT = 420
# Same global batch on 1 and 2 ranks (8 × GA 2 × 1 = 8 × GA 1 × 2), so losses are comparable.
PER_WORLD = {1: ["--gradient_accumulation_steps", "2"], 2: ["--gradient_accumulation_steps", "1"]}
DDP_TIMEOUT = 15
# A row every 2 steps and a checkpoint at step 3: the checkpoint holds half a log window.
COMMON = ["--max_steps", "6", "--logging_steps", "2", "--per_device_train_batch_size", "8"]


def _ok(r):
    assert r.returncode == 0, r.output[-4000:]


def assert_resumed_on_another_world(ref, resumed, ckpt, saved_world: int, resumed_world: int):
    """``resumed`` continued ``ref``'s run from ``ckpt`` (step 3) on ``resumed_world`` ranks."""
    assert f"Resuming a {saved_world}-rank checkpoint on {resumed_world} ranks" in resumed.output
    # cached beside the checkpoint for the next resume
    assert (ckpt / "universal" / "zero").is_dir()
    # verified before any reuse
    manifest = json.loads((ckpt / "universal" / "manifest.json").read_text())
    assert manifest["source_save_id"] == json.loads((ckpt / "manifest.json").read_text())["save_id"]
    assert any(name.startswith("zero/") for name in manifest["files"])
    want = {r["step"]: r for r in ref.train_rows()}
    got = resumed.train_rows()
    assert [r["step"] for r in got] == [4, 6]
    first = got[0]  # steps 3 (before the checkpoint, on the other world size) and 4
    assert abs(first["loss"] - want[4]["loss"]) <= 0.01 * want[4]["loss"], (first, want[4])
    assert first["lr"] == pytest.approx(want[4]["lr"])  # the LR schedule continued
    # the data position mapped, nothing skipped
    assert first["samples_seen"] == want[4]["samples_seen"]
    # The window saved mid-way is the world's, counted once whatever the world size now.
    assert [r["tokens_seen"] for r in got] == [want[s]["tokens_seen"] for s in (4, 6)]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["world_size"] == saved_world


def test_resume_on_two_ranks_from_a_one_rank_checkpoint(run_finetune, tmp_path):
    """1→2: rank 0 converts while rank 1 waits, and the conversion is slowed past --ddp_timeout (3 s
    a piece, ~20 pieces in up to 4 worker processes: over 15 s on any machine; 1 s a piece took
    14.4 s on a fast 2-core one): the waiting rank polls with short collectives instead of sitting
    in one that times out. (2→1 is the next test's second start.)"""
    ref = run_finetune(
        *COMMON,
        *PER_WORLD[1],
        "--save_checkpoint",
        "--save_steps",
        "3",
        launcher="python",
        nprocs=1,
        out_dir=tmp_path / "ref",
        timeout=TIMEOUT,
    )
    _ok(ref)
    ckpt = tmp_path / "ref" / "global_step3"
    resumed = run_finetune(
        *COMMON,
        *PER_WORLD[2],
        "--resume_from_checkpoint",
        str(ckpt),
        "--ddp_timeout",
        str(DDP_TIMEOUT),
        nprocs=2,
        out_dir=tmp_path / "new",
        env={"FINETUNE_SLOW_UNIVERSAL": "3"},
        timeout=TIMEOUT,
    )
    _ok(resumed)
    took = float(re.search(r"to the universal format in ([\d.]+) seconds", resumed.output).group(1))
    assert took > DDP_TIMEOUT, took
    assert_resumed_on_another_world(ref, resumed, ckpt, 1, 2)


def test_a_preemption_during_the_conversion_exits_75_and_the_next_start_finishes_it(
    run_finetune, start_finetune, tmp_path
):
    """A whole-job SIGTERM while a 2-rank checkpoint is converted for 1 rank: the converter (a
    child) used to die with the job and the run exit 1 (no requeue), and the next start deleted what
    it had converted, so frequent preemptions meant it never finished. Now: exit 75, the pieces
    converted are kept, and the next start does only the rest, then resumes on 1 rank where the
    2-rank run was (2→1)."""
    import os
    import signal

    from finetune.preemption import EXIT_PREEMPTED
    from finetune.weights.universal import PIECES

    from conftest import wait_until

    ref = run_finetune(
        *COMMON,
        *PER_WORLD[2],
        "--save_checkpoint",
        "--save_steps",
        "3",
        nprocs=2,
        out_dir=tmp_path / "ref",
        timeout=TIMEOUT,
    )
    _ok(ref)
    ckpt = tmp_path / "ref" / "global_step3"
    pieces = ckpt / "universal.tmp" / PIECES
    markers = lambda: (
        [p for p in pieces.iterdir() if p.name != "source.json"] if pieces.is_dir() else []
    )
    resume = (*COMMON, *PER_WORLD[1], "--resume_from_checkpoint", str(ckpt))
    run = start_finetune(
        *resume,
        launcher="python",
        nprocs=1,
        out_dir=tmp_path / "new",
        env={seams.SLOW_UNIVERSAL: "1"},
    )
    wait_until(lambda: len(markers()) >= 2, TIMEOUT, "two pieces of the conversion")
    # the whole job, the converter included (as SLURM's scancel)
    os.killpg(run.proc.pid, signal.SIGTERM)
    stopped = run.finish(TIMEOUT)
    assert stopped.returncode == EXIT_PREEMPTED, stopped.output[-4000:]
    status = json.loads((tmp_path / "new" / "exit_status.json").read_text())
    assert (status["exit_code"], status["reason"]) == (EXIT_PREEMPTED, "preempted")
    kept = len(markers())
    assert kept >= 2 and not (ckpt / "universal").exists()
    again = run_finetune(
        *resume, launcher="python", nprocs=1, out_dir=tmp_path / "new", timeout=TIMEOUT
    )
    _ok(again)
    assert f"{kept} done before" in again.output  # only the rest was converted
    # 2→1: the run continues as the 2-rank run did
    assert_resumed_on_another_world(ref, again, ckpt, 2, 1)
