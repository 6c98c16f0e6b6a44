"""--async_save: a host-memory snapshot of what DeepSpeed hands the checkpoint
engine, written later.

``host_copy`` copies a state dict's tensors into host memory *storage by storage*: tensors that
share a storage (views, DeepSpeed's flat partitions) still share one in the copy, so ``torch.save``
of the copy writes the same bytes as ``torch.save`` of the original would have at that instant
(tests compare the manifests' checksums). Everything else in the dict is deep-copied: optimizer
param groups, the scheduler's counters and the like change at the next step. On a GPU the copies
go into page-locked buffers. Either way the buffers are kept from one save to the next (keyed by
file name and position, reused when the storage's size matches), so a save after the first
allocates nothing and faults in no pages: the host memory stays allocated between saves.

``Queue`` holds the copies and the paths and writes them on one thread, in order, with the same
write function as a synchronous save (fsync, checksums, failures recorded). Its host memory is
the sum of the copied storages: the bytes this rank's rank files hold, about 1x its shard.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import torch


def host_copy(obj, pool: dict | None = None, name: str = "") -> tuple[object, int]:
    """A copy of ``obj`` whose tensors live in host memory; returns it and the bytes copied.

    ``pool``: host buffers from earlier saves (page-locked for device tensors), keyed by (``name``,
    storage position); updated in place. The device→host copies are waited for before returning.
    """
    storages: dict[int, torch.UntypedStorage] = {}
    memo: dict[int, object] = {}
    copied = 0
    on_device = False

    def storage_copy(st: torch.UntypedStorage) -> torch.UntypedStorage:
        nonlocal copied, on_device
        # the storage's identity, as torch.save keys it (empty storages all have data_ptr 0)
        key = st._cdata
        if key not in storages:
            src = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
            slot = (name, len(storages))
            dst = pool.get(slot) if pool is not None else None
            if dst is None or dst.numel() != st.nbytes():
                # Kept for the next save: a fresh buffer costs its page faults at every save
                # (bench/writer_interference.py: 65-135 ms for 300 MiB, 15-28 ms into a kept one).
                dst = torch.empty(
                    st.nbytes(), dtype=torch.uint8, pin_memory=st.device.type != "cpu"
                )
                if pool is not None:
                    pool[slot] = dst
            dst.copy_(src, non_blocking=st.device.type != "cpu")
            on_device = on_device or st.device.type != "cpu"
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

    def seed(o) -> None:
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
    if on_device:
        torch.cuda.synchronize()
    return copy.deepcopy(obj, memo), copied


class Queue:
    """Writes queued (state dict, path) pairs on one background thread, in order."""

    def __init__(self, write: Callable[[object, str], None]):
        self.write = write
        self.items: list[tuple[object, str]] = []
        self.bytes = 0
        self.thread: threading.Thread | None = None
        self.finished = threading.Event()

    def add(self, state, path: str, nbytes: int) -> None:
        self.items.append((state, path))
        self.bytes += nbytes

    def start(self) -> None:
        self.thread = threading.Thread(target=self._drain, name="finetune-async-save", daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        try:
            while self.items:
                state, path = self.items.pop(0)
                self.write(state, path)
                del state  # the host copy goes as soon as it is on disk
        finally:
            self.items.clear()
            self.finished.set()

    def done(self) -> bool:
        return self.finished.is_set()

    def join(self) -> None:
        self.finished.wait()
