"""manifest.check_files: several files hashed at once, every problem found and reported in the
manifest's order, as one file at a time would."""

from __future__ import annotations

import os

import pytest

from finetune.checkpoint_format import manifest
from finetune.io.durable import hash_file


@pytest.mark.parametrize("threads", [1, 4])
def test_every_problem_is_found_in_order_whatever_the_threads(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(manifest, "VERIFY_THREADS", threads)
    entries = {}
    for i in range(7):
        path = tmp_path / f"f{i}.pt"
        path.write_bytes(os.urandom(3 << 20 if i % 2 else 1000))
        size, checksum = hash_file(path)
        entries[path.name] = {"size": size, "checksum": checksum}
    flipped = bytearray((tmp_path / "f1.pt").read_bytes())
    flipped[12345] ^= 1
    (tmp_path / "f1.pt").write_bytes(flipped)
    (tmp_path / "f4.pt").unlink()
    with open(tmp_path / "f5.pt", "r+b") as f:
        f.truncate(100)
    problems = manifest.check_files(tmp_path, entries, checksums=True)
    size = entries["f5.pt"]["size"]
    assert problems == [
        "f1.pt: checksum mismatch (corrupted)",
        "f4.pt: missing",
        f"f5.pt: size 100 bytes, manifest says {size} (truncated or overwritten)",
    ]
    assert manifest.check_files(tmp_path, {"f1.pt": entries["f1.pt"]}, checksums=False) == []
