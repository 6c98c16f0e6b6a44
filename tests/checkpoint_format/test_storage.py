"""The Storage seam: LocalStorage and the in-memory storage behave alike under the same contract,
and the output dir's commit, retention and tidy-up run on either, so their failure handling is
tested without a disk (the in-memory storage fails any operation on cue)."""

from __future__ import annotations

import errno

import pytest
from memory_storage import MemoryStorage

from finetune.checkpoint_format.manifest import MANIFEST
from finetune.checkpoint_format.outdir import (
    ABANDONED,
    LATEST,
    STAGING,
    OutputDir,
    committed,
)
from finetune.io.storage import LocalStorage, Storage


@pytest.fixture(params=["local", "memory"])
def storage(request, tmp_path) -> Storage:
    return LocalStorage(tmp_path) if request.param == "local" else MemoryStorage()


def test_both_implement_the_protocol(storage):
    assert isinstance(storage, Storage)


def test_the_contract(storage):
    storage.makedirs("a/b")
    storage.write_bytes("a/b/f", b"12345")
    assert storage.stat("a/b/f").size == 5 and not storage.stat("a/b/f").is_dir
    assert storage.stat("a").is_dir and storage.stat("missing") is None
    assert [(e.name, e.is_dir) for e in storage.list("a")] == [("b", True)]
    assert storage.list("missing") == []
    assert storage.read_bytes("a/b/f") == b"12345" and storage.read_bytes("a/none") is None
    size, digest = storage.checksum("a/b/f")
    assert size == 5 and len(digest) == 32
    storage.replace_bytes("a/b/f", b"new")
    assert storage.read_bytes("a/b/f") == b"new"
    storage.rename("a", "c")
    assert storage.stat("a") is None and storage.read_bytes("c/b/f") == b"new"
    walked = [(folder, dirs, files) for folder, dirs, files in storage.walk("c")]
    assert walked == [("c/b", [], ["f"]), ("c", ["b"], [])], "deepest folder first"
    with pytest.raises(OSError):
        storage.remove("c")  # not empty
    storage.remove("c/b/f")
    storage.remove("c/b")
    storage.remove("c")
    storage.remove("c")  # missing: nothing
    assert storage.list() == []


RANK_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def stage(out: OutputDir, step: int, size: int | None = None) -> dict:
    """A staged save of ``step`` whose rank file holds ``size`` bytes (default: ``step``)."""
    rel = f"{STAGING}/global_step{step}/{RANK_FILE}"
    out.storage.makedirs(f"{STAGING}/global_step{step}")
    out.storage.write_bytes(rel, b"w" * (size or step))
    return {RANK_FILE: out.storage.checksum(rel)}


def test_commit_and_retention_on_either_storage(storage):
    out = OutputDir(storage)
    for step in (2, 4):
        out.commit(f"global_step{step}", stage(out, step), 1, {})
    assert out.tags() == ["global_step2", "global_step4"] and out.read_latest() == "global_step4"
    assert [c.tag for c in committed(out)] == ["global_step2", "global_step4"]
    # the same step committed again swaps the folders (no exchange in memory: the fallback)
    out.commit("global_step4", stage(out, 4, size=5), 1, {})
    assert out.read_manifest("global_step4")["files"][RANK_FILE]["size"] == 5
    trash = out.retire("global_step2")
    assert out.tags() == ["global_step4"] and out.purge(trash) > 0 and not out.exists(trash)
    assert not out.exists(STAGING)


def test_a_failed_rename_leaves_latest_on_the_complete_checkpoint():
    storage = MemoryStorage()
    out = OutputDir(storage)
    out.commit("global_step2", stage(out, 2), 1, {})
    files = stage(out, 4)
    storage.fail("rename", f"{STAGING}/global_step4")
    with pytest.raises(OSError):
        out.commit("global_step4", files, 1, {})
    assert out.read_latest() == "global_step2" and out.tags() == ["global_step2"]
    # staged with its manifest, never published: set aside at the next start, never deleted
    storage.failures.clear()
    out.housekeeping()
    assert out.storage.stat(f"{ABANDONED}/global_step4-staged/{MANIFEST}") is not None
    assert out.tags() == ["global_step2"]


def test_a_full_storage_fails_the_manifest_and_commits_nothing():
    storage = MemoryStorage()
    out = OutputDir(storage)
    files = stage(out, 2)
    storage.fail("write_bytes", f"*/{MANIFEST}", errno.ENOSPC)
    with pytest.raises(OSError, match="No space"):
        out.commit("global_step2", files, 1, {})
    assert out.tags() == [] and out.read_latest() is None
    assert not any(op == "rename" for op, _ in storage.calls), "nothing renamed into place"


def test_housekeeping_removes_leftovers_and_keeps_what_a_crash_committed():
    storage = MemoryStorage()
    out = OutputDir(storage)
    out.commit("global_step2", stage(out, 2), 1, {})
    # a crashed save
    storage.put(f"{STAGING}/global_step4/zero_pp_rank_0_mp_rank_00_model_states.pt")
    storage.put(".trash-global_step1-abcd1234/x.pt")  # retention interrupted
    storage.put(f".{LATEST}.tmp")
    storage.put(f"{STAGING}/global_step2.replaced/{MANIFEST}", b"{}")  # a swap interrupted...
    storage.rename("global_step2", f"{STAGING}/global_step2.tmp-move")
    storage.remove(f"{STAGING}/global_step2.tmp-move/{MANIFEST}")
    removed = dict(out.housekeeping())
    assert out.tags() == ["global_step2"], "the old folder of the swap went back under its name"
    assert set(removed) == {
        f"{STAGING}/global_step4",
        ".trash-global_step1-abcd1234",
        f".{LATEST}.tmp",
        f"{STAGING}/global_step2.tmp-move",
    }
    assert out.leftovers() == [] and not out.exists(STAGING)


def test_a_purge_that_fails_midway_is_logged_and_reports_what_it_freed(caplog):
    storage = MemoryStorage()
    out = OutputDir(storage)
    for name in ("a.pt", "b.pt", "c.pt"):
        storage.put(f".trash-global_step2-x/{name}", b"123")
    storage.fail("remove", ".trash-global_step2-x/b.pt")
    assert out.purge(".trash-global_step2-x") == 6
    assert storage.tree() == {".trash-global_step2-x/b.pt"}
    assert "could not delete .trash-global_step2-x completely (2 error(s)" in caplog.text
