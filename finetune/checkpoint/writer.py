"""DeepSpeed's checkpoint writes made durable, checksummed, and unable to desynchronise ranks.

``GuardedWriter`` replaces the engine's checkpoint engine: each file is fsynced and hashed as it is
written, and a failure is *recorded* instead of raised, so every rank still reaches the collectives
inside ``engine.save_checkpoint``; the manager then agrees on the outcome across ranks.

With ``reset(..., background=True)`` (--async_save) ``save`` only snapshots: the state dict is
copied into host memory (background.py) and written by ``start``'s thread with the same code;
``done``/``join`` tell when, and the recorded error and files are read only after that.

Fault sites (faults.py): ``save.makedirs``, ``save.write_rank_files``, ``save.fsync``,
``save.recovery_script``, ``save.host_copy``, at the save's step (``save.write_rank_files`` and
``save.fsync`` run on the background thread under --async_save). Test seam:
``FINETUNE_SLOW_SAVE=<seconds>`` sleeps after each file, so a test can act (send a signal, kill a
rank) while a save is surely in flight.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from finetune.checkpoint.background import Queue, host_copy
from finetune.io import seams
from finetune.io.durable import HashingWriter, WriteCancelled
from finetune.io.faults import fault_point
from finetune.io.progress import progress
from finetune.offline import safe_load


@dataclass
class SaveRecord:
    """One save's writes: what each rank reports at the agree step. A save given up (a lost lease, a
    write past its deadline) keeps its own record, so a thread that comes back later writes into it,
    never into a later save's."""

    staging: Path | None
    step: int | None
    error: str | None = None
    files: dict = field(default_factory=dict)  # {path relative to staging: (size, xxh3)}
    # set: stop at the next piece
    cancelled: threading.Event = field(default_factory=threading.Event)
    current: HashingWriter | None = None  # the file being written (its size: progress)

    def fail(self, path, e: BaseException) -> None:
        if self.error is None:
            self.error = f"{type(e).__name__} writing {path}: {getattr(e, 'strerror', None) or e}"


class GuardedWriter:
    """Wraps DeepSpeed's checkpoint engine: durable, checksummed writes; failures
    recorded, not raised."""

    def __init__(self, inner):
        self.inner = inner
        self.buffers: dict = {}  # --async_save: host buffers kept from one save to the next
        self.reset(None)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    # DeepSpeed's engine loads every rank file through its checkpoint engine: restricted to tensors,
    # plain data and the classes DeepSpeed pickles (a checkpoint is otherwise code: safe_load.py).
    load = staticmethod(safe_load.load)

    def reset(
        self, staging: Path | None, step: int | None = None, background: bool = False
    ) -> None:
        self.record = record = SaveRecord(staging, step)
        self.queue = (
            Queue(lambda state, path: self._write(state, path, record)) if background else None
        )

    # This save's record, as the manager reads it (after the writes are done).
    staging = property(lambda self: self.record.staging)
    step = property(lambda self: self.record.step)
    error = property(lambda self: self.record.error)
    files = property(lambda self: self.record.files)

    @property
    def snapshot_bytes(self) -> int:
        return self.queue.bytes if self.queue is not None else 0

    def start(self) -> None:
        """--async_save: start writing what ``save`` snapshotted (a no-op for a synchronous save).
        A thread that cannot start is recorded like a failed write: raising here, on one rank,
        would leave the others in the next collective."""
        if self.queue is None:
            return
        try:
            self.queue.start()
        except Exception as e:  # noqa: BLE001 — reported to all ranks by the manager
            self.fail(self.staging, e)
            self.queue.finished.set()

    def done(self) -> bool:
        return self.queue is None or self.queue.done()

    def join(self) -> None:
        if self.queue is not None:
            self.queue.join()

    def join_progressing(self) -> None:
        """``join`` inside an agreed step: every piece written counts as the step's progress, so a
        write that hangs (a dead mount) trips the step's deadline and a slow one does not."""
        if self.queue is None:
            return
        record, seen = self.record, None
        while not self.queue.finished.wait(0.5):
            now = (len(record.files), record.current.size if record.current is not None else 0)
            if now != seen:
                seen = now
                progress()

    def cancel(self) -> None:
        """Stop this save's writes in progress at their next piece (recorded as its failure)."""
        self.record.cancelled.set()

    def makedirs(self, path, exist_ok=False):
        try:
            fault_point("save.makedirs", self.step)
            os.makedirs(path, exist_ok=exist_ok)
        except Exception as e:  # noqa: BLE001
            # recorded like a write: rank 0 calls this just before a barrier
            self.fail(path, e)

    def save(self, state_dict, path) -> None:
        if self.error is not None:
            return
        if self.queue is not None:
            try:
                fault_point("save.host_copy", self.step)
                state, nbytes = host_copy(state_dict, self.buffers, os.path.basename(path))
                self.queue.add(state, path, nbytes)
            except Exception as e:  # noqa: BLE001 — recorded like a write
                self.fail(path, e)
            return
        self._write(state_dict, path, self.record)

    def _write(self, state_dict, path, record: SaveRecord) -> None:
        """Write one file of the save ``record`` is of (its own record: see SaveRecord)."""
        if record.error is not None:
            return
        w = None
        try:
            fault_point("save.write_rank_files", record.step)
            if record.cancelled.is_set():
                raise WriteCancelled(
                    "the save was given up (a lost lease, or a write past its deadline)"
                )
            with open(path, "wb") as f:
                w = record.current = HashingWriter(f, record.cancelled)
                torch.save(
                    state_dict,
                    w,
                    _use_new_zipfile_serialization=getattr(
                        self.inner, "zipfile_serialization", True
                    ),
                )
                f.flush()
                fault_point("save.fsync", record.step)
                os.fsync(f.fileno())
            record.files[os.path.relpath(path, record.staging)] = (w.size, w.digest())
            seams.pause(seams.SLOW_SAVE)
        except Exception as e:  # noqa: BLE001 — any failure is reported to all ranks by the manager
            record.fail(path, w.os_error if w is not None and w.os_error else e)

    def guard(self, fn):
        """Wrap a DeepSpeed write helper so it records a failure instead of raising.

        DeepSpeed's rank-0-only ``_copy_recovery_script`` runs *before* the barrier that ends
        ``save_checkpoint``; had it raised on a full disk, rank 0 would skip that barrier and the
        ranks would fall out of step (seen here as a gloo collective mismatch).
        """

        def guarded(path, *args, **kwargs):
            try:
                fault_point("save.recovery_script", self.step)
                return fn(path, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 — reported to all ranks by the manager
                self.fail(path, e)

        return guarded

    def fail(self, path, e: BaseException) -> None:
        """Record that writing ``path`` failed (the save fails at its commit;
        nothing raises here)."""
        self.record.fail(path, e)
