"""What a resume from the bucket counts as already in OUT (fetch.holds): the same commit,
holding what this OUT needs, a node's cut or the whole checkpoint (no server needed); and what a
fetch brings into OUT (fetch.BucketSource.fetch, a real S3 server, one process): only the files
the copy there lacks or holds damaged, never another save's files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from remote.bucket import commit_locally, own_prefix

from finetune.checkpoint_format.manifest import MANIFEST, check_file, read_manifest
from finetune.checkpoint_format.outdir import OutputDir
from finetune.checkpoint_format.policy import Committed
from finetune.io.remote import S3Storage
from finetune.remote.fetch import BucketSource, holds

WHOLE = {"save_id": "run-7", "world_size": 2}
CUT0 = {**WHOLE, "ranks": [0]}


def test_the_same_commit_holding_what_this_out_needs_is_here():
    assert holds(WHOLE, "run-7", None)  # shared storage: the whole checkpoint
    assert holds(CUT0, "run-7", [0])  # node-local, same world size: this node's cut
    assert holds(WHOLE, "run-7", [0])  # a whole copy holds every cut


def test_a_cut_is_not_the_whole_checkpoint_another_world_size_needs():
    # node-local at another world size needs every rank's files on every node: its cut is not
    # enough (it was counted as here, and the resume then refused the world size)
    assert not holds(CUT0, "run-7", None)
    assert not holds(CUT0, "run-7", [1])  # ranks placed on other nodes than when saved


def test_another_commit_or_nothing_is_not_here():
    assert not holds({**WHOLE, "save_id": "run-6"}, "run-7", None)
    assert not holds({}, "run-7", None)


# --- a fetch brings only what OUT lacks or holds damaged (real S3 server, one process) ----------

BUCKET = "fetching"
FILES = {f"part_{i}.bin": bytes([i]) * (1000 + i) for i in range(5)}


class WholeOut:
    """This process alone shares its OUT (a shared OUT at world size 1)."""

    node_local = False
    my_group = [0]
    leader = True


@pytest.fixture
def bucket(server, monkeypatch, request, tmp_path) -> tuple[S3Storage, dict]:
    """A prefix of this test's own holding a committed global_step4 of save ``save-a``, and its
    manifest; this process the only rank."""
    remote = own_prefix(server, monkeypatch, request)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    commit_locally(tmp_path / "written", 4, "save-a", **FILES)
    folder = tmp_path / "written" / "global_step4"
    for path in sorted(folder.iterdir()):
        remote.write_bytes(f"global_step4/{path.name}", path.read_bytes())
    return remote, json.loads((folder / MANIFEST).read_text())


def _fetch(remote: S3Storage, manifest: dict, out: Path, monkeypatch) -> list[str]:
    """Fetch global_step4 into ``out`` as a resume does: the objects it downloaded."""
    downloaded = []
    download = S3Storage.download_file

    def counted(self: S3Storage, rel: str, local: str | os.PathLike) -> None:
        downloaded.append(rel)
        download(self, rel, local)

    monkeypatch.setattr(S3Storage, "download_file", counted)
    commit = Committed.from_manifest("global_step4", manifest)
    root = f"s3://{BUCKET}/{remote.uri.prefix}"
    BucketSource(root, [commit], OutputDir(out), WholeOut()).fetch(commit, need=True)
    return sorted(downloaded)


def _intact(folder: Path, manifest: dict) -> bool:
    return read_manifest(folder) == manifest and not any(
        check_file(folder / name, name, meta, checksums=True)
        for name, meta in manifest["files"].items()
    )


def test_only_the_files_missing_or_damaged_here_are_downloaded(
    bucket, tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.INFO, logger="finetune")
    remote, manifest = bucket
    out = tmp_path / "out"
    shutil.copytree(tmp_path / "written", out)
    (out / "global_step4" / "part_1.bin").write_bytes(b"x" * len(FILES["part_1.bin"]))
    (out / "global_step4" / "part_3.bin").unlink()
    downloaded = _fetch(remote, manifest, out, monkeypatch)
    assert downloaded == ["global_step4/part_1.bin", "global_step4/part_3.bin"]
    assert _intact(out / "global_step4", manifest)
    assert "2 of 5 files downloaded, 3 already intact here" in caplog.text
    # the damaged copy set aside, as before: only its intact files are shared (hard links)
    (aside,) = (out / ".abandoned").iterdir()
    assert aside.name.startswith("global_step4-unverified")
    assert (aside / "part_1.bin").read_bytes() == b"x" * len(FILES["part_1.bin"])
    assert (aside / "part_0.bin").stat().st_ino == (out / "global_step4/part_0.bin").stat().st_ino


def test_a_copy_of_another_save_lends_nothing(bucket, tmp_path, monkeypatch):
    remote, manifest = bucket
    out = tmp_path / "out"
    commit_locally(out, 4, "save-b", **FILES)  # the same bytes, but another save's files
    downloaded = _fetch(remote, manifest, out, monkeypatch)
    assert downloaded == sorted(f"global_step4/{name}" for name in FILES)
    assert _intact(out / "global_step4", manifest)
