"""Which ranks see the same folder: found out with marker files, not guessed from host names
(containers share host names; a "node-local" path may be shared after all, and a "shared" one
may not be). Checkpoints use it for node-local storage and to check that OUT is shared; the
tokenized-data cache to pick one writer per storage. Every marker goes through a ``Storage``.
"""

from __future__ import annotations

import socket
import uuid

from finetune.config import ConfigError
from finetune.distributed import (
    Outcomes,
    gather_outcomes,
    io_deadline,
    is_main,
    rank,
    share_from,
    world_size,
)
from finetune.io.faults import fault_point
from finetune.io.storage import Storage

PROBE = ".storage-probe"  # marker files that show which ranks share a folder


def _touch(storage: Storage, marker: str) -> None:
    fault_point("sharing.probe")
    storage.makedirs("")
    storage.write_bytes(marker, b"")


def _unlink(storage: Storage, marker: str) -> None:
    try:
        storage.remove(marker)
    except OSError:
        pass  # a leftover marker is harmless: the next probe uses another nonce


def _cannot_write(out: Outcomes, storage: Storage, flag: str) -> None:
    if not out.ok:
        raise ConfigError(f"--{flag}: cannot write {storage.describe()}: {out.describe()}")


def sharing_groups(storage: Storage, flag: str) -> list[list[int]]:
    """Ranks grouped by which of them see the same ``storage``'s root (one group on shared
    storage). Collective.

    Found out, not guessed from host names (containers share them; a "node-local" path may be
    shared after all): every rank drops a marker file in ``storage``'s root, and ranks that see each
    other's markers share it. ``flag`` names the folder in errors.
    """
    if world_size() == 1:
        return [[0]]
    nonce = share_from(0, lambda: uuid.uuid4().hex)
    marker = f"{PROBE}-{nonce}-{rank()}"
    _cannot_write(
        gather_outcomes(
            lambda: _touch(storage, marker),
            step=f"writing a marker in {storage.describe()}",
            deadline_s=io_deadline(),
        ),
        storage,
        flag,
    )  # every marker is down
    out = gather_outcomes(
        lambda: sorted(
            int(e.name.rsplit("-", 1)[1])
            for e in storage.list()
            if e.name.startswith(f"{PROBE}-{nonce}-")
        ),
        share=True,
        step=f"listing the markers in {storage.describe()}",
        deadline_s=io_deadline(),
    )
    _cannot_write(out, storage, flag)  # and every rank has looked: markers can go
    _unlink(storage, marker)
    views = out.results
    for r, view in enumerate(views):
        if any(views[other] != view for other in view):
            raise ConfigError(
                f"--{flag}: ranks disagree about who shares {storage.describe()} (rank {r} sees "
                f"{view}); use storage local to each node, or storage all ranks share"
            )
    return [list(v) for v in sorted({tuple(v) for v in views})]


def leads_storage(storage: Storage, flag: str) -> bool:
    """Whether this rank is the first of the ranks that see the same ``storage``'s root. Collective.

    For work where a duplicate is only wasted effort (two leaders on one storage publish the
    same thing atomically), so it is cheap at any world size: one marker file from rank 0, one
    lookup per rank (a name never seen before, so no filesystem cache can answer for the
    server), one all-gather. Ranks that see rank 0's marker share with it; the others are
    grouped by host (node-local disks).
    """
    if world_size() == 1:
        return True
    nonce = share_from(0, lambda: uuid.uuid4().hex)
    marker = f"{PROBE}-{nonce}"
    _cannot_write(
        gather_outcomes(
            lambda: _touch(storage, marker),
            on=is_main(),
            step=f"writing a marker in {storage.describe()}",
            deadline_s=io_deadline(),
        ),
        storage,
        flag,
    )

    def look():
        try:
            return storage.stat(marker) is not None, socket.gethostname()
        except OSError:
            return False, socket.gethostname()

    views = gather_outcomes(
        look,
        share=True,
        step=f"looking for rank 0's marker in {storage.describe()}",
        deadline_s=io_deadline(),
    ).results
    if is_main():
        _unlink(storage, marker)
    me = rank()
    if views[me][0]:
        return me == 0
    return me == min(r for r, (s, host) in enumerate(views) if not s and host == views[me][1])
