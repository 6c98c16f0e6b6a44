"""Retention in the bucket (finetune/remote/retention.py) against a real S3 server (SeaweedFS on
loopback): it deletes only what the prefix's lineage wrote."""

from __future__ import annotations

import json

import pytest
from remote.bucket import own_prefix

from finetune.checkpoint_format.manifest import MANIFEST
from finetune.checkpoint_format.outdir import ABANDONED
from finetune.remote.retention import LINEAGE_KEY, retain

BUCKET = "retention"


@pytest.fixture
def prefix(server, monkeypatch, request):
    return own_prefix(server, monkeypatch, request)


def put(remote, key: str, lineage: str | None = None) -> None:
    remote.write_bytes(key, b"data", metadata={LINEAGE_KEY: lineage} if lineage else None)


def commit(remote, step: int, seq: int, lineage: str) -> None:
    put(remote, f"global_step{step}/rank.pt", lineage)
    manifest = {
        "tag": f"global_step{step}",
        "commit_seq": seq,
        "save_id": f"{lineage}-{seq}",
        "lineage": lineage,
        "files": {},
    }
    remote.write_bytes(f"global_step{step}/{MANIFEST}", json.dumps(manifest).encode())


def folders(remote) -> list[str]:
    return sorted(e.name for e in remote.list() if e.is_dir)


def test_only_the_lineages_own_commits_and_cut_off_copies_are_deleted(prefix):
    commit(prefix, 2, 1, "A")
    commit(prefix, 4, 2, "A")
    commit(prefix, 6, 3, "B")  # another run's commit (e.g. written before the prefix was checked)
    put(prefix, "global_step1/notes.txt")  # a person's folder: no lineage in its metadata
    put(prefix, "global_step3/rank.pt", "A")  # A's copy, cut off
    put(prefix, "global_step5/rank.pt", "B")  # B's copy, cut off
    commit(prefix, 8, 4, "A")
    retain(prefix, "global_step8", limit=1)
    assert folders(prefix) == ["global_step1", "global_step5", "global_step6", "global_step8"]


def test_without_a_limit_only_cut_off_copies_go_and_a_set_aside_commits_data_stays(prefix):
    commit(prefix, 2, 1, "A")
    put(prefix, "global_step4/rank.pt", "A")  # a set-aside commit's data (rollback)
    put(prefix, f"{ABANDONED}/global_step4-A-2/{MANIFEST}")
    put(prefix, "global_step6/rank.pt", "A")  # cut off
    commit(prefix, 8, 5, "A")
    retain(prefix, "global_step8", limit=None)
    assert folders(prefix) == [ABANDONED, "global_step2", "global_step4", "global_step8"]
