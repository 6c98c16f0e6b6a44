"""One run per ``--remote_output_dir`` prefix: ``PREFIX/.lease`` in the bucket.

The same record and the same rules as ``OUT/.lease`` (finetune/lease.py: who holds it, and how a
holder is judged dead: a SLURM requeue, a gone pid on the same machine, a heartbeat that stops
moving on another one). Only the atomic steps differ, because an object store has no link or
rename; they are its conditional writes:

* take a free lease: ``PUT`` with ``If-None-Match: *`` (fails when any lease exists);
* take over a dead holder's: ``PUT`` with ``If-Match: <the ETag of the lease judged dead>``, so of
  two runs judging the same dead holder one wins and the other re-reads the winner's lease, and a
  holder that beat in between is never overwritten;
* heartbeat: ``PUT`` with ``If-Match: <our last ETag>``; a failed condition means another run
  wrote it: this run has lost the prefix;
* release: ``DELETE`` with ``If-Match: <our last ETag>``.

A server that ignores the conditions would let two runs both "take" a prefix, so ``acquire`` tests
it once (a second ``If-None-Match`` create must fail) and refuses the bucket otherwise.

Rank 0 holds it. Every rank checks the record's run id (one GET) before uploading a checkpoint's
files; the leader re-reads it before each remote commit and before retention in the bucket. A run
that finds another run's lease there stops as for a lost ``OUT`` lease (exit 3).
"""

from __future__ import annotations

import logging
import threading

from finetune.config import ConfigError
from finetune.io import seams
from finetune.io.remote import S3Storage
from finetune.lease import (
    ALIVE,
    DEAD,
    MAX_TRIES,
    RENEW_S,
    LeaseHeld,
    LeaseLost,
    describe,
    encode,
    identity,
    is_ours,
    judge,
    parse,
)

logger = logging.getLogger("finetune")

LEASE = ".lease"
_JOIN_S = 10.0  # release() waits this long for a heartbeat write in flight


class RemoteLeaseLost(LeaseLost):
    """Another run holds the ``--remote_output_dir`` prefix now. Raised alike on every rank; the
    run stops with exit code 3, as for a lost OUT lease, but OUT is still this run's: its
    exit_status.json says why."""


class RemoteLeaseHeld(LeaseHeld):
    """A live run holds the prefix's lease; ``holder`` is its lease."""

    def __init__(self, where: str, holder: dict):
        super().__init__(where, holder, "--remote_output_dir")


def holder(remote: S3Storage) -> dict | None:
    """The prefix's lease, or None when it has none (or only an unreadable one)."""
    found = remote.read_tagged(LEASE)
    return parse(found[0]) if found else None


def acquire(
    remote: S3Storage,
    run_id: str,
    *,
    renew_s: float | None = None,
    observe_s: float | None = None,
) -> RemoteLease:
    """Take ``PREFIX/.lease`` for this process, taking it over from a dead holder. Raises
    ``RemoteLeaseHeld`` when a live run holds it, ``ConfigError`` when the server does not honour
    conditional writes or the lease keeps changing hands."""
    if renew_s is None:
        renew_s = seams.number(seams.LEASE_RENEW_S, RENEW_S)
    me = identity(run_id, renew_s)
    where = remote.describe()

    def read() -> bytes | None:
        found = remote.read_tagged(LEASE)
        return found[0] if found else None

    for _ in range(MAX_TRIES):
        etag = remote.put_if(LEASE, encode(me), None)
        if etag is not None:
            break
        found = remote.read_tagged(LEASE)
        if found is None:
            continue  # released between our attempt and our read
        raw, theirs = found
        if (parse(raw) or {}).get("run_id") == run_id:
            # this run's own, from an attempt the network cut off after its PUT (a restart tries
            # again while the bucket is unreachable; the run id is this launch's alone): written
            # again as this attempt's record, which the heartbeat and check() go by
            etag = remote.put_if(LEASE, encode(me), theirs)
            if etag is not None:
                break
            continue
        verdict, now, why = judge(read, remote.describe(LEASE), raw, me, observe_s)
        if verdict == ALIVE:
            raise RemoteLeaseHeld(where, parse(now) or {})
        if verdict == DEAD and now == raw:
            etag = remote.put_if(LEASE, encode(me), theirs)
            if etag is not None:
                old = parse(raw)
                logger.warning(
                    "%s: the previous run (%s) is dead (%s); took its lease over",
                    where,
                    describe(old) if old else "holder unknown",
                    why,
                )
                break
    else:
        raise ConfigError(
            f"--remote_output_dir {where}: its lease changed hands {MAX_TRIES} times while this "
            "run tried to take it; are several runs starting on it at once?"
        )
    _require_conditional_writes(remote, encode(me), where)
    return RemoteLease(remote, me, etag)


def _require_conditional_writes(remote: S3Storage, data: bytes, where: str) -> None:
    """Once the lease is taken, a second ``If-None-Match`` create must fail: a server that lets it
    through would let two runs both take a prefix, so the lease is removed and the bucket
    refused."""
    if remote.put_if(LEASE, data, None) is not None:
        remote.delete_if(LEASE, remote.read_tagged(LEASE)[1])
        raise ConfigError(
            f"--remote_output_dir {where}: the server ignores conditional writes "
            "(PUT If-None-Match), which keep two runs from sharing a prefix; use a server that "
            "supports them (AWS S3, SeaweedFS, MinIO, GCS and R2 do)"
        )


class RemoteLease:
    """This process's hold on ``PREFIX/.lease``, renewed by a daemon thread until ``release()``."""

    def __init__(self, remote: S3Storage, info: dict, etag: str):
        self.remote = remote
        self.info = info  # the record as last written (its beat counts up)
        self._etag = etag  # of our last write: every conditional step goes by it
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._released = False
        self._lost = False
        self._failing = False  # renewing fails now (said once, and once when it works again)
        self._thread = threading.Thread(target=self._run, name="finetune-remote-lease", daemon=True)
        self._thread.start()

    @property
    def lost(self) -> bool:
        return self._lost

    @property
    def run_id(self) -> str:
        return self.info["run_id"]

    def check(self) -> bool:
        """Re-read the lease now (before a remote commit or retention): False, and ``lost`` from
        then on, when another run holds it. A missing lease counts as ours (the heartbeat creates
        it again). False after ``release()``: a copy thread still running at the end commits
        nothing more. Raises the client's error when it cannot be read."""
        if self._lost or self._released:
            return False
        found = self.remote.read_tagged(LEASE)
        if found is not None and parse(found[0]) is not None and not is_ours(found[0], self.info):
            self._lose(parse(found[0]))
            return False
        return True

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours. Idempotent; never
        raises."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._stop.set()
        self._thread.join(timeout=_JOIN_S)
        try:
            with self._lock:
                if not self._lost and not self.remote.delete_if(LEASE, self._etag):
                    found = self.remote.read_tagged(LEASE)  # our heartbeat's ETag unknown
                    if found is not None and is_ours(found[0], self.info):
                        self.remote.delete_if(LEASE, found[1])
        except Exception as e:  # noqa: BLE001 — the next run judges a leftover lease dead
            logger.warning(
                "could not remove this run's lease %s: %s", self.remote.describe(LEASE), e
            )

    def _lose(self, other: dict | None) -> None:
        if not self._lost:
            self._lost = True
            logger.error(
                "%s now belongs to another run (%s): this run copies nothing more there",
                self.remote.describe(LEASE),
                describe(other) if other else "holder unknown",
            )

    def _run(self) -> None:
        while not self._stop.wait(self.info["renew_s"]):
            with self._lock:
                if self._released or not self._beat():
                    return

    def _beat(self) -> bool:
        """Renew the lease once; False when it is lost and beating must stop."""
        info = {**self.info, "beat": self.info["beat"] + 1}
        try:
            etag = self.remote.put_if(LEASE, encode(info), self._etag)
            if etag is None:  # not the object we last wrote: whose is it now?
                found = self.remote.read_tagged(LEASE)
                if found is None:
                    logger.warning(
                        "%s vanished while this run held it; creating it again",
                        self.remote.describe(LEASE),
                    )
                    etag = self.remote.put_if(LEASE, encode(info), None)
                elif is_ours(found[0], self.info):
                    etag = self.remote.put_if(LEASE, encode(info), found[1])
                else:
                    self._lose(parse(found[0]))
                    return False
                if etag is None:
                    return True  # raced: the next beat says whose it is
            self.info = info
            self._etag = etag
        except Exception as e:  # noqa: BLE001 — the network: retried at the next beat
            if not self._failing:
                logger.warning(
                    "cannot renew %s (retrying every %g s): %s",
                    self.remote.describe(LEASE),
                    self.info["renew_s"],
                    e,
                )
            self._failing = True
            return True
        if self._failing:
            logger.info("renewed %s again", self.remote.describe(LEASE))
            self._failing = False
        return True


def held_by(remote: S3Storage, run_id: str) -> bool:
    """Whether the prefix's lease names run ``run_id`` (or is missing: its heartbeat recreates
    it). One GET: each rank's check before it uploads a checkpoint's files."""
    found = remote.read_tagged(LEASE)
    info = parse(found[0]) if found else None
    return info is None or info.get("run_id") == run_id
