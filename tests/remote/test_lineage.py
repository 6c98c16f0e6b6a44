"""The bucket's history in one process (finetune/remote/lineage.py): which runs may write to a
prefix, what a resume continues, and a rollback's set-aside against a real S3 server (SeaweedFS on
loopback). The runs that exercise them end to end are tests/distributed/test_bucket_lineage.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from remote.bucket import own_prefix

from finetune.checkpoint_format.manifest import MANIFEST
from finetune.checkpoint_format.outdir import ABANDONED, OutputDir
from finetune.checkpoint_format.policy import Committed
from finetune.config import ConfigError
from finetune.remote.lineage import (
    History,
    check_prefix,
    later_commits,
    lineage_of,
    read_history,
    set_aside,
)

BUCKET = "lineages"


def commit(seq: int, lineage: str | None = "A", step: int | None = None) -> Committed:
    tag = f"global_step{step or 2 * seq}"
    return Committed(tag, seq, save_id=f"{lineage}-{seq}", lineage=lineage)


def manifest_of(c: Committed) -> dict:
    return {"tag": c.tag, "commit_seq": c.seq, "save_id": c.save_id, "lineage": c.lineage}


# --- who may write to a prefix ------------------------------------------------------------------


def test_a_fresh_start_on_an_empty_prefix_is_let_through():
    check_prefix(History([], []), fresh=True, head=None, where="s3://b/p")


def test_a_fresh_start_where_checkpoints_are_committed_is_refused_naming_the_prefix():
    with pytest.raises(ConfigError) as e:
        check_prefix(History([commit(1), commit(2)], []), fresh=True, head=None, where="s3://b/p")
    assert "--remote_output_dir s3://b/p holds another run's checkpoints" in str(e.value)
    assert "newest global_step4" in str(e.value)


def test_a_run_continuing_the_prefixs_lineage_is_let_through():
    check_prefix(History([commit(1), commit(2)], []), fresh=False, head=commit(1), where="p")


def test_a_run_continuing_another_lineage_is_refused_naming_both():
    theirs = History([commit(1, "A"), commit(3, "A")], [])
    with pytest.raises(ConfigError) as e:
        check_prefix(theirs, fresh=False, head=commit(2, "B"), where="s3://b/p")
    message = str(e.value)
    assert "another run's history (newest global_step6, lineage A)" in message
    assert "(global_step4, lineage B)" in message


def test_checkpoints_saved_before_lineages_belong_to_any_run_that_continues_them():
    old = History([commit(1, None), commit(2, None)], [])
    check_prefix(old, fresh=False, head=commit(3, "B"), where="p")
    check_prefix(History([commit(1, "A")], []), fresh=False, head=commit(1, None), where="p")


def test_max_seq_is_the_highest_commit_number_held():
    assert History([commit(3), commit(7), commit(5)], []).max_seq == 7
    assert History([], []).max_seq == 0


# --- what a resume continues --------------------------------------------------------------------


def write_commit(root: Path, c: Committed) -> None:
    (root / c.tag).mkdir(parents=True)
    (root / c.tag / MANIFEST).write_text(json.dumps(manifest_of(c)))


def test_lineage_of_each_kind_of_resume(tmp_path):
    out = OutputDir(tmp_path / "out")
    assert lineage_of(out, None) == (True, None)
    assert lineage_of(out, "auto") == (False, None)  # nothing local: the prefix's newest
    older, newer = commit(1, "A"), commit(2, "A")
    write_commit(tmp_path / "out", older)
    write_commit(tmp_path / "out", newer)
    fresh, head = lineage_of(out, "auto")
    assert not fresh and (head.tag, head.lineage) == ("global_step4", "A")
    fresh, head = lineage_of(out, str(tmp_path / "out" / "global_step2"))
    assert not fresh and (head.tag, head.seq) == ("global_step2", 1)
    fresh, head = lineage_of(out, str(tmp_path / "out"))  # an output dir: its newest
    assert head.tag == "global_step4"


# --- a rollback's set-aside in a real bucket ----------------------------------------------------


@pytest.fixture
def prefix(server, monkeypatch, request):
    return own_prefix(server, monkeypatch, request)


def upload_commit(remote, c: Committed) -> None:
    remote.write_bytes(f"{c.tag}/rank_file.pt", b"weights of " + c.tag.encode())
    remote.write_bytes(f"{c.tag}/{MANIFEST}", json.dumps(manifest_of(c)).encode())


def test_a_rollback_sets_aside_the_later_commits_manifest_only(prefix):
    commits = [commit(seq) for seq in (1, 2, 3, 4)]  # steps 2, 4, 6, 8
    for c in commits:
        upload_commit(prefix, c)
    history = read_history(prefix)
    assert sorted(c.tag for c in history.found) == sorted(c.tag for c in commits)
    later = later_commits(history, commits[1])  # resumed from step 4
    assert [c.tag for c in later] == ["global_step6", "global_step8"]

    entries = set_aside(prefix, later)
    assert entries == ["global_step6-A-3", "global_step8-A-4"]
    after = read_history(prefix)
    assert sorted(c.tag for c in after.found) == ["global_step2", "global_step4"]
    assert after.is_set_aside("global_step6") and not after.is_set_aside("global_step4")
    # the data stays where it was; the manifest moved, byte for byte
    assert prefix.read_bytes("global_step8/rank_file.pt") == b"weights of global_step8"
    moved = json.loads(prefix.read_bytes(f"{ABANDONED}/global_step8-A-4/{MANIFEST}"))
    assert moved == manifest_of(commits[3])
    assert prefix.read_bytes(f"global_step8/{MANIFEST}") is None


def test_a_rollback_leaves_other_lineages_and_the_resume_point_alone(prefix):
    ours, theirs = commit(1, "A"), commit(5, "B", step=10)
    for c in (ours, theirs):
        upload_commit(prefix, c)
    assert later_commits(read_history(prefix), ours) == []


def test_ls_notes_name_the_set_aside_commits_and_their_data(prefix):
    from finetune.remote.verify import notes

    commits = [commit(seq) for seq in (1, 2, 3)]
    for c in commits:
        upload_commit(prefix, c)
    set_aside(prefix, later_commits(read_history(prefix), commits[0]))
    said = notes(prefix)
    assert any(
        line.startswith("global_step6: the data of a commit set aside (.abandoned/global_step6-A-3")
        for line in said
    ), said
    assert f"{ABANDONED}: 2 commit(s) set aside (global_step4-A-2, global_step6-A-3)" in said[-1]
