"""An --async_save's rank files written with O_DIRECT: from a page-aligned buffer straight to the
device, without a second copy of every byte into the page cache. (A synchronous save, which
training waits for, writes through the page cache: faster in wall time on the test machine, 2.6
GB/s against 1.8 for O_DIRECT with one request in flight per rank; P3 in docs/BENCHMARKS.md.)

Measured on the 2-core test machine (ext4 on virtio, 512 MB, docs/BENCHMARKS.md "Saves training
does not feel"): a buffered write + fsync took 2.5-4.1 s and ~0.9 s of the writer's CPU, plus the
kernel's write-back; O_DIRECT took 0.26-0.44 s and 0.02 s of CPU. The CPU is what a background
save takes from training (FastPersist and DeepNVMe write this way for the same reason).

``open_for_write(path)`` gives a ``DirectFile`` where the filesystem takes O_DIRECT, else a plain
buffered file (tmpfs, some network filesystems: EINVAL at open). A ``DirectFile`` copies what it is
given into its aligned buffer (numpy: the GIL is released for the copy) and writes whole buffers;
``finish`` (or ``close``) writes the unaligned tail with O_DIRECT cleared. A write refused with
EINVAL (a filesystem that takes the flag at open only) switches the file to buffered writes.
Either way the caller's closing fsync makes the file durable, as before.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os

import numpy as np

from finetune.io import seams

_ALIGN = 4096  # covers 512-byte and 4 KiB logical blocks
_BUFFER = 8 << 20
_DIRECT = getattr(os, "O_DIRECT", 0)


class DirectFile:
    """A write-only file written through O_DIRECT in whole, aligned buffers."""

    def __init__(self, fd: int, buffer: int = _BUFFER):
        self.fd, self.direct = fd, True
        self.buf = mmap.mmap(-1, buffer)  # page-aligned, as O_DIRECT needs
        self.view = np.frombuffer(self.buf, dtype=np.uint8)
        self.fill = 0
        self.closed = False

    def write(self, data) -> int:
        src = np.frombuffer(data, dtype=np.uint8)
        done = 0
        while done < len(src):
            n = min(len(self.view) - self.fill, len(src) - done)
            self.view[self.fill : self.fill + n] = src[done : done + n]
            self.fill += n
            done += n
            if self.fill == len(self.view):
                self._drain(self.fill)
        return done

    def _drain(self, n: int) -> None:
        """Write the buffer's first ``n`` bytes (a multiple of _ALIGN while direct)."""
        view, written = memoryview(self.buf), 0
        try:
            while written < n:
                try:
                    written += os.write(self.fd, view[written:n])
                except OSError as e:
                    if e.errno != errno.EINVAL or not self.direct:
                        raise
                    # the filesystem took the flag at open but not this write
                    self._buffered()
        finally:
            view.release()
        if n < self.fill:
            self.buf.move(0, n, self.fill - n)
        self.fill -= n

    def _buffered(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~_DIRECT)
        self.direct = False

    def flush(self) -> None:
        """Write every whole aligned block held (the tail waits for ``finish``)."""
        whole = self.fill - self.fill % _ALIGN if self.direct else self.fill
        if whole:
            self._drain(whole)

    def fileno(self) -> int:
        return self.fd

    def finish(self) -> None:
        """Write everything held, the unaligned tail through the page cache (then fsync)."""
        self.flush()
        if self.fill:
            if self.direct:
                self._buffered()
            self._drain(self.fill)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.finish()
        finally:
            os.close(self.fd)
            self.view = None
            self.buf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:  # the write failed: close without writing more
            self.fill = 0
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
            return DirectFile(fd)
    return open(path, "wb")


def finish(f) -> None:
    """Everything written to ``f`` (``open_for_write``'s) handed to the kernel: fsync it next."""
    (f.finish if isinstance(f, DirectFile) else f.flush)()
