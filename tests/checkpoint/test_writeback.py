"""Writeback while writing (finetune/io/durable.py ``Writeback``): what a writer has written is
handed to the kernel's writeback in consecutive ranges from the file's start, each at least the
threshold, so the disk works during the write and the closing fsync has little left; the bytes on
disk are the bytes written. (tests/offline/test_export.py: the export's shards are written so.)"""

from __future__ import annotations

import os

import pytest

from finetune.io import durable
from finetune.io.durable import HashingWriter, Writeback

EVERY = 1 << 20


@pytest.fixture
def kicks(monkeypatch):
    """The ranges handed to sync_file_range, as (fd, offset, length)."""
    got: list[tuple[int, int, int]] = []
    monkeypatch.setattr(durable, "_WRITEBACK_EVERY", EVERY)
    monkeypatch.setattr(
        durable, "_sync_file_range", lambda fd, off, n, flags: got.append((fd, off, n))
    )
    return got


def _covered(ranges: list[tuple[int, int, int]], size: int) -> None:
    offsets = [off for _, off, _ in ranges]
    assert offsets[0] == 0
    assert all(off + n == nxt for (_, off, n), nxt in zip(ranges, offsets[1:]))
    assert all(n >= EVERY for *_, n in ranges)
    end = ranges[-1][1] + ranges[-1][2]
    assert size - EVERY < end <= size  # at most one threshold's worth left to the closing fsync


def test_written_bytes_go_to_writeback_in_consecutive_ranges(tmp_path, kicks):
    data = os.urandom(5 * EVERY + 12345)
    path = tmp_path / "f"
    with open(path, "wb") as f:
        w = Writeback(f)
        for i in range(0, len(data), 300_000):  # pieces that do not line up with the threshold
            assert w.write(data[i : i + 300_000]) == len(data[i : i + 300_000])
    assert path.read_bytes() == data
    _covered(kicks, len(data))


def test_a_hashing_writer_starts_writeback_unless_the_file_bypasses_the_cache(tmp_path, kicks):
    data = os.urandom(3 * EVERY + 7)
    with open(tmp_path / "f", "wb") as f:
        w = HashingWriter(f)
        w.write(data)
    assert w.digest() == durable.hash_bytes(data)
    _covered(kicks, len(data))
    kicks.clear()
    with open(tmp_path / "g", "wb") as f:
        f.direct = True  # what io/direct.py's files say of themselves
        HashingWriter(f).write(data)
    assert kicks == []
