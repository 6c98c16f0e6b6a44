"""Checkpoint files written with O_DIRECT (finetune/io/direct.py): the same bytes as a buffered
write, whatever the pieces; a fallback where the filesystem refuses the flag; errors surface."""

from __future__ import annotations

import errno
import mmap
import os
import random
import shutil
import subprocess
import threading
import time
import uuid

import numpy as np
import pytest
import torch

from finetune.io import direct
from finetune.io.direct import DirectFile, finish, open_for_write
from finetune.io.durable import HashingWriter, hash_file


def _takes_o_direct(folder) -> bool:
    try:
        fd = os.open(folder / f".probe-{uuid.uuid4().hex}", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


@pytest.fixture
def folder(tmp_path):
    if not hasattr(os, "O_DIRECT") or not _takes_o_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem does not take O_DIRECT")
    return tmp_path


def _pieces(seed: int) -> list[bytes]:
    rnd = random.Random(seed)
    sizes = [1, 4095, 4096, 4097, 16384, 40000, 3, 70000, 0, 12288, 5]
    rnd.shuffle(sizes)
    return [rnd.randbytes(n) for n in sizes]


@pytest.mark.parametrize("seed", range(4))
def test_any_pieces_give_the_bytes_written(folder, seed, monkeypatch):
    pieces = _pieces(seed)
    path = folder / "f.bin"
    monkeypatch.setattr(direct, "_BUFFER", 4 * 4096)  # small buffers: pieces straddle them
    with open_for_write(path) as f:
        assert isinstance(f, DirectFile) and f.direct
        for p in pieces:
            assert f.write(p) == len(p)
            if seed % 2:
                f.flush()  # whole blocks only: stays direct
        assert f.direct
        finish(f)
        os.fsync(f.fileno())
    assert path.read_bytes() == b"".join(pieces)


def test_torch_save_through_it_equals_a_plain_torch_save(folder):
    state = {"w": torch.randn(1000, 37), "step": 3, "b": torch.arange(7)}
    with open(folder / "plain.pt", "wb") as f:  # as a save wrote before: a file object
        torch.save(state, HashingWriter(f))
    with open_for_write(folder / "direct.pt") as f:
        w = HashingWriter(f)
        torch.save(state, w)
        finish(f)
        os.fsync(f.fileno())
    assert (folder / "direct.pt").read_bytes() == (folder / "plain.pt").read_bytes()
    assert (w.size, w.digest()) == hash_file(folder / "direct.pt")


def test_a_write_refused_with_einval_goes_on_buffered(folder, monkeypatch):
    """A filesystem that takes O_DIRECT at open but refuses the aligned write."""
    real, refused = os.pwrite, []

    def pwrite(fd, data, offset):
        if not refused:
            refused.append(1)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    data = os.urandom(3 * (8 << 20) + 123)
    with open_for_write(folder / "f.bin") as f:
        f.write(data)
        finish(f)
        assert not f.direct
    assert refused and (folder / "f.bin").read_bytes() == data


def _in_pages(data: bytes) -> memoryview:
    """``data`` in page-aligned memory (an anonymous mapping), as a snapshot's buffer is."""
    pages = mmap.mmap(-1, len(data))
    pages[:] = data
    return memoryview(pages)


@pytest.mark.parametrize("lead", [3 * 4096, 100])
def test_aligned_memory_at_a_block_boundary_is_written_where_it_lies(folder, monkeypatch, lead):
    """A long piece starting on a block boundary in memory and in the file is written without a
    copy (its tail copied); one that starts mid-block in the file is copied whole."""
    sources, real = [], os.pwrite

    def pwrite(fd, data, offset):
        sources.append(np.frombuffer(data, dtype=np.uint8).ctypes.data)
        return real(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    monkeypatch.setattr(direct, "_BUFFER", 4 * 4096)
    head, tail = os.urandom(lead), os.urandom(300 * 4096 + 5)  # the tail: ordinary memory
    big = _in_pages(os.urandom(direct.ZERO_COPY_MIN + 4096 + 100))
    with open_for_write(folder / "f.bin") as f:
        for piece in (head, big, tail):
            assert f.write(piece) == len(piece)
        finish(f)
        os.fsync(f.fileno())
    assert (folder / "f.bin").read_bytes() == head + bytes(big) + tail
    at_boundary = lead % 4096 == 0
    assert (np.frombuffer(big, dtype=np.uint8).ctypes.data in sources) == at_boundary


def test_where_o_direct_is_refused_at_open_a_buffered_file_is_used(monkeypatch, tmp_path):
    real = os.open

    def refuse(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real(path, flags, *a)

    monkeypatch.setattr(direct.os, "open", refuse)
    with open_for_write(tmp_path / "f.bin") as f:
        assert not isinstance(f, DirectFile)
        f.write(b"abc")
        finish(f)
    assert (tmp_path / "f.bin").read_bytes() == b"abc"


def test_the_next_buffer_fills_while_earlier_ones_are_written(folder, monkeypatch):
    """The pipeline: DEPTH writes in flight at once, the caller filling the next buffer meanwhile;
    the bytes land in order whatever order the writes end in."""
    real, lock, state = os.pwrite, threading.Lock(), {"now": 0, "most": 0, "calls": 0}
    release = threading.Event()

    def pwrite(fd, data, offset):
        with lock:
            state["now"] += 1
            state["calls"] += 1
            state["most"] = max(state["most"], state["now"])
            first = state["calls"] == 1
        if first:
            release.wait(10)  # the first write ends last
        try:
            return real(fd, data, offset)
        finally:
            with lock:
                state["now"] -= 1

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    monkeypatch.setattr(direct, "_BUFFER", 4 * 4096)
    data = os.urandom(10 * 4 * 4096 + 777)
    with open_for_write(folder / "f.bin") as f:
        f.write(data[: 2 * 4 * 4096])  # two buffers handed over, the first held back
        deadline = time.monotonic() + 10
        while state["most"] < direct.DEPTH and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state["most"] == direct.DEPTH  # both in flight while the caller went on
        release.set()
        f.write(data[2 * 4 * 4096 :])
        finish(f)
        os.fsync(f.fileno())
    assert (folder / "f.bin").read_bytes() == data


def test_buffers_are_kept_for_the_next_file(folder, monkeypatch):
    made = []
    real = direct.mmap.mmap

    def mmap(*a):
        made.append(a)
        return real(*a)

    monkeypatch.setattr(direct, "_BUFFER", 4 * 4096)
    data = os.urandom(8 * 4 * 4096)
    with open_for_write(folder / "a.bin") as f:  # fills the pool for this buffer size
        f.write(data)
        finish(f)
    monkeypatch.setattr(direct.mmap, "mmap", mmap)
    for name in ("b.bin", "c.bin"):
        with open_for_write(folder / name) as f:
            f.write(data)
            finish(f)
        assert (folder / name).read_bytes() == data
    assert made == []  # every buffer came from the pool


def test_a_failed_write_in_flight_is_raised_and_the_file_closed(folder, monkeypatch):
    def pwrite(fd, data, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    monkeypatch.setattr(direct, "_BUFFER", 4 * 4096)
    with pytest.raises(OSError) as e:
        with open_for_write(folder / "f.bin") as f:
            for _ in range(8):  # more buffers than DEPTH: a later write waits for a failed one
                f.write(os.urandom(4 * 4096))
            finish(f)
    assert e.value.errno == errno.EIO
    with pytest.raises(OSError):
        os.fstat(f.fd)  # closed
    # every buffer went back to the pool once: none is shared by two later files
    spare = direct._pool.get(4 * 4096, [])
    assert len({id(b) for b in spare}) == len(spare)


@pytest.fixture
def small_ext4(tmp_path):
    """An 8 MB ext4 filesystem on a loop device (root only; skipped where it cannot be made)."""
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("needs root and mkfs.ext4 for a small loop-mounted ext4")
    with open(img, "wb") as f:
        f.truncate(8 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", str(img)], capture_output=True)
    mounted = made.returncode == 0 and (
        subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True).returncode
        == 0
    )
    if not mounted:
        pytest.skip("could not loop-mount an ext4 image here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_full_disk_raises_enospc_from_the_direct_write(small_ext4):
    with pytest.raises(OSError) as e:
        with open_for_write(small_ext4 / "f.bin") as f:
            assert isinstance(f, DirectFile)
            for _ in range(4):
                f.write(os.urandom(4 << 20))
            finish(f)
    assert e.value.errno == errno.ENOSPC
