"""Resume on another world size through DeepSpeed's universal checkpoint format (2→1 and 1→2)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.distributed

TIMEOUT = 420
# Same global batch on 1 and 2 ranks (8 × GA 2 × 1 = 8 × GA 1 × 2), so losses are comparable.
PER_WORLD = {1: ["--gradient_accumulation_steps", "2"], 2: ["--gradient_accumulation_steps", "1"]}
DDP_TIMEOUT = 15
COMMON = ["--max_steps", "6", "--logging_steps", "1", "--per_device_train_batch_size", "8"]


def _ok(r):
    assert r.returncode == 0, r.output[-4000:]


@pytest.mark.parametrize("saved_world,resumed_world", [(2, 1), (1, 2)])
def test_resume_on_another_world_size(run_finetune, tmp_path, saved_world, resumed_world):
    """1→2: rank 0 converts while rank 1 waits, and the conversion is slowed past --ddp_timeout:
    the waiting rank polls with short collectives instead of sitting in one that times out."""
    launcher = {1: "python", 2: "deepspeed"}
    slow = resumed_world > 1
    ref = run_finetune(*COMMON, *PER_WORLD[saved_world], "--save_checkpoint", "--save_steps", "3",
                       launcher=launcher[saved_world], nprocs=saved_world, out_dir=tmp_path / "ref", timeout=TIMEOUT)
    _ok(ref)
    ckpt = tmp_path / "ref" / "global_step3"
    resumed = run_finetune(*COMMON, *PER_WORLD[resumed_world], "--resume_from_checkpoint", str(ckpt),
                           *(["--ddp_timeout", str(DDP_TIMEOUT)] if slow else []),
                           launcher=launcher[resumed_world], nprocs=resumed_world, out_dir=tmp_path / "new",
                           env={"FINETUNE_SLOW_UNIVERSAL": str(2 * DDP_TIMEOUT)} if slow else None, timeout=TIMEOUT)
    _ok(resumed)
    assert f"Resuming a {saved_world}-rank checkpoint on {resumed_world} ranks" in resumed.output
    assert (ckpt / "universal" / "zero").is_dir()  # cached beside the checkpoint for the next resume
    manifest = json.loads((ckpt / "universal" / "manifest.json").read_text())  # verified before any reuse
    assert manifest["source_save_id"] == json.loads((ckpt / "manifest.json").read_text())["save_id"]
    assert any(name.startswith("zero/") for name in manifest["files"])
    want = {r["step"]: r for r in ref.train_rows()}
    got = resumed.train_rows()
    assert [r["step"] for r in got] == [4, 5, 6]
    first = got[0]
    assert abs(first["loss"] - want[4]["loss"]) <= 0.01 * want[4]["loss"], (first, want[4])
    assert first["lr"] == pytest.approx(want[4]["lr"])  # the LR schedule continued
    assert first["samples_seen"] == want[4]["samples_seen"]  # the data position mapped, nothing skipped
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["world_size"] == saved_world
