"""Checkpoint policy and commit protocol, without processes: latest, retention, crash points."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from checkpoint.fake_engine import (
    Inner,
    _fake_engines_model_is_not_checked,
    make_cfg,
    make_manager,
    run_saves,
    stage,
    tiny_module,
)

from finetune.checkpoint.writer import GuardedWriter
from finetune.checkpoint_format.manifest import MANIFEST, read_manifest
from finetune.checkpoint_format.outdir import STAGING, OutputDir
from finetune.io import seams
from finetune.io.durable import hash_file

# fake_engine's, found by pytest under these names
FIXTURES = (tiny_module, _fake_engines_model_is_not_checked)


class FakeStorage(OutputDir):
    """OutputDir on a temp dir that can crash at a chosen operation."""

    def __init__(self, root, crash_at: str | None = None):
        super().__init__(root)
        self.crash_at = crash_at

    def _maybe_crash(self, op):
        if op == self.crash_at:
            raise OSError(errno.EIO, f"crash at {op}")

    def replace_dir(self, src, dst):
        self._maybe_crash("replace_dir")
        super().replace_dir(src, dst)

    def write_latest(self, tag):
        self._maybe_crash("write_latest")
        super().write_latest(tag)


def complete(storage: OutputDir, tag: str) -> bool:
    return read_manifest(storage.root / tag) is not None


def test_commit_makes_a_complete_folder_and_moves_latest(tmp_path):
    s = OutputDir(tmp_path)
    s.commit("global_step2", stage(s, "global_step2"), 2, {"torch": "x"})
    assert s.read_latest() == "global_step2" and complete(s, "global_step2")
    manifest = read_manifest(tmp_path / "global_step2")
    assert manifest["world_size"] == 2 and manifest["tag"] == "global_step2"
    assert manifest["files"]["zero_pp_rank_0_mp_rank_00_model_states.pt"]["size"] == len(b"weights")
    assert not (tmp_path / STAGING).exists()
    assert not list(tmp_path.glob(".latest*"))


@pytest.mark.parametrize("crash_at", ["replace_dir", "write_latest"])
def test_crash_during_commit_leaves_latest_on_a_complete_checkpoint(tmp_path, crash_at):
    s = FakeStorage(tmp_path)
    s.commit("global_step2", stage(s, "global_step2"), 1, {})
    s.crash_at = crash_at
    with pytest.raises(OSError):
        s.commit("global_step4", stage(s, "global_step4"), 1, {})
    assert s.read_latest() == "global_step2" and complete(s, "global_step2")
    # Whatever is visible under a final name is complete: never a folder without its manifest.
    assert all(complete(s, t) for t in s.tags())


def test_recommitting_an_existing_step_swaps_the_folder_without_a_gap(tmp_path):
    s = OutputDir(tmp_path)
    s.commit("global_step4", stage(s, "global_step4", b"old timeline"), 1, {})
    s.commit("global_step4", stage(s, "global_step4", b"new timeline!"), 1, {})
    assert (
        tmp_path / "global_step4" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    ).read_bytes() == b"new timeline!"
    assert s.read_latest() == "global_step4"
    assert not (tmp_path / STAGING).exists()


def test_tags_sort_by_step_not_by_name_or_mtime(tmp_path):
    for name in ["global_step10", "global_step9", "global_step100", "notes", "global_stepX"]:
        (tmp_path / name).mkdir()
    assert OutputDir(tmp_path).tags() == ["global_step9", "global_step10", "global_step100"]


def test_guarded_writer_checksums_what_it_wrote(tmp_path):
    w = GuardedWriter(Inner())
    w.reset(tmp_path, step=3)
    w.save({"x": torch.arange(10)}, str(tmp_path / "a.pt"))
    assert w.error is None
    assert w.files["a.pt"] == hash_file(tmp_path / "a.pt")
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["x"], torch.arange(10))


def test_guarded_writer_leaves_torchs_crc_to_the_manifests_checksum(tmp_path):
    """torch.save's per-record CRC-32 was most of a save's serialization time: the writer turns it
    off (the file's xxh3 covers every byte), and the file still loads, safely too."""
    import zipfile

    from finetune.weights import safe_load

    w = GuardedWriter(Inner())
    w.reset(tmp_path, step=3)
    x = torch.arange(1 << 16, dtype=torch.float32)
    w.save({"x": x}, str(tmp_path / "a.pt"))
    assert w.error is None and w.files["a.pt"] == hash_file(tmp_path / "a.pt")
    records = zipfile.ZipFile(tmp_path / "a.pt").infolist()
    assert any(r.filename.endswith("data/0") for r in records)
    assert all(r.CRC == 0 for r in records), [(r.filename, r.CRC) for r in records]
    assert torch.equal(safe_load.load(str(tmp_path / "a.pt"))["x"], x)
    safe_load.check_globals(tmp_path / "a.pt")


def test_guarded_writer_records_failures_instead_of_raising(tmp_path, monkeypatch):
    monkeypatch.setenv(seams.FAULT, "save.write_rank_files:0:3")
    w = GuardedWriter(Inner())
    w.reset(tmp_path, step=3)
    w.save({"x": torch.ones(2)}, str(tmp_path / "a.pt"))
    w.save({"x": torch.ones(2)}, str(tmp_path / "b.pt"))
    assert "injected fault at save.write_rank_files" in w.error and "a.pt" in w.error
    assert not (tmp_path / "b.pt").exists() and w.files == {}
    w.reset(tmp_path, step=5)  # the seam is step-specific
    w.save({"x": torch.ones(2)}, str(tmp_path / "c.pt"))
    assert w.error is None


def test_guarded_writer_reports_a_directory_in_the_way(tmp_path):
    (tmp_path / "a.pt").mkdir()
    w = GuardedWriter(Inner())
    w.reset(tmp_path)
    w.save({"x": torch.ones(2)}, str(tmp_path / "a.pt"))
    assert w.error and "IsADirectoryError" in w.error


def test_manifest_json_is_plain_json(tmp_path):
    s = OutputDir(tmp_path)
    s.commit("global_step1", stage(s, "global_step1"), 1, {"deepspeed": "0"})
    data = json.loads((tmp_path / "global_step1" / MANIFEST).read_text())
    assert data["algorithm"] == "xxh3_128" and data["total_bytes"] == len(b"weights")


# --- the Checkpointer and the resume planner in one process (fake_engine.py) ------------------


def test_a_save_lists_exactly_the_files_written_and_rank0_reads_back_only_its_own(
    tmp_path, tiny_module
):
    from finetune.io.durable import bytes_hashed

    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    before = bytes_hashed()
    run_saves(m, progress, [2])
    folder = tmp_path / "global_step2"
    listed = set(read_manifest(folder)["files"])
    assert listed == {p.name for p in folder.iterdir()} - {MANIFEST}
    shared = sum(
        (folder / n).stat().st_size
        for n in ("config.json", "generation_config.json", "tokenizer.json")
    )
    # the rank files were hashed as written, never read back
    assert bytes_hashed() - before == shared


def test_retention_keeps_the_resume_point_and_abandoned_commits_are_set_aside(
    tmp_path, tiny_module
):
    cfg = make_cfg(tmp_path, save_total_limit=2)
    m, progress, _ = make_manager(cfg, tiny_module)
    run_saves(m, progress, [2, 4, 6, 8])
    assert OutputDir(tmp_path).tags() == ["global_step6", "global_step8"]
    # Resume explicitly from step 6: step 8 belongs to the timeline this run abandons.
    cfg = make_cfg(
        tmp_path, save_total_limit=2, resume_from_checkpoint=str(tmp_path / "global_step6")
    )
    m, progress, plan = make_manager(cfg, tiny_module, run_id="run2")
    assert plan.folder == tmp_path / "global_step6"
    assert [p.name.split("-")[0] for p in (tmp_path / ".abandoned").iterdir()] == ["global_step8"]
    run_saves(m, progress, [7])
    # Old rule (count every folder by step) would have deleted step 6, the resume point, and kept 8.
    assert OutputDir(tmp_path).tags() == ["global_step6", "global_step7"]
    seven = read_manifest(tmp_path / "global_step7")
    assert (seven["parent"], seven["commit_seq"]) == ("global_step6", 5)
    run_saves(m, progress, [9])
    assert OutputDir(tmp_path).tags() == ["global_step7", "global_step9"]


def test_auto_resume_takes_the_newest_commit_even_when_latest_is_stale(tmp_path, tiny_module):
    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    run_saves(m, progress, [2, 4])
    # crash between the rename and the `latest` write
    (tmp_path / "latest").write_text("global_step2\n")
    _, _, plan = make_manager(
        make_cfg(tmp_path, resume_from_checkpoint="auto"), tiny_module, run_id="run2"
    )
    assert plan.folder.name == "global_step4"


def test_auto_refuses_to_start_fresh_over_checkpoints_that_do_not_verify(tmp_path, tiny_module):
    from finetune.config import ConfigError

    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    run_saves(m, progress, [2, 4])
    for tag in ("global_step2", "global_step4"):
        victim = tmp_path / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(ConfigError) as e:
        make_manager(make_cfg(tmp_path, resume_from_checkpoint="auto"), tiny_module)
    message = str(e.value)
    assert (
        "global_step4: zero_pp_rank_0_mp_rank_00_optim_states.pt: size" in message
        and "global_step2:" in message
    )
    assert "--ignore_unverified_checkpoints" in message
    assert OutputDir(tmp_path).tags() == ["global_step2", "global_step4"]  # nothing touched
    _, _, plan = make_manager(
        make_cfg(tmp_path, resume_from_checkpoint="auto", ignore_unverified_checkpoints=True),
        tiny_module,
    )
    assert plan is None and OutputDir(tmp_path).tags() == []
    assert len(list((tmp_path / ".abandoned").iterdir())) == 2  # set aside, not deleted


def test_consolidation_failure_drops_only_the_safetensors(tmp_path, tiny_module, monkeypatch):
    import finetune.weights.consolidate as consolidate

    def broken(model, folder, dtype, max_shard_size):
        (folder / "model.safetensors").write_bytes(b"partial")
        raise consolidate.ConsolidationFailed("RuntimeError: CUDA out of memory (simulated)")

    monkeypatch.setattr(consolidate, "save_consolidated", broken)
    m, progress, _ = make_manager(make_cfg(tmp_path, save_consolidated=True), tiny_module)
    run_saves(m, progress, [2])
    manifest = read_manifest(tmp_path / "global_step2")
    assert (
        manifest["consolidated"] is False
        and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in manifest["files"]
    )
    assert not (tmp_path / "global_step2" / "model.safetensors").exists()
    assert "CUDA out of memory" in m.consolidation_error


def test_an_error_escaping_mid_gather_stops_the_run_instead_of_agreeing(
    tmp_path, tiny_module, monkeypatch
):
    import finetune.weights.consolidate as consolidate

    def transport_error(model, folder, dtype, max_shard_size):
        raise RuntimeError("Connection reset by peer (simulated)")

    monkeypatch.setattr(consolidate, "save_consolidated", transport_error)
    m, progress, _ = make_manager(make_cfg(tmp_path, save_consolidated=True), tiny_module)
    with pytest.raises(
        RuntimeError, match="mid-gather; stopping because the ranks may be out of step"
    ):
        run_saves(m, progress, [2])
    assert OutputDir(tmp_path).tags() == []


@pytest.mark.parametrize("failure", ["full", "statfs error"])
def test_space_check_failures_are_agreed_save_errors(tmp_path, tiny_module, monkeypatch, failure):
    from finetune.checkpoint.checkpointer import SaveError

    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    if failure == "full":
        monkeypatch.setattr(m.storage, "free_bytes", lambda: 0)
    else:
        monkeypatch.setattr(
            m.storage, "free_bytes", lambda: (_ for _ in ()).throw(OSError(errno.ESTALE, "stale"))
        )
    with pytest.raises(SaveError, match="not enough free space"):
        run_saves(m, progress, [2])
    assert OutputDir(tmp_path).tags() == [] and not (tmp_path / STAGING).exists()


def test_a_rank_local_snapshot_failure_is_a_save_error_and_leaves_no_staging(
    tmp_path, tiny_module, monkeypatch
):
    import finetune.checkpoint.checkpointer as manager
    from finetune.checkpoint.checkpointer import SaveError

    monkeypatch.setattr(manager, "rng_state", lambda: 1 / 0)
    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    with pytest.raises(SaveError, match="ZeroDivisionError"):
        run_saves(m, progress, [2])
    assert OutputDir(tmp_path).tags() == [] and not (tmp_path / STAGING).exists()


def test_node_local_candidates_need_the_same_save_id_on_every_node(
    tmp_path, tiny_module, monkeypatch
):
    """Stubbed dist: a second node's leader reports the same tags, one of them from another save."""
    from finetune import distributed as dist
    from finetune.checkpoint.resume import Resumer

    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    run_saves(m, progress, [2, 4])
    other_node = (
        ["global_step4", "global_step2"],
        {"global_step4": "another-save", "global_step2": "run1-1"},
    )

    def two_leaders(fn, on=True, share=False, **kw):
        return dist.Outcomes(result=fn(), results=[fn(), other_node])

    monkeypatch.setattr(dist, "gather_outcomes", two_leaders)
    resumer = Resumer(
        make_cfg(tmp_path, resume_from_checkpoint="auto"),
        OutputDir(tmp_path),
        node_local=True,
        leader=True,
    )
    assert [p.name for p in resumer._agreed_candidates("auto")] == ["global_step2"]


def test_torn_metrics_line_is_dropped_on_resume(tmp_path):
    from finetune.metrics import read_metrics, truncate_after

    path = tmp_path / "metrics.jsonl"
    # crash mid-append
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "loss": 1.')
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]
    truncate_after(path, 2)
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'


def test_a_universal_conversion_is_reused_only_if_it_verifies(tmp_path):
    from finetune.weights.universal import verify_universal, write_universal_manifest

    target = tmp_path / "universal"
    (target / "zero" / "w").mkdir(parents=True)
    (target / "zero" / "w" / "fp32.pt").write_bytes(b"a" * 100)
    (target / "mp_rank_00_model_states.pt").write_bytes(b"b" * 10)
    assert verify_universal(target, "s-1") == [
        "manifest.json missing or unreadable (an interrupted or foreign conversion)"
    ]
    write_universal_manifest(target, "s-1")
    assert verify_universal(target, "s-1") == []
    # the checkpoint was re-committed
    assert "converted from save s-1" in verify_universal(target, "s-2")[0]
    (target / "zero" / "w" / "fp32.pt").write_bytes(b"a" * 99 + b"X")
    assert verify_universal(target, "s-1") == ["zero/w/fp32.pt: checksum mismatch (corrupted)"]
    assert verify_universal(target, "s-1", checksums=False) == []


def test_a_second_run_into_a_live_runs_output_dir_exits_2_naming_it(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    from finetune.lease import acquire

    with acquire(tmp_path, "live-run-1"):
        r = subprocess.run(
            [sys.executable, "-m", "finetune", "--max_steps", "1", "--output_dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert r.returncode == 2, r.stderr[-2000:]
    assert (
        "live-run-1" in r.stderr
        and str(os.getpid()) in r.stderr
        and socket.gethostname() in r.stderr
    )
    assert (
        not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "exit_status.json").exists()
    )


def test_node_local_commit_waits_for_every_leaders_manifest(tmp_path, tiny_module, monkeypatch):
    """Stubbed dist: another node's leader fails to write its manifest. This node wrote everything,
    and must neither rename its folder nor move its `latest` (phase 2 runs only after all agree)."""
    from finetune import distributed as dist
    from finetune.checkpoint.checkpointer import SaveError

    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    m.layout.node_local = True
    run_saves(m, progress, [2])
    real, calls = dist.gather_outcomes, []

    def other_leader_fails_to_prepare(fn, on=True, **kw):
        out = real(fn, on, **kw)
        calls.append(fn.__qualname__)
        # phase 1: manifests
        if "commit" in fn.__qualname__ and sum("commit" in c for c in calls) == 1:
            out.errors[1], out.kinds[1] = "OSError: [Errno 28] No space left on device", "OSError"
        return out

    monkeypatch.setattr(dist, "gather_outcomes", other_leader_fails_to_prepare)
    with pytest.raises(SaveError, match="commit of global_step4 failed on rank 1"):
        run_saves(m, progress, [4])
    assert OutputDir(tmp_path).tags() == ["global_step2"]
    assert (tmp_path / "latest").read_text().strip() == "global_step2"
    assert not (tmp_path / STAGING).exists()


def test_resaving_the_committed_step_at_the_end_is_skipped(tmp_path, tiny_module):
    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    run_saves(m, progress, [4])
    before = read_manifest(tmp_path / "global_step4")["save_id"]
    cfg = make_cfg(tmp_path, resume_from_checkpoint="auto")
    m, progress, plan = make_manager(cfg, tiny_module, run_id="run2")
    assert m.at_end(plan.saved["global_step"]) == 0  # e.g. a requeue after training had finished
    assert read_manifest(tmp_path / "global_step4")["save_id"] == before


def test_a_same_tag_recommit_keeps_the_line_intact(tmp_path, tiny_module):
    from finetune.checkpoint_format.outdir import committed
    from finetune.checkpoint_format.policy import line_of

    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    run_saves(m, progress, [2, 4, 4])
    again = read_manifest(tmp_path / "global_step4")
    assert again["parent"] == "global_step2" and again["commit_seq"] == 3
    found = committed(OutputDir(tmp_path))
    head = next(c for c in found if c.tag == "global_step4")
    assert [c.tag for c in line_of(head, found)] == ["global_step2", "global_step4"]


def test_a_failed_publish_consumes_its_commit_number(tmp_path, tiny_module, monkeypatch):
    m, progress, _ = make_manager(make_cfg(tmp_path, on_save_error="continue"), tiny_module)
    real = m.storage.write_latest
    monkeypatch.setattr(
        m.storage, "write_latest", lambda tag: (_ for _ in ()).throw(OSError(errno.EIO, "eio"))
    )
    # renamed into place, `latest` not written: committed, with a warning
    run_saves(m, progress, [2])
    assert not (tmp_path / "latest").exists()
    monkeypatch.setattr(m.storage, "write_latest", real)
    run_saves(m, progress, [4])
    ids = {t: read_manifest(tmp_path / t)["save_id"] for t in ("global_step2", "global_step4")}
    # never two checkpoints with one id
    assert ids == {"global_step2": "run1-1", "global_step4": "run1-2"}


def test_a_fresh_run_sets_aside_an_earlier_runs_checkpoints_instead_of_overwriting(
    tmp_path, tiny_module
):
    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    run_saves(m, progress, [2, 4])
    m, progress, plan = make_manager(make_cfg(tmp_path), tiny_module, run_id="run2")
    assert plan is None and OutputDir(tmp_path).tags() == []
    assert sorted(p.name.split("-")[0] for p in (tmp_path / ".abandoned").iterdir()) == [
        "global_step2",
        "global_step4",
    ]


def test_a_run_that_lost_its_lease_does_not_commit_and_touches_nothing(tmp_path, tiny_module):
    from finetune.lease import LeaseLost

    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module, still_ours=lambda: False)
    with pytest.raises(LeaseLost, match="another run took over"):
        run_saves(m, progress, [2])
    # Checked before the save clears or writes anything: the output dir is the other run's now.
    assert OutputDir(tmp_path).tags() == [] and not (tmp_path / STAGING).exists()
    assert not (tmp_path / "latest").exists()


class Lease:
    """``still_ours`` for the manager: True until ``lose_when`` holds, then False for good."""

    def __init__(self, lose_when):
        self.lose_when, self.lost, self.checks = lose_when, False, 0

    def __call__(self) -> bool:
        self.checks += 1
        self.lost = self.lost or self.lose_when()
        return not self.lost


def test_the_lease_is_checked_again_right_before_the_publish(tmp_path, tiny_module):
    """Lost while the manifest was written (after the commit's first check): nothing is renamed
    into place, `latest` and the staged folder stay as they are."""
    from finetune.lease import LeaseLost

    staged = tmp_path / STAGING / "global_step4" / MANIFEST
    lease = Lease(staged.exists)
    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module, still_ours=lease)
    run_saves(m, progress, [2])
    with pytest.raises(LeaseLost):
        run_saves(m, progress, [4])
    assert OutputDir(tmp_path).tags() == ["global_step2"] and staged.is_file()
    assert (tmp_path / "latest").read_text().strip() == "global_step2"


def test_the_lease_is_checked_again_right_before_retention(tmp_path, tiny_module):
    """Lost after the publish: the checkpoint is committed, but nothing is deleted."""
    from finetune.lease import LeaseLost

    lease = Lease(lambda: (tmp_path / "global_step6").is_dir())
    m, progress, _ = make_manager(
        make_cfg(tmp_path, save_total_limit=1), tiny_module, still_ours=lease
    )
    run_saves(m, progress, [2, 4])
    assert OutputDir(tmp_path).tags() == ["global_step4"]
    with pytest.raises(LeaseLost):
        run_saves(m, progress, [6])
    m.lineage.deleter.wait(10)
    assert OutputDir(tmp_path).tags() == ["global_step4", "global_step6"]


def test_a_lease_refusal_is_a_config_error_on_every_rank():
    from finetune import distributed as dist
    from finetune.lease import LeaseHeld

    def refuse():
        raise LeaseHeld(__import__("pathlib").Path("/out"), {"run_id": "x", "host": "h", "pid": 1})

    out = dist.gather_outcomes(refuse)
    # the other ranks raise ConfigError too: exit 2, one line
    assert out.kinds == {0: "ConfigError"}


def test_housekeeping_restores_a_checkpoint_a_crashed_swap_left_in_staging(tmp_path, tiny_module):
    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    run_saves(m, progress, [2, 4])
    staging = tmp_path / STAGING
    staging.mkdir()
    # killed between the two renames
    (tmp_path / "global_step4").rename(staging / "global_step4.replaced")
    (tmp_path / "global_step2").rename(staging / "global_step2")  # prepared, never published
    OutputDir(tmp_path).housekeeping()
    assert OutputDir(tmp_path).tags() == ["global_step4"] and read_manifest(
        tmp_path / "global_step4"
    )
    assert [p.name.split("-")[0] for p in (tmp_path / ".abandoned").iterdir()] == ["global_step2"]
    assert not staging.exists()


def test_resume_planning_shares_the_manifests_identity_not_its_file_list(
    tmp_path, tiny_module, monkeypatch
):
    """The manifest lists every rank's files: sent to every rank it would cost each rank O(world
    size) bytes at every resume. Only the commit identity travels."""
    from finetune import distributed as dist
    from finetune.checkpoint.resume import Resumer

    manager, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    run_saves(manager, progress, [2])
    shared = []
    original = dist.share_from

    def recording(src, fn, **kw):
        shared.append(original(src, fn, **kw))
        return shared[-1]

    monkeypatch.setattr(dist, "share_from", recording)
    plan = Resumer(
        make_cfg(tmp_path, resume_from_checkpoint="latest"), OutputDir(tmp_path)
    ).plan_resume()
    assert plan.head.save_id and plan.head.seq == 1 and plan.head.total_bytes > 0
    assert shared and not any("files" in repr(value) for value in shared), shared


def test_with_adapters_the_space_a_first_save_needs_is_estimated_from_the_trainable_parameters(
    tmp_path, tiny_module
):
    """A LoRA run on a 70B base saves a few MB: asking for 16 B x 70B free would refuse every
    save."""
    import copy

    frozen = copy.deepcopy(tiny_module)
    for name, p in frozen.named_parameters():
        p.requires_grad = name.startswith("transformer.h.0.attn")
    trainable = sum(p.numel() for p in frozen.parameters() if p.requires_grad)
    full, _, _ = make_manager(make_cfg(tmp_path / "a"), tiny_module)
    lora, _, _ = make_manager(make_cfg(tmp_path / "b"), frozen, adapters=True)
    assert full.parameters == sum(p.numel() for p in tiny_module.parameters())
    assert lora.parameters == trainable < full.parameters / 3
    assert lora.staging.space_needed() < full.staging.space_needed() / 3


# --- deadlines, a failed background save, retention off the path


@pytest.fixture
def short_deadline(monkeypatch):
    """--ddp_timeout 1: every storage step of a save may go 1 s without progress."""
    from finetune import distributed as dist

    monkeypatch.setattr(dist, "_timeout_s", 1)


@pytest.mark.parametrize(
    "site,says",
    [
        ("commit.manifest", "writing global_step4's manifest"),
        ("save.check_space", "checking free space for global_step4"),
    ],
)
def test_a_storage_step_that_hangs_fails_the_save_after_its_deadline(
    tmp_path, tiny_module, monkeypatch, short_deadline, site, says
):
    """A manifest write (or a statfs) stuck on a dead mount used to sit inside one collective (or
    be polled for ever): now the save fails on every rank after the deadline, naming rank and step,
    `latest` untouched, and the next save goes ahead."""
    import time

    from finetune.checkpoint.checkpointer import SaveError

    monkeypatch.setenv(seams.FAULT, f"{site}:0:4:hang")
    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    run_saves(m, progress, [2])
    started = time.monotonic()
    with pytest.raises(SaveError, match=rf"rank 0: StepTimeout: {says} made no progress for 1 s"):
        run_saves(m, progress, [4])
    assert time.monotonic() - started < 10
    assert (tmp_path / "latest").read_text().strip() == "global_step2"
    run_saves(m, progress, [6])
    assert OutputDir(tmp_path).tags() == ["global_step2", "global_step6"]


def test_retention_that_hangs_is_given_up_with_a_warning(
    tmp_path, tiny_module, monkeypatch, short_deadline, caplog
):
    monkeypatch.setenv(seams.FAULT, "retention.delete:0:4:hang")
    m, progress, _ = make_manager(make_cfg(tmp_path, save_total_limit=1), tiny_module)
    run_saves(m, progress, [2, 4])  # committed; the deletion of step 2 gave up
    assert "could not delete global_step2" in caplog.text and "made no progress" in caplog.text
    run_saves(m, progress, [6])  # retried after the next save
    assert m.lineage.deleter.wait(10) and OutputDir(tmp_path).tags() == ["global_step6"]


def test_a_failed_background_save_is_reported_under_its_step_and_the_due_save_still_runs(
    tmp_path, tiny_module, monkeypatch
):
    """--async_save --save_steps 1 with a write fault at step 2: step 3's save used to be cancelled
    by step 2's failure (reported under step 3); commits were 1, 4, 5."""
    monkeypatch.setenv(seams.FAULT, "save.write_rank_files:0:2")
    m, progress, _ = make_manager(make_cfg(tmp_path, async_save=True, save_steps=1), tiny_module)
    events = []
    m.on_event = lambda kind, step, **fields: events.append((kind, step))
    for step in range(1, 6):
        progress.global_step = step
        assert m.at_step(step, 6) is None
    progress.global_step = 6
    assert m.at_end(6) == 0
    assert [e for e in events if e[0] == "save_failed"] == [("save_failed", 2)]
    assert [s for kind, s in events if kind == "checkpoint"] == [1, 3, 4, 5, 6]
    assert OutputDir(tmp_path).tags() == [f"global_step{s}" for s in (1, 3, 4, 5, 6)]


def test_saves_that_come_faster_than_they_are_written_are_said_once_and_each_counted(
    tmp_path, tiny_module, monkeypatch, caplog
):
    """--async_save --save_steps 1 with each file's write slowed: every save after the first
    waits for the one in flight. The run says so once, with the --save_steps that keeps up, and
    records each wait as a save_behind event."""
    monkeypatch.setenv(seams.SLOW_SAVE, "0.3")
    m, progress, _ = make_manager(make_cfg(tmp_path, async_save=True, save_steps=1), tiny_module)
    events = []
    m.on_event = lambda kind, step, **fields: events.append((kind, step, fields))
    for step in range(1, 4):
        progress.global_step = step
        assert m.at_step(step, 4) is None
    progress.global_step = 4
    assert m.at_end(4) == 0
    behind = [(step, fields) for kind, step, fields in events if kind == "save_behind"]
    assert [step for step, _ in behind] == [2, 3, 4], events
    assert all(f["waited_s"] >= 0.5 and f["writer_s"] >= f["waited_s"] for _, f in behind)
    said = [r.getMessage() for r in caplog.records if "saves come faster" in r.getMessage()]
    assert len(said) == 1 and "raise --save_steps to" in said[0], said
    commits = [(s, fields) for kind, s, fields in events if kind == "checkpoint"]
    assert [s for s, _ in commits] == [1, 2, 3, 4]
    # each commit says where its time went: the background writes of the slowed files too
    assert all(f["phases"]["background"] >= 0.3 for s, f in commits if s < 4), commits
    # and the writer's seconds, what `finetune ls` shows: its planning and its background writes
    assert all(
        f["writer_s"] == pytest.approx(f["phases"]["copy"] + f["phases"]["background"], abs=2e-3)
        for s, f in commits
        if s < 4
    ), commits
    # and rank 0's writer's own seconds: the pauses after each slowed file are not writing
    assert all(0 < f["writer_busy_s"] < f["writer_s"] for s, f in commits if s < 4), commits


def test_retention_deletes_in_the_background_and_the_space_check_waits_for_what_it_frees(
    tmp_path, tiny_module, monkeypatch
):
    """The save path only renames the old checkpoint out of the tag namespace; its files go on a
    thread (on Lustre, thousands of unlinks). A save that needs the space being freed waits for
    it."""
    import threading

    m, progress, _ = make_manager(make_cfg(tmp_path, save_total_limit=1), tiny_module)
    release = threading.Event()
    purge = m.storage.purge
    monkeypatch.setattr(
        m.storage, "purge", lambda rel, *a, **kw: (release.wait(10), purge(rel, *a, **kw))[1]
    )
    run_saves(m, progress, [2, 4])  # returns with step 2's files still on disk
    trash = list(tmp_path.glob(".trash-global_step2-*"))
    assert (
        OutputDir(tmp_path).tags() == ["global_step4"]
        and trash
        and m.lineage.deleter.pending_bytes > 0
    )
    need = m.staging.space_needed()
    # Not enough free until the deletion is done; enough with what it will free.
    monkeypatch.setattr(
        m.storage, "free_bytes", lambda: need // 2 if m.lineage.deleter.pending_bytes else 10 * need
    )
    threading.Timer(0.3, release.set).start()
    run_saves(m, progress, [6])
    assert not any(p.exists() for p in trash) and OutputDir(tmp_path).tags() == ["global_step6"]


def test_a_publish_given_up_at_its_deadline_leaves_its_staging_and_latest_alone(
    tmp_path, tiny_module, monkeypatch, short_deadline
):
    """A rename stuck on a hung mount may still complete when the filesystem recovers: purging its
    staging meanwhile could put a half-deleted folder in place, and the late rename must not move
    `latest`. The save fails on every rank, the staged folder (with its manifest) is left."""
    from finetune.checkpoint.checkpointer import SaveError

    monkeypatch.setenv(seams.FAULT, "commit.rename:0:4:hang")
    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    run_saves(m, progress, [2])
    with pytest.raises(SaveError, match="its staging is left in place"):
        run_saves(m, progress, [4])
    assert (tmp_path / STAGING / "global_step4" / MANIFEST).is_file()
    assert (tmp_path / "latest").read_text().strip() == "global_step2"


def test_a_write_that_returns_after_its_save_was_given_up_touches_only_that_save(tmp_path):
    """--async_save: the writer thread of a save given up at its deadline wakes after the next save
    began. Its file must not be recorded in, nor its failure fail, the next save (one record per
    save)."""
    w = GuardedWriter(Inner())
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    w.reset(tmp_path / "a", step=2, background=True)
    w.save({"x": torch.ones(4)}, str(tmp_path / "a" / "late.pt"))
    given_up, late = w.queue, w.queue.items[0]
    first = w.record
    w.cancel()  # the save of step 2 is given up at its deadline
    w.reset(tmp_path / "b", step=3)
    w.save({"x": torch.ones(4)}, str(tmp_path / "b" / "next.pt"))
    given_up.write(*late)  # the old thread wakes now
    assert w.error is None and set(w.files) == {"next.pt"}
    assert (
        first.error is not None
        and "WriteCancelled" in first.error
        and not (tmp_path / "a" / "late.pt").exists()
    )


def test_a_fresh_start_begins_a_lineage_its_resumes_carry_on_and_numbers_go_above_the_buckets(
    tmp_path, tiny_module
):
    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module, run_id="first")
    run_saves(m, progress, [2])
    assert read_manifest(tmp_path / "global_step2")["lineage"] == "first"
    cfg = make_cfg(tmp_path, resume_from_checkpoint="auto")
    # the bucket holds commit number 9 (another allocation's): this run's commits go above it
    m, progress, _ = make_manager(cfg, tiny_module, run_id="second", seen_seq=9)
    run_saves(m, progress, [4])
    four = read_manifest(tmp_path / "global_step4")
    assert (four["lineage"], four["commit_seq"], four["save_id"]) == ("first", 10, "second-10")
