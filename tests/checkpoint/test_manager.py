"""Checkpoint policy and commit protocol, without processes: latest, retention, crash points."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from finetune.checkpoint.manager import commit_staged, select_for_deletion
from finetune.checkpoint.manifest import MANIFEST, hash_file, read_manifest
from finetune.checkpoint.resume import resume_candidates
from finetune.checkpoint.storage import STAGING, LocalStorage
from finetune.checkpoint.writer import FAIL_ENV, GuardedWriter


class FakeStorage(LocalStorage):
    """LocalStorage on a temp dir that can crash at a chosen operation."""

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


def stage(storage: LocalStorage, tag: str, payload: bytes = b"weights") -> dict:
    folder = storage.root / STAGING / tag
    folder.mkdir(parents=True)
    (folder / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(payload)
    return {"zero_pp_rank_0_mp_rank_00_model_states.pt": hash_file(folder / "zero_pp_rank_0_mp_rank_00_model_states.pt")}


def complete(storage: LocalStorage, tag: str) -> bool:
    return read_manifest(storage.root / tag) is not None


def test_commit_makes_a_complete_folder_and_moves_latest(tmp_path):
    s = LocalStorage(tmp_path)
    commit_staged(s, "global_step2", stage(s, "global_step2"), 2, {"torch": "x"})
    assert s.read_latest() == "global_step2" and complete(s, "global_step2")
    manifest = read_manifest(tmp_path / "global_step2")
    assert manifest["world_size"] == 2 and manifest["tag"] == "global_step2"
    assert manifest["files"]["zero_pp_rank_0_mp_rank_00_model_states.pt"]["size"] == len(b"weights")
    assert not (tmp_path / STAGING).exists()
    assert not list(tmp_path.glob(".latest*"))


@pytest.mark.parametrize("crash_at", ["replace_dir", "write_latest"])
def test_crash_during_commit_leaves_latest_on_a_complete_checkpoint(tmp_path, crash_at):
    s = FakeStorage(tmp_path)
    commit_staged(s, "global_step2", stage(s, "global_step2"), 1, {})
    s.crash_at = crash_at
    with pytest.raises(OSError):
        commit_staged(s, "global_step4", stage(s, "global_step4"), 1, {})
    assert s.read_latest() == "global_step2" and complete(s, "global_step2")
    # Whatever is visible under a final name is complete: never a folder without its manifest.
    assert all(complete(s, t) for t in s.tags())


def test_recommitting_an_existing_step_swaps_the_folder_without_a_gap(tmp_path):
    s = LocalStorage(tmp_path)
    commit_staged(s, "global_step4", stage(s, "global_step4", b"old timeline"), 1, {})
    commit_staged(s, "global_step4", stage(s, "global_step4", b"new timeline!"), 1, {})
    assert (tmp_path / "global_step4" / "zero_pp_rank_0_mp_rank_00_model_states.pt").read_bytes() == b"new timeline!"
    assert s.read_latest() == "global_step4"
    assert not (tmp_path / STAGING).exists()


def test_tags_sort_by_step_not_by_name_or_mtime(tmp_path):
    for name in ["global_step10", "global_step9", "global_step100", "notes", "global_stepX"]:
        (tmp_path / name).mkdir()
    assert LocalStorage(tmp_path).tags() == ["global_step9", "global_step10", "global_step100"]


def test_retention_deletes_oldest_beyond_limit_but_never_protected():
    tags = ["global_step2", "global_step4", "global_step6", "global_step10"]
    assert select_for_deletion(tags, 2, {"global_step10"}) == ["global_step2", "global_step4"]
    # `latest` points at an older one (e.g. after resuming from it): it survives, something else goes.
    assert select_for_deletion(tags, 2, {"global_step10", "global_step2"}) == ["global_step4", "global_step6"]
    assert select_for_deletion(tags, 5, {"global_step10"}) == []


def test_resume_candidates_prefer_latest_then_newest():
    tags = ["global_step2", "global_step4", "global_step8"]
    assert resume_candidates("global_step4", tags) == ["global_step4", "global_step8", "global_step2"]
    assert resume_candidates(None, tags) == ["global_step8", "global_step4", "global_step2"]
    assert resume_candidates("global_step99", tags) == ["global_step8", "global_step4", "global_step2"]


class _Inner:
    zipfile_serialization = True


def test_guarded_writer_checksums_what_it_wrote(tmp_path):
    w = GuardedWriter(_Inner())
    w.reset(tmp_path, step=3)
    w.save({"x": torch.arange(10)}, str(tmp_path / "a.pt"))
    assert w.error is None
    assert w.files["a.pt"] == hash_file(tmp_path / "a.pt")
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["x"], torch.arange(10))


def test_guarded_writer_records_failures_instead_of_raising(tmp_path, monkeypatch):
    monkeypatch.setenv(FAIL_ENV, "0:3")
    w = GuardedWriter(_Inner())
    w.reset(tmp_path, step=3)
    w.save({"x": torch.ones(2)}, str(tmp_path / "a.pt"))
    w.save({"x": torch.ones(2)}, str(tmp_path / "b.pt"))
    assert "injected I/O error" in w.error and "a.pt" in w.error
    assert not (tmp_path / "b.pt").exists() and w.files == {}
    w.reset(tmp_path, step=5)  # the seam is step-specific
    w.save({"x": torch.ones(2)}, str(tmp_path / "c.pt"))
    assert w.error is None


def test_guarded_writer_reports_a_directory_in_the_way(tmp_path):
    (tmp_path / "a.pt").mkdir()
    w = GuardedWriter(_Inner())
    w.reset(tmp_path)
    w.save({"x": torch.ones(2)}, str(tmp_path / "a.pt"))
    assert w.error and "IsADirectoryError" in w.error


def test_manifest_json_is_plain_json(tmp_path):
    s = LocalStorage(tmp_path)
    commit_staged(s, "global_step1", stage(s, "global_step1"), 1, {"deepspeed": "0"})
    data = json.loads((tmp_path / "global_step1" / MANIFEST).read_text())
    assert data["algorithm"] == "xxh3_128" and data["total_bytes"] == len(b"weights")
