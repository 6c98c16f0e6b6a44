"""What the tests of finetune/remote/ share: a prefix of a test's own on the real S3 server, and a
committed checkpoint written by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from s3_server import require_s3

from finetune.checkpoint_format.manifest import MANIFEST
from finetune.io.durable import hash_bytes
from finetune.io.remote import S3Storage

Files = dict[str, tuple[int, str]]  # name → (size, xxh3), as a writer lists them


def own_prefix(
    server, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> S3Storage:
    """``s3://<the module's BUCKET>/<the test's name>``, this process's environment pointed at the
    server (the module is skipped without it)."""
    require_s3()
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    return S3Storage(f"s3://{request.module.BUCKET}/{request.node.name}")


def commit_locally(out: Path, step: int, save_id: str, **contents: bytes) -> Files:
    """A committed checkpoint in ``out`` holding ``contents``; its files as a writer lists them."""
    folder = out / f"global_step{step}"
    folder.mkdir(parents=True)
    files = {}
    for name, data in contents.items():
        (folder / name).write_bytes(data)
        files[name] = (len(data), hash_bytes(data))
    listed = {name: {"size": size, "checksum": digest} for name, (size, digest) in files.items()}
    manifest = {"commit_seq": step, "tag": folder.name, "save_id": save_id, "files": listed}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return files
