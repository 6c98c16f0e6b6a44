"""DeepSpeed's checkpoint writes made durable, checksummed, and unable to desynchronise ranks.

``GuardedWriter`` replaces the engine's checkpoint engine: each file is fsynced and hashed as it is
written, and a failure is *recorded* instead of raised, so every rank still reaches the collectives
inside ``engine.save_checkpoint``; the Checkpointer then agrees on the outcome across ranks.

With ``reset(..., background=True)`` (--async_save) ``save`` only plans a snapshot (``host_plan``,
below): host buffers are found or allocated and the state dict's structure copied, but no tensor
byte is. ``start``'s thread then copies the tensors into those buffers (``run_copies``, lazily:
training's next forward and backward run meanwhile, since they change none of the saved state; the
optimizer step first calls ``wait_copied``), and writes the copies with the same code as a
synchronous save. ``done``/``join`` tell when the writes are done; the recorded error and files
are read only then.

Fault sites (faults.py): ``save.makedirs``, ``save.write_rank_files``, ``save.fsync``,
``save.recovery_script``, ``save.host_copy``, ``save.copy``, at the save's step
(``save.copy``, ``save.write_rank_files`` and ``save.fsync`` run on the background thread under
--async_save). Test seam:
``FINETUNE_SLOW_SAVE=<seconds>`` sleeps after each file, so a test can act (send a signal, kill a
rank) while a save is surely in flight.

--async_save's snapshot: ``host_plan`` and ``run_copies`` copy a state dict's tensors into host
memory *storage by storage*: tensors that share a storage (views, DeepSpeed's flat partitions) still
share one in the copy, so ``torch.save`` of the copy writes the same bytes as ``torch.save`` of the
original would have at that instant (tests compare the manifests' checksums). Everything else in the
dict is deep-copied: optimizer param groups, the scheduler's counters and the like change at the
next step. On a GPU the copies go into page-locked buffers, else into page-aligned ones, and every
storage starts at a 4096-byte boundary in the file (STORAGE_ALIGNMENT), so O_DIRECT writes a
snapshot from where it lies (io/direct.py). Either way the buffers are kept from one save to the
next (keyed by file name and position, reused when the storage's size matches), so a save after the
first allocates nothing and faults in no pages: the host memory stays allocated between saves.
``Queue`` holds the copies and the paths and writes them on one thread, in order, with the same
write function as a synchronous save (fsync, checksums, failures recorded); once the copy is done,
at a lower CPU priority than training (WRITER_NICE). Its host memory is the sum of the copied
storages: the bytes this rank's rank files hold, about 1x its shard.
"""

from __future__ import annotations

import copy
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.serialization import config as serialization_config

from finetune.io import seams
from finetune.io.direct import ZERO_COPY_MIN, finish, open_for_write
from finetune.io.durable import HashingWriter, WriteCancelled
from finetune.io.faults import fault_point
from finetune.io.progress import progress
from finetune.weights import safe_load

if TYPE_CHECKING:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

# What a save wrote: {path relative to its staging folder: (size, xxh3)}.
Files = dict[str, tuple[int, str]]
# Host buffers kept from one save to the next: (file name, storage position) -> a byte buffer.
Pool = dict[tuple[str, int], torch.Tensor]
# A planned snapshot's copies still to make: (host buffer, live storage as bytes) pairs.
Copies = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class SaveRecord:
    """One save's writes: what each rank reports at the agree step. A save given up (a lost lease, a
    write past its deadline) keeps its own record, so a thread that comes back later writes into it,
    never into a later save's."""

    staging: Path | None
    step: int | None
    error: str | None = None
    files: Files = field(default_factory=dict)
    # set: stop at the next piece
    cancelled: threading.Event = field(default_factory=threading.Event)
    current: HashingWriter | None = None  # the file being written (its size: progress)
    # seconds per phase (copy, hash, write, fsync, serialize, cpu: the writer thread's CPU time)
    stats: dict[str, float] = field(default_factory=dict)
    pacer: Pacer | None = None  # --async_save: spreads the write over a few steps' time

    def release(self) -> None:
        if self.pacer is not None:
            self.pacer.released.set()

    def busy_s(self) -> float:
        """Seconds this rank's writer spent on the save's files: an --async_save's copy of the
        snapshot, serialization with hashing and writing, fsync; the waits that pace a background
        write to training excluded (what the same files take when nothing paces them)."""
        s = self.stats
        return (
            s.get("copy", 0.0)
            + s.get("torch_save", 0.0)
            + s.get("fsync", 0.0)
            - s.get("paced", 0.0)
        )

    def fail(self, path: str | Path | None, e: BaseException) -> None:
        """Keep the first failure: the one every rank is told of."""
        if self.error is None:
            self.error = f"{type(e).__name__} writing {path}: {getattr(e, 'strerror', None) or e}"


# A background write is spread over this many training steps' time (measured between optimizer
# steps), so that no single step absorbs all of its CPU; anyone waiting for it ends the pacing.
PACE_STEPS = 2
PACE_MAX_S = 60.0
PACE_MIN_BYTES = 64 << 20  # a smaller write's CPU is too little to spread: at full speed


class Pacer:
    """Called with each piece's size: sleeps until that share of ``total`` bytes is due, the
    write spread evenly over ``seconds``. ``released``: set, no more sleeping."""

    def __init__(self, seconds: float, total: int):
        self.seconds = min(seconds, PACE_MAX_S)
        self.total = max(total, 1)
        self.done = 0  # bytes written so far
        self.start: float | None = None
        self.released = threading.Event()

    def __call__(self, nbytes: int) -> None:
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        self.done += nbytes
        delay = self.start + self.seconds * min(self.done / self.total, 1.0) - now
        if delay > 0:
            self.released.wait(delay)


class GuardedWriter:
    """Wraps DeepSpeed's checkpoint engine: durable, checksummed writes; failures
    recorded, not raised."""

    def __init__(self, inner: CheckpointEngine):
        self.inner = inner
        self.buffers: Pool = {}  # --async_save: host buffers kept from one save to the next
        self.pace_s: float | None = None  # --async_save: PACE_STEPS x the last step's time
        self.last_update: float | None = None  # when the last optimizer step began
        self.record = SaveRecord(None, None)
        self.queue: Queue | None = None  # --async_save: the snapshot's copies and writes

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    # DeepSpeed's engine loads every rank file through its checkpoint engine: restricted to tensors,
    # plain data and the classes DeepSpeed pickles (a checkpoint is otherwise code: safe_load.py).
    load = staticmethod(safe_load.load)

    def reset(
        self, staging: Path | None, step: int | None = None, background: bool = False
    ) -> None:
        """A new save into ``staging``; ``background``: its writes queued for a thread."""
        record = SaveRecord(staging, step)
        self.record = record
        self.queue = None
        if background:

            def write(state: object, path: str) -> None:
                self._write(state, path, record, direct=True)  # into this save's record

            self.queue = Queue(write, record)

    # This save's record, as the Checkpointer reads it (after the writes are done).

    @property
    def staging(self) -> Path | None:
        return self.record.staging

    @property
    def step(self) -> int | None:
        return self.record.step

    @property
    def error(self) -> str | None:
        return self.record.error

    @property
    def files(self) -> Files:
        return self.record.files

    @property
    def snapshot_bytes(self) -> int:
        return self.queue.bytes if self.queue is not None else 0

    def start(self) -> None:
        """--async_save: start writing what ``save`` snapshotted (a no-op for a synchronous save).
        A thread that cannot start is recorded like a failed write: raising here, on one rank,
        would leave the others in the next collective."""
        if self.queue is None:
            return
        if self.pace_s and self.queue.bytes >= PACE_MIN_BYTES:
            self.record.pacer = Pacer(self.pace_s, self.queue.bytes)
        try:
            self.queue.start()
        except Exception as e:  # noqa: BLE001 — reported to all ranks at the agree step
            self.fail(self.staging, e)
            self.queue.copied.set()
            self.queue.finished.set()

    def done(self) -> bool:
        """Whether this save's writes are over (always, for a synchronous save)."""
        return self.queue is None or self.queue.done()

    def wait_copied(self) -> float:
        """Before anything changes the saved state (the optimizer step): wait until the snapshot's
        tensors are copied; returns the seconds waited (0 when nothing is being copied)."""
        now = time.perf_counter()
        if self.last_update is not None:  # a step's time: what the next write is paced by
            self.pace_s = PACE_STEPS * (now - self.last_update)
        self.last_update = now
        if self.queue is None or self.queue.copied.is_set():
            return 0.0
        return self.queue.wait_copied()

    def join(self) -> None:
        """Wait for this save's writes, at full speed."""
        if self.queue is not None:
            self.record.release()  # waited for: full speed
            self.queue.join()

    def join_progressing(self) -> None:
        """``join`` inside an agreed step: every piece written counts as the step's progress, so a
        write that hangs (a dead mount) trips the step's deadline and a slow one does not."""
        if self.queue is None:
            return
        record = self.record
        seen: tuple[int, int] | None = None  # (files written, bytes of the current one)
        record.release()  # waited for: full speed
        while not self.queue.finished.wait(0.5):
            now = (len(record.files), record.current.size if record.current is not None else 0)
            if now != seen:
                seen = now
                progress()

    def cancel(self) -> None:
        """Stop this save's writes in progress at their next piece (recorded as its failure)."""
        self.record.cancelled.set()
        self.record.release()

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        try:
            fault_point("save.makedirs", self.step)
            os.makedirs(path, exist_ok=exist_ok)
        except Exception as e:  # noqa: BLE001
            # recorded like a write: rank 0 calls this just before a barrier
            self.fail(path, e)

    def save(self, state_dict: object, path: str) -> None:
        """DeepSpeed's call for each rank file: written now, or (--async_save) its snapshot
        planned and queued; a failure is recorded."""
        if self.error is not None:
            return
        if self.queue is not None:
            try:
                fault_point("save.host_copy", self.step)
                state, nbytes, copies = host_plan(state_dict, self.buffers, os.path.basename(path))
                self.queue.add(state, path, nbytes, copies)
            except Exception as e:  # noqa: BLE001 — recorded like a write
                self.fail(path, e)
            return
        self._write(state_dict, path, self.record)

    def _write(
        self, state_dict: object, path: str, record: SaveRecord, direct: bool = False
    ) -> None:
        """Write one file of the save ``record`` is of (its own record: see SaveRecord).
        ``direct`` (a background save's): with O_DIRECT where the filesystem takes it, for the
        writer's CPU (what competes with training); a synchronous save, which training waits for,
        through the page cache, the faster on the test machine (docs/BENCHMARKS.md)."""
        if record.error is not None:
            return
        w = None
        try:
            fault_point("save.write_rank_files", record.step)
            if record.cancelled.is_set():
                raise WriteCancelled(
                    "the save was given up (a lost lease, or a write past its deadline)"
                )
            with open_for_write(path, direct) as f:
                w = HashingWriter(f, record.cancelled, record.stats, record.pacer)
                record.current = w
                t0 = time.perf_counter()
                _torch_save(state_dict, w, getattr(self.inner, "zipfile_serialization", True))
                finish(f)
                t1 = time.perf_counter()
                fault_point("save.fsync", record.step)
                os.fsync(f.fileno())
                add_time(record.stats, "fsync", time.perf_counter() - t1)
                add_time(record.stats, "torch_save", t1 - t0)
            record.files[os.path.relpath(path, record.staging)] = (w.size, w.digest())
            seams.pause(seams.SLOW_SAVE)
        except Exception as e:  # noqa: BLE001 — any failure is reported to all ranks at the agree step
            record.fail(path, w.os_error if w is not None and w.os_error else e)

    def guard(self, fn: Callable[..., object]) -> Callable[..., object]:
        """Wrap a DeepSpeed write helper so it records a failure instead of raising.

        DeepSpeed's rank-0-only ``_copy_recovery_script`` runs *before* the barrier that ends
        ``save_checkpoint``; had it raised on a full disk, rank 0 would skip that barrier and the
        ranks would fall out of step (seen here as a gloo collective mismatch).
        """

        def guarded(path: str, *args: object, **kwargs: object) -> object:
            try:
                fault_point("save.recovery_script", self.step)
                return fn(path, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 — reported to all ranks at the agree step
                self.fail(path, e)
                return None

        return guarded

    def fail(self, path: str | Path | None, e: BaseException) -> None:
        """Record that writing ``path`` failed (the save fails at its commit;
        nothing raises here)."""
        self.record.fail(path, e)


# ---------- --async_save: the host-memory snapshot and its writer thread ----------


# Storages this small are copied at the save itself, not lazily: a module's buffers (BatchNorm's
# running statistics) may be changed in place by the next forward; the partitions and optimizer
# states, changed only by the optimizer step, are far larger.
EAGER_BYTES = 64 << 10


# In a rank file holding a storage of ZERO_COPY_MIN bytes or more, every storage starts at a
# multiple of this (torch's default is 64): an --async_save's snapshot, in page-aligned host
# memory, then goes to disk with O_DIRECT from where it lies (io/direct.py). A record's padding
# grows by at most this; torch.load and DeepSpeed read any alignment. A file of small storages only
# (a LoRA adapter's, a tiny model's) keeps torch's alignment: there the padding would be most of it.
STORAGE_ALIGNMENT = 4096


def _torch_save(state_dict: object, f: HashingWriter, zipfile: bool) -> None:
    """torch.save with every storage aligned to STORAGE_ALIGNMENT (where one is large) and without
    its CRC-32 of every zip record, which on one core at about 3 GB/s was most of the serialization
    time: a second checksum of bytes the file's xxh3 (about 20 GB/s) already covers. torch.load,
    DeepSpeed and safe_load read the file alike; only a zip tool's own CRC check would fail. torch
    keeps both options per thread: set for this save only."""
    config = serialization_config.save
    crc, alignment = config.compute_crc32, config.storage_alignment
    config.compute_crc32 = False
    if _largest_storage(state_dict) >= ZERO_COPY_MIN:
        config.storage_alignment = STORAGE_ALIGNMENT
    try:
        torch.save(state_dict, f, _use_new_zipfile_serialization=zipfile)
    finally:
        config.compute_crc32, config.storage_alignment = crc, alignment


def _largest_storage(obj: object) -> int:
    """The bytes of the largest tensor storage in ``obj`` (dicts, lists and tuples walked)."""
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes() if obj.layout == torch.strided else 0
    if isinstance(obj, dict):
        obj = obj.values()
    elif not isinstance(obj, (list, tuple)):
        return 0
    return max((_largest_storage(v) for v in obj), default=0)


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A snapshot's byte buffer: page-locked for a device's tensors (the copy is then a DMA), else
    page-aligned when long enough to be written from where it lies (io/direct.py)."""
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if nbytes >= ZERO_COPY_MIN:
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    return torch.empty(nbytes, dtype=torch.uint8)


def host_plan(obj: object, pool: Pool | None = None, name: str = "") -> tuple[object, int, Copies]:
    """A copy of ``obj`` whose tensors are backed by host buffers not yet filled; returns it, the
    bytes to copy and the copies, (destination, source) pairs that ``run_copies`` makes. Storages
    of at most EAGER_BYTES are copied now.

    Everything but the tensors' bytes is copied now (param groups, counters: they change at the
    next step). ``pool``: host buffers from earlier saves (page-locked for device tensors), keyed
    by (``name``, storage position); updated in place.
    """
    storages: dict[int, torch.UntypedStorage] = {}
    memo: dict[int, object] = {}
    copies: Copies = []
    eager: list[torch.device] = []
    copied = 0

    def storage_copy(st: torch.UntypedStorage) -> torch.UntypedStorage:
        nonlocal copied
        # the storage's identity, as torch.save keys it (empty storages all have data_ptr 0)
        key = st._cdata
        if key not in storages:
            src = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
            slot = (name, len(storages))
            dst = pool.get(slot) if pool is not None else None
            if dst is None or dst.numel() != st.nbytes():
                # Kept for the next save: a fresh buffer costs its page faults at every save
                # (bench/writer_interference.py: 65-135 ms for 300 MiB, 15-28 ms into a kept one).
                dst = host_buffer(st.nbytes(), pinned=st.device.type != "cpu")
                if pool is not None:
                    pool[slot] = dst
            if st.nbytes() <= EAGER_BYTES:  # a buffer a forward may change in place: now
                dst.copy_(src, non_blocking=st.device.type == "cuda")
                eager.append(st.device)
            else:
                copies.append((dst, src))
            storages[key] = dst.untyped_storage()
            copied += st.nbytes()
        return storages[key]

    def tensor_copy(t: torch.Tensor) -> torch.Tensor:
        new = torch.empty(0, dtype=t.dtype).set_(
            storage_copy(t.untyped_storage()), t.storage_offset(), t.size(), t.stride()
        )
        if isinstance(t, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
        elif t.requires_grad:
            new.requires_grad_(True)
        # Python attributes are pickled with the tensor (DeepSpeed's ds_id on flat groups)
        if t.__dict__:
            new.__dict__.update(copy.deepcopy(t.__dict__, memo))
        return new

    def seed(o: object) -> None:
        if isinstance(o, torch.Tensor):
            if id(o) not in memo and o.layout == torch.strided and o.device.type != "meta":
                memo[id(o)] = tensor_copy(o)
        elif isinstance(o, dict):
            for v in o.values():
                seed(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                seed(v)

    seed(obj)
    for device in {d for d in eager if d.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()
    return copy.deepcopy(obj, memo), copied, copies


def run_copies(
    copies: Copies,
    cancelled: threading.Event | None = None,
    ready: torch.cuda.Event | None = None,
) -> None:
    """Fill a plan's host buffers. Device tensors are copied on a side stream that first waits for
    ``ready`` (an event recorded on the training stream when the save was planned), into
    page-locked buffers, then synchronised; host tensors are copied in place, storage by storage
    (torch releases the GIL for each)."""
    device = [(d, s) for d, s in copies if s.device.type == "cuda"]
    for dst, src in copies:
        if cancelled is not None and cancelled.is_set():
            raise WriteCancelled(
                "the save was given up (a lost lease, or a write past its deadline)"
            )
        if src.device.type != "cuda":  # host tensors; another accelerator's copy is blocking
            dst.copy_(src)
    if device:
        stream = torch.cuda.Stream(device=device[0][1].device)
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            for dst, src in device:
                dst.copy_(src, non_blocking=True)
        stream.synchronize()


# Once the snapshot is copied (training waits for that), the writer thread runs this much nicer than
# training: its serialization, hashing and writes take the CPU training leaves (idle cores on a GPU
# host; the gaps between a CPU rank's ops), not a share of training's own.
WRITER_NICE = 10


def yield_cpu(nice: int = WRITER_NICE) -> None:
    """Lower the calling thread's CPU priority by ``nice`` (Linux: nice is per thread, and the
    threads it starts inherit it). Never raises: where it can't, the writer keeps its priority."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (AttributeError, OSError):
        pass


def add_time(stats: dict[str, float] | None, key: str, seconds: float) -> None:
    if stats is not None:
        stats[key] = stats.get(key, 0.0) + seconds


class Queue:
    """Copies then writes queued (state dict, path) snapshots on one background thread, in order:
    every snapshot's tensors first (``copied`` is set then, failed or not), then the files."""

    def __init__(self, write: Callable[[object, str], None], record: SaveRecord | None = None):
        self.write = write
        self.record = record
        self.items: list[tuple[object, str]] = []
        self.tasks: list[tuple[str | Path, Callable[[], None]]] = []  # (what, fn): after the files
        self.copies: Copies = []
        self.bytes = 0
        self.thread: threading.Thread | None = None
        self.finished = threading.Event()
        self.copied = threading.Event()
        self.ready: torch.cuda.Event | None = None  # CUDA: the training stream's, copies wait

    def add(self, state: object, path: str, nbytes: int, copies: Copies | None = None) -> None:
        self.items.append((state, path))
        self.copies += copies or []
        self.bytes += nbytes

    def then(self, what: str | Path, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the thread after the files are written (unless one failed); its failure
        is recorded against ``what``."""
        self.tasks.append((what, fn))

    def start(self) -> None:
        if any(src.device.type == "cuda" for _, src in self.copies):
            self.ready = torch.cuda.Event()
            self.ready.record()
        self.thread = threading.Thread(target=self._drain, name="finetune-async-save", daemon=True)
        self.thread.start()

    def wait_copied(self) -> float:
        """Wait until the snapshot's tensors are copied; the seconds waited."""
        t0 = time.perf_counter()
        self.copied.wait()
        return time.perf_counter() - t0

    def _drain(self) -> None:
        record = self.record
        stats = record.stats if record is not None else None
        cpu0 = time.thread_time()
        try:
            t0 = time.perf_counter()
            try:
                seams.pause(seams.SLOW_COPY)
                fault_point("save.copy", record.step if record else None)
                run_copies(self.copies, record.cancelled if record else None, self.ready)
            except Exception as e:  # noqa: BLE001 — recorded like a write; nothing is written
                if record is None:
                    raise
                record.fail("the snapshot's host copy", e)
                self.items.clear()
            finally:
                self.copies = []
                self.copied.set()
                add_time(stats, "copy", time.perf_counter() - t0)
            yield_cpu()
            while self.items:
                state, path = self.items.pop(0)
                self.write(state, path)
                del state  # the host copy goes as soon as it is on disk
            for what, fn in self.tasks:
                if record is not None and record.error is not None:
                    break
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 — recorded like a write
                    if record is None:
                        raise
                    record.fail(what, e)
        finally:
            add_time(stats, "cpu", time.thread_time() - cpu0)
            self.items.clear()
            self.tasks.clear()
            self.copied.set()
            self.finished.set()

    def done(self) -> bool:
        return self.finished.is_set()

    def join(self) -> None:
        self.finished.wait()
