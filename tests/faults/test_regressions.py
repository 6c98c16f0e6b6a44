"""Bugs the fault sweep found, each pinned by a test that runs in one process (world size 1, the
Checkpointer on the fake engine of tests/checkpoint/fake_engine.py)."""

from __future__ import annotations

from checkpoint.fake_engine import (
    Inner,
    _fake_engines_model_is_not_checked,
    make_cfg,
    make_manager,
    run_saves,
    stage,
    tiny_module,
)

from finetune.checkpoint_format.manifest import read_manifest
from finetune.checkpoint_format.outdir import OutputDir
from finetune.io import seams

# fake_engine's, found by pytest under these names
FIXTURES = (tiny_module, _fake_engines_model_is_not_checked)


def test_a_commit_whose_latest_write_fails_is_committed_and_counted_by_retention(
    tmp_path, tiny_module, monkeypatch, caplog
):
    """`latest` failing after the rename (sweep: commit.latest): the checkpoint is in place with its
    manifest, so resume takes it (commit order). It used to be reported as a failed save and left
    out of the run's line: retention never deleted it, and the next save's parent skipped it."""
    monkeypatch.setenv(seams.FAULT, "commit.latest:0:4")
    m, progress, _ = make_manager(make_cfg(tmp_path, save_total_limit=2), tiny_module)
    run_saves(m, progress, [2, 4])  # no SaveError: the save of step 4 is committed
    assert "committed global_step4, but `latest` was not updated" in caplog.text
    # stale, still a complete checkpoint
    assert (tmp_path / "latest").read_text().strip() == "global_step2"
    run_saves(m, progress, [6, 8])
    # was [4, 6, 8]: a limit of 2 kept 3
    assert OutputDir(tmp_path).tags() == ["global_step6", "global_step8"]
    assert read_manifest(tmp_path / "global_step6")["parent"] == "global_step4"
    assert (tmp_path / "latest").read_text().strip() == "global_step8"


def test_a_rename_that_fails_is_still_a_failed_save(tmp_path, tiny_module, monkeypatch):
    import pytest

    from finetune.checkpoint.checkpointer import SaveError

    monkeypatch.setenv(seams.FAULT, "commit.rename:0:4")
    m, progress, _ = make_manager(make_cfg(tmp_path, save_total_limit=2), tiny_module)
    run_saves(m, progress, [2])
    with pytest.raises(SaveError, match="commit of global_step4 failed"):
        run_saves(m, progress, [4])
    assert (
        OutputDir(tmp_path).tags() == ["global_step2"]
        and not (tmp_path / ".staging" / "global_step4").exists()
    )
    run_saves(m, progress, [6])
    assert read_manifest(tmp_path / "global_step6")["parent"] == "global_step2"


def test_makedirs_records_any_failure_instead_of_raising(tmp_path, monkeypatch):
    """DeepSpeed's rank 0 calls the checkpoint engine's makedirs just before a barrier
    (engine.save_checkpoint); an exception other than OSError escaped it (sweep: save.makedirs,
    kind error), so rank 0 left the save while rank 1 waited in the barrier: both exited 1 on a
    broken connection instead of agreeing on a failed save and training on."""
    from finetune.checkpoint.writer import GuardedWriter

    monkeypatch.setenv(seams.FAULT, "save.makedirs:0:3:error")
    monkeypatch.delenv("RANK", raising=False)
    w = GuardedWriter(Inner())
    w.reset(tmp_path, step=3)
    w.makedirs(tmp_path / "a", exist_ok=True)
    assert w.error is not None and "InjectedFault" in w.error


def test_a_run_resumed_at_its_last_step_finishes_the_commit_a_crash_cut_short(
    tmp_path, tiny_module
):
    """kill -9 of the whole job between the final checkpoint's rename and its `latest` write (kill
    trial, seed 48): the resume takes that checkpoint (commit order) and has nothing to save, so
    `latest` named the older checkpoint for good and --save_total_limit stayed exceeded."""
    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    run_saves(m, progress, [2, 4, 6])
    # the crash: renamed, `latest` and retention not done
    (tmp_path / "latest").write_text("global_step4\n")
    cfg = make_cfg(tmp_path, save_total_limit=2, resume_from_checkpoint="auto")
    m, progress, plan = make_manager(cfg, tiny_module, run_id="run2")
    assert plan.folder.name == "global_step6"
    assert m.at_end(6) == 0
    assert (tmp_path / "latest").read_text().strip() == "global_step6"
    assert OutputDir(tmp_path).tags() == ["global_step4", "global_step6"]


def test_a_save_never_replaces_a_folder_finetune_did_not_commit(tmp_path, caplog):
    """A folder under a checkpoint's name without a manifest (a plain DeepSpeed save, a copy by
    hand) was deleted by the same-tag swap of a save of that step; it is now set aside, intact."""

    (tmp_path / "global_step4").mkdir()
    (tmp_path / "global_step4" / "mp_rank_00_model_states.pt").write_bytes(b"someone else's")
    s = OutputDir(tmp_path)
    s.commit("global_step4", stage(s, "global_step4", b"ours"), 1, {})
    assert (
        tmp_path / "global_step4" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    ).read_bytes() == b"ours"
    [kept] = (tmp_path / ".abandoned").iterdir()
    assert kept.name.startswith("global_step4-no-manifest")
    assert (kept / "mp_rank_00_model_states.pt").read_bytes() == b"someone else's"
    assert "not committed by finetune" in caplog.text
