"""An --async_save's rank files written with O_DIRECT: from a page-aligned buffer straight to the
device, without a second copy of every byte into the page cache. (A synchronous save, which
training waits for, writes through the page cache: faster in wall time on the test machine, 2.6
GB/s against 1.8 for O_DIRECT with one request in flight per rank; P3 in docs/BENCHMARKS.md.)

Measured on the 2-core test machine (ext4 on virtio, 512 MB, docs/BENCHMARKS.md "Saves training
does not feel"): a buffered write + fsync took 2.5-4.1 s and ~0.9 s of the writer's CPU, plus the
kernel's write-back; O_DIRECT took 0.26-0.44 s and 0.02 s of CPU. The CPU is what a background
save takes from training (FastPersist and DeepNVMe write this way for the same reason).

``open_for_write(path)`` gives a ``DirectFile`` where the filesystem takes O_DIRECT, else a plain
buffered file (tmpfs, some network filesystems: EINVAL at open). A ``DirectFile`` is a pipeline: the
caller's thread copies what it is given into an aligned buffer (numpy: the GIL is released for the
copy) while up to ``DEPTH`` earlier buffers are being written by I/O threads, each at its own offset
(``os.pwrite``), so a save's time approaches its slower stage (serializing and hashing, or the
device), not their sum. The buffers come from a small pool kept from one file, and one save, to the
next. A long write that starts on a block boundary both in memory and in the file skips the copy:
its whole blocks are written from where they lie (the caller keeps that memory unchanged until
``finish``). An --async_save's snapshot is such memory: page-aligned host buffers, serialized with
every storage aligned to 4096 bytes in the file. ``finish`` (or ``close``) waits for the writes in
flight and writes the unaligned tail with O_DIRECT cleared. A write refused with EINVAL (a
filesystem that takes the flag at open only) switches the file to buffered writes. A write's error
(ENOSPC, EIO) is raised by the next ``write``, ``flush`` or ``finish``. Either way the caller's
closing fsync makes the file durable, as before.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from finetune.io import seams

_ALIGN = 4096  # covers 512-byte and 4 KiB logical blocks
_BUFFER = 8 << 20
_DIRECT = getattr(os, "O_DIRECT", 0)
# Buffers being written at once, per file: two keep a device busy while the next one fills.
DEPTH = 2
_POOL_MAX = 8  # buffers kept for the next file (8 MB each)
# A write at least this long that starts on a block boundary in memory and in the file goes to the
# device from where it lies, without the copy into a buffer (torch.save hands over each storage in
# one write: at a 4096-byte storage alignment, and from page-aligned memory, that is every storage).
ZERO_COPY_MIN = 1 << 20

_pool: dict[int, list[mmap.mmap]] = {}  # spare buffers by size, kept across files and saves
_pool_lock = threading.Lock()


def _take(size: int) -> mmap.mmap:
    with _pool_lock:
        spare = _pool.get(size)
        if spare:
            return spare.pop()
    return mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs


def _give(buf: mmap.mmap) -> None:
    with _pool_lock:
        spare = _pool.setdefault(len(buf), [])
        if len(spare) < _POOL_MAX:
            spare.append(buf)
            return
    try:
        buf.close()
    except BufferError:  # a view of it is still alive: freed with that view
        pass


class DirectFile:
    """A write-only file written through O_DIRECT in whole, aligned buffers, ``depth`` of them in
    flight at once while the next fills."""

    def __init__(self, fd: int, buffer: int = _BUFFER, depth: int = DEPTH):
        self.fd, self.direct = fd, True
        self.buffer, self.depth = buffer, max(1, depth)
        self.buf = _take(buffer)
        self.view = np.frombuffer(self.buf, dtype=np.uint8)
        self.fill = 0  # bytes held in ``buf``
        self.offset = 0  # where ``buf``'s first byte goes in the file
        self.inflight: collections.deque[tuple[Future, mmap.mmap]] = collections.deque()
        self.io: ThreadPoolExecutor | None = None
        self.closed = False

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        src = np.frombuffer(view, dtype=np.uint8)
        done = 0
        if self.direct and len(src) >= ZERO_COPY_MIN and self._at_block(src):
            # written from where it lies: what is held goes first (it ends on a block boundary)
            done = len(src) - len(src) % _ALIGN
            if self.fill:
                self._hand_over(self.fill)
            self._make_room()
            self._submit(view[:done], done, None)
        while done < len(src):
            n = min(len(self.view) - self.fill, len(src) - done)
            self.view[self.fill : self.fill + n] = src[done : done + n]
            self.fill += n
            done += n
            if self.fill == len(self.view):
                self._hand_over(self.fill)
        return done

    def _at_block(self, src: np.ndarray) -> bool:
        """Whether ``src`` starts on a block boundary both in memory and in the file."""
        return src.ctypes.data % _ALIGN == 0 and (self.offset + self.fill) % _ALIGN == 0

    def _submit(self, data: mmap.mmap | memoryview, n: int, buf: mmap.mmap | None) -> None:
        """Write ``data``'s first ``n`` bytes at the file's end on an I/O thread; ``buf``: the
        pool's buffer they lie in (None: the caller's memory, which outlives ``finish``)."""
        if self.io is None:
            self.io = ThreadPoolExecutor(self.depth, thread_name_prefix="finetune-direct")
        self.inflight.append((self.io.submit(self._pwrite, data, n, self.offset), buf))
        self.offset += n

    def _hand_over(self, n: int) -> None:
        """Send the buffer's first ``n`` bytes (a multiple of _ALIGN while direct) to be written,
        and go on filling a free buffer, starting with what followed them."""
        full, rest = self.buf, self.fill - n
        self._submit(full, n, full)
        # ``full`` is the pipeline's now: should the wait for a free buffer raise, nothing holds
        # it twice (it would go back to the pool twice, and two files would share it)
        self.buf = self.view = None
        self.fill = 0
        buf = self._free_buffer()
        self.buf, self.view = buf, np.frombuffer(buf, dtype=np.uint8)
        if rest:  # the unaligned tail stays ahead of what comes next
            self.view[:rest] = np.frombuffer(full, dtype=np.uint8)[n : n + rest]
        self.fill = rest

    def _free_buffer(self) -> mmap.mmap:
        """A buffer to fill once fewer than ``depth`` writes are in flight: from the pool, where
        the awaited writes' buffers went (an awaited write's error raised here)."""
        self._make_room()
        return _take(self.buffer)

    def _make_room(self) -> None:
        """Wait until fewer than ``depth`` writes are in flight (an awaited one's error raised)."""
        while len(self.inflight) >= self.depth:
            future, buf = self.inflight.popleft()
            try:
                future.result()
            finally:
                if buf is not None:
                    _give(buf)

    def _pwrite(self, data: mmap.mmap | memoryview, n: int, offset: int) -> None:
        """An I/O thread's part: ``data``'s first ``n`` bytes to the file at ``offset``."""
        view, written = memoryview(data), 0
        try:
            while written < n:
                try:
                    written += os.pwrite(self.fd, view[written:n], offset + written)
                except OSError as e:
                    if e.errno != errno.EINVAL or not self.direct:
                        raise
                    # the filesystem took the flag at open but not this write
                    self._buffered()
        finally:
            view.release()

    def _wait_all(self) -> None:
        """Wait for every write in flight; the first error is raised once all have ended."""
        error = None
        while self.inflight:
            future, buf = self.inflight.popleft()
            try:
                future.result()
            except BaseException as e:  # noqa: BLE001 — raised below, once nothing is in flight
                error = error or e
            if buf is not None:
                _give(buf)
        if error is not None:
            raise error

    def _buffered(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~_DIRECT)
        self.direct = False

    def flush(self) -> None:
        """Hand over every whole aligned block held (the tail waits for ``finish``)."""
        whole = self.fill - self.fill % _ALIGN if self.direct else self.fill
        if whole:
            self._hand_over(whole)

    def fileno(self) -> int:
        return self.fd

    def finish(self) -> None:
        """Write everything held, the unaligned tail through the page cache (then fsync)."""
        self.flush()
        self._wait_all()
        if self.fill:
            if self.direct:
                self._buffered()
            self._pwrite(self.buf, self.fill, self.offset)
            self.offset += self.fill
            self.fill = 0

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.finish()
        finally:
            self._release()

    def _release(self) -> None:
        try:
            self._wait_all()
        except BaseException:  # noqa: BLE001 — a close after a failure: that error is the one told
            pass
        finally:
            if self.io is not None:
                self.io.shutdown(wait=True)
            os.close(self.fd)
            if self.buf is not None:
                self.view = None
                _give(self.buf)
                self.buf = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:  # the write failed: close without writing more
            self.closed = True
            self._release()
            return
        self.close()


def open_for_write(path, direct: bool = True):
    """A new file at ``path`` (truncated): with ``direct``, a DirectFile where O_DIRECT is taken,
    else a buffered file object. Both have write, flush, fileno and close; fsync ``fileno()``
    before closing."""
    if direct and _DIRECT and not seams.enabled(seams.BUFFERED_WRITES):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        else:
            return DirectFile(fd, _BUFFER, DEPTH)
    return open(path, "wb")


def finish(f) -> None:
    """Everything written to ``f`` (``open_for_write``'s) handed to the kernel: fsync it next."""
    (f.finish if isinstance(f, DirectFile) else f.flush)()
