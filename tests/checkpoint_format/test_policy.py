"""Commit order, the line retention counts, abandoned timelines, space: pure policy and the
storage operations behind it, on temp folders (no processes)."""

from __future__ import annotations

import json

from finetune.checkpoint_format.outdir import (
    ABANDONED,
    STAGING,
    OutputDir,
    committed,
    find_checkpoint,
)
from finetune.checkpoint_format.policy import (
    Committed,
    line_of,
    newer_than,
    resume_order,
    select_for_deletion,
    space_needed,
)
from finetune.io.durable import hash_file


def save(
    s: OutputDir, step: int, seq: int | None, parent: Committed | None = None, run: str = "r"
) -> Committed:
    """Commit a small checkpoint with a commit identity, as the manager does."""
    tag = f"global_step{step}"
    staged = s.root / STAGING / tag
    staged.mkdir(parents=True)
    (staged / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"w" * (step + 1))
    identity = (
        None
        if seq is None
        else {
            "commit_seq": seq,
            "save_id": f"{run}-{seq}",
            "parent": parent.tag if parent else None,
            "parent_save_id": parent.save_id if parent else None,
        }
    )
    s.commit(tag, {p.name: hash_file(p) for p in staged.iterdir()}, 1, {}, identity=identity)
    return Committed.from_manifest(tag, s.read_manifest(tag))


def test_resume_order_is_commit_order_not_latest_or_step(tmp_path):
    s = OutputDir(tmp_path)
    a = save(s, 2, 1)
    b = save(s, 4, 2, a)
    save(s, 6, 3, b)
    s.write_latest("global_step4")  # stale: a crash between the rename and the `latest` write
    assert resume_order(s.tags(), committed(s))[0] == "global_step6"
    assert find_checkpoint(tmp_path) == tmp_path / "global_step6"
    # A later run resumed from step 2 and re-committed step 4: the newest *commit* wins, not the
    # step.
    save(s, 4, 4, a, run="r2")
    assert resume_order(s.tags(), committed(s)) == ["global_step4", "global_step6", "global_step2"]


def test_legacy_and_unreadable_checkpoints_come_after_numbered_ones(tmp_path):
    s = OutputDir(tmp_path)
    save(s, 8, None)  # saved before commit sequence numbers: ordered by step, after numbered ones
    save(s, 2, 1)
    (tmp_path / "global_step9").mkdir()  # no manifest at all
    assert resume_order(s.tags(), committed(s)) == ["global_step2", "global_step8", "global_step9"]


def test_the_line_follows_parents_with_matching_save_ids():
    a, b = (
        Committed("global_step2", 1, "x-1"),
        Committed("global_step4", 2, "x-2", "global_step2", "x-1"),
    )
    c = Committed("global_step6", 3, "x-3", "global_step4", "x-2")
    other4 = Committed("global_step4", 5, "y-5", "global_step2", "x-1")  # same tag, another save
    assert [n.tag for n in line_of(c, [a, b, c])] == [
        "global_step2",
        "global_step4",
        "global_step6",
    ]
    d = Committed("global_step6", 6, "y-6", "global_step4", "y-5")
    assert [n.tag for n in line_of(d, [a, other4, d])] == [
        "global_step2",
        "global_step4",
        "global_step6",
    ]
    # The parent's folder now holds another save (same tag, other id): not an ancestor.
    assert [n.tag for n in line_of(c, [a, other4, c])] == ["global_step6"]


def test_retention_counts_only_the_line_and_never_the_newest():
    line = ["global_step2", "global_step4", "global_step6", "global_step10"]
    assert select_for_deletion(line, 2, {"global_step10"}) == ["global_step2", "global_step4"]
    assert select_for_deletion(line, 5, {"global_step10"}) == []
    # After resuming from step 4 of an abandoned timeline (steps 6-10 set aside, not in the line),
    # the resume point is the oldest of a 2-long line: limit 2 keeps it.
    assert select_for_deletion(["global_step4", "global_step6"], 2, {"global_step6"}) == []


def test_resuming_from_an_older_point_abandons_the_newer_commits(tmp_path):
    s = OutputDir(tmp_path)
    a = save(s, 2, 1)
    b = save(s, 4, 2, a)
    save(s, 6, 3, b)
    assert [c.tag for c in newer_than(a, committed(s))] == ["global_step4", "global_step6"]
    moved = s.set_aside("global_step6", "abandoned-x")
    assert (
        moved == f"{ABANDONED}/global_step6-abandoned-x"
        and (tmp_path / moved / "manifest.json").exists()
    )
    assert s.tags() == ["global_step2", "global_step4"]  # out of the tag namespace


def test_space_needed_is_this_storages_share():
    # First save, no previous size: 1B params × 16 B × margin, on one of 8 nodes: an eighth.
    assert space_needed(None, 10**9, 1 / 8, 16, 1.1) == int(10**9 * 16 / 8 * 1.1)
    assert space_needed(None, 10**9, 1.0, 16, 1.1) == int(10**9 * 16 * 1.1)
    # the previous checkpoint's size here wins
    assert space_needed(5000, 10**9, 1 / 8, 16, 1.1) == 5500


def test_housekeeping_removes_crashed_saves_leftovers_and_reports_bytes(tmp_path):
    s = OutputDir(tmp_path)
    save(s, 2, 1)
    # a save killed after the grace period
    (tmp_path / STAGING / "global_step7").mkdir(parents=True)
    (tmp_path / STAGING / "global_step7" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(
        b"x" * 1000
    )
    (tmp_path / STAGING / "global_step4.replaced").mkdir()
    (tmp_path / ".trash-global_step1-abcd").mkdir()
    (tmp_path / ".trash-global_step1-abcd" / "f").write_bytes(b"y" * 10)
    (tmp_path / ".latest.tmp").write_text("global_step9\n")
    (tmp_path / "global_step2" / "universal.tmp").mkdir()
    (tmp_path / ABANDONED).mkdir()
    (tmp_path / ABANDONED / "global_step9-abandoned").mkdir()  # kept: set aside on purpose
    removed = dict(s.housekeeping())
    assert removed == {
        f"{STAGING}/global_step7": 1000,
        f"{STAGING}/global_step4.replaced": 0,
        ".trash-global_step1-abcd": 10,
        ".latest.tmp": 13,
    }
    assert (
        not (tmp_path / STAGING).exists()
        and (tmp_path / ABANDONED / "global_step9-abandoned").exists()
    )
    # an interrupted conversion's pieces: kept
    assert (tmp_path / "global_step2" / "universal.tmp").is_dir()
    assert s.tags() == ["global_step2"] and s.leftovers() == []


def test_retention_deletes_by_renaming_to_trash_first(tmp_path, monkeypatch):
    s = OutputDir(tmp_path)
    save(s, 2, 1)
    seen = []
    real = s.purge
    monkeypatch.setattr(
        s, "purge", lambda rel, *a, **kw: (seen.append(rel), real(rel, *a, **kw))[1]
    )
    assert s.remove("global_step2") > 0
    assert seen and seen[0].startswith(".trash-global_step2-")  # never removed under its tag
    assert s.tags() == [] and not list(tmp_path.glob(".trash-*"))


def test_manifest_records_commit_identity(tmp_path):
    s = OutputDir(tmp_path)
    a = save(s, 2, 1)
    b = save(s, 4, 2, a)
    m = json.loads((tmp_path / "global_step4" / "manifest.json").read_text())
    assert (m["commit_seq"], m["save_id"], m["parent"], m["parent_save_id"]) == (
        2,
        "r-2",
        "global_step2",
        "r-1",
    )
    assert b.seq == 2 and b.parent == "global_step2"
