"""The resume plan's candidates with a bucket (resume.py's ``_with_bucket``), one process:
the bucket's commits join OUT's in the one commit order, each local copy paired with the bucket's
commit of that very save, so a newer bucket commit is never passed over for an older local one;
and a local commit the bucket's history went on without (another disk's run continued from before
it, or a rollback set it or its ancestor aside) is no candidate at all."""

from __future__ import annotations

import json
from pathlib import Path

from finetune.checkpoint.resume import Resumer
from finetune.checkpoint_format.outdir import OutputDir
from finetune.checkpoint_format.policy import Committed
from finetune.resolve import resolve


class FakeSource:
    """A bucket offering ``offered``; fetches nothing."""

    def __init__(self, offered: list[Committed], left: set[str] | None = None):
        self.offered = offered
        self.left = left or set()

    def commits(self) -> list[Committed]:
        return list(self.offered)

    def left_behind(self) -> set[str]:
        return set(self.left)

    def fetch(self, commit: Committed, need: bool) -> None:
        raise AssertionError("not fetched in these cases")


def _commit(tag: str, seq: int, save_id: str, parent: str | None = None) -> Committed:
    return Committed(tag, seq, save_id, parent_save_id=parent, world_size=1)


def _local(out: Path, tag: str, seq: int, save_id: str, parent: str | None = None) -> None:
    (out / tag).mkdir(parents=True)
    manifest = {"commit_seq": seq, "save_id": save_id, "world_size": 1, "files": {}}
    if parent is not None:
        manifest["parent_save_id"] = parent
    (out / tag / "manifest.json").write_text(json.dumps(manifest))


def _candidates(
    out: Path, offered: list[Committed] | None, left: set[str] | None = None
) -> list[tuple[str, str | None]]:
    cfg = resolve({"output_dir": str(out), "save_checkpoint": True}, world_size=1)
    source = FakeSource(offered, left) if offered is not None else None
    resumer = Resumer(cfg, OutputDir(cfg.ckpt.output_dir), source=source)
    return [(f.name, c.save_id if c else None) for f, c in resumer._with_bucket("auto")]


def test_without_a_bucket_the_local_commits_newest_first(tmp_path):
    _local(tmp_path, "global_step2", 1, "a")
    _local(tmp_path, "global_step4", 2, "b")
    assert _candidates(tmp_path, None) == [("global_step4", None), ("global_step2", None)]


def test_each_local_copy_is_paired_with_the_bucket_commit_of_the_same_save(tmp_path):
    _local(tmp_path, "global_step2", 1, "a")
    _local(tmp_path, "global_step4", 2, "b")
    offered = [_commit("global_step4", 2, "b"), _commit("global_step2", 1, "a")]
    assert _candidates(tmp_path, offered) == [("global_step4", "b"), ("global_step2", "a")]


def test_a_newer_bucket_commit_comes_before_an_older_local_one(tmp_path):
    _local(tmp_path, "global_step2", 1, "a")
    offered = [_commit("global_step4", 2, "b"), _commit("global_step2", 1, "a")]
    assert _candidates(tmp_path, offered) == [("global_step4", "b"), ("global_step2", "a")]


def test_another_save_of_a_step_is_its_own_candidate_in_the_commit_order(tmp_path):
    _local(tmp_path, "global_step2", 1, "a")
    _local(tmp_path, "global_step4", 3, "new")  # saved after the bucket's step 4 (not yet copied)
    offered = [_commit("global_step4", 2, "old"), _commit("global_step2", 1, "a")]
    assert _candidates(tmp_path, offered) == [
        ("global_step4", None),
        ("global_step4", "old"),
        ("global_step2", "a"),
    ]


def test_a_folder_whose_manifest_does_not_read_comes_last(tmp_path):
    _local(tmp_path, "global_step2", 1, "a")
    (tmp_path / "global_step6").mkdir()
    (tmp_path / "global_step6" / "manifest.json").write_text("{not json")
    offered = [_commit("global_step4", 2, "b")]
    assert _candidates(tmp_path, offered) == [
        ("global_step4", "b"),
        ("global_step2", None),
        ("global_step6", None),
    ]


def test_a_local_commit_the_bucket_went_on_without_is_no_candidate(tmp_path):
    # This disk saved step 2 after step 1 and was cut off before copying it; a run on another
    # disk resumed from the bucket's step 1 and committed its own step 2 there.
    _local(tmp_path, "global_step1", 1, "a1")
    _local(tmp_path, "global_step2", 2, "a2", parent="a1")
    offered = [_commit("global_step2", 2, "b2", parent="a1"), _commit("global_step1", 1, "a1")]
    assert _candidates(tmp_path, offered) == [("global_step2", "b2"), ("global_step1", "a1")]


def test_a_local_commit_newer_than_the_bucket_on_its_line_is_the_first_candidate(tmp_path):
    # cut off before its copy, and no other run went on: it is the newest of the line
    _local(tmp_path, "global_step1", 1, "a1")
    _local(tmp_path, "global_step2", 2, "a2", parent="a1")
    _local(tmp_path, "global_step3", 3, "a3", parent="a2")
    offered = [_commit("global_step1", 1, "a1")]
    assert _candidates(tmp_path, offered) == [
        ("global_step3", None),
        ("global_step2", None),
        ("global_step1", "a1"),
    ]


def test_a_copy_skipped_for_a_newer_one_stays_a_candidate(tmp_path):
    # step 2's copy was skipped for step 3's: the bucket's step 3 continues it
    _local(tmp_path, "global_step1", 1, "a1")
    _local(tmp_path, "global_step2", 2, "a2", parent="a1")
    offered = [_commit("global_step3", 3, "a3", parent="a2"), _commit("global_step1", 1, "a1")]
    assert _candidates(tmp_path, offered) == [
        ("global_step3", "a3"),
        ("global_step2", None),
        ("global_step1", "a1"),
    ]


def test_a_local_commit_after_a_rollbacks_point_is_no_candidate(tmp_path):
    # A rollback to step 1 on another disk set aside the bucket's step 2; this disk holds that
    # step 2 and its own step 3 after it.
    _local(tmp_path, "global_step1", 1, "a1")
    _local(tmp_path, "global_step2", 2, "a2", parent="a1")
    _local(tmp_path, "global_step3", 3, "a3", parent="a2")
    offered = [_commit("global_step1", 1, "a1")]
    assert _candidates(tmp_path, offered, left={"a2"}) == [("global_step1", "a1")]


def test_a_fork_is_no_candidate_when_retention_took_the_common_ancestor_from_the_bucket(tmp_path):
    # as above, but the other disk's run kept one checkpoint (--save_total_limit 1): the step 1
    # both continued is gone from the bucket and known from this disk's manifests only
    _local(tmp_path, "global_step1", 1, "a1")
    _local(tmp_path, "global_step2", 2, "a2", parent="a1")
    offered = [_commit("global_step2", 2, "b2", parent="a1")]
    assert _candidates(tmp_path, offered) == [("global_step2", "b2"), ("global_step1", None)]
