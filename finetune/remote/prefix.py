"""``--remote_output_dir`` opened at the start of a run, before training: every rank writes, reads
back and deletes a probe object there (a wrong bucket, endpoint or credential is exit 2 naming the
flag), then rank 0 takes the prefix's lease (another live run there is exit 2 naming it) and
aborts the multipart uploads an earlier run left pending there (``abort_stale_uploads``: a run
killed in the middle of an upload leaves its parts stored, billed and invisible to listings).

A bucket whose service does not answer (connection refused, timeouts, 5xx: ``io.remote.transient``)
is exit 2 too on a first start, where it is most likely a wrong endpoint. On a restart (a requeued
job, or an output dir that shows this prefix was used: ``restarted``) it is an outage: ``reach``
tries the start-up's bucket steps again (the probe, the lease, and resume's look into the bucket in
fetch.py) with backoff for ``WAIT_S``, then every rank raises ``RemoteUnavailable`` and the run
exits 75 (exit_status.json reason "remote unavailable") so the job is requeued, as an outage in
the middle of a run is ridden out by the copy's retries.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TypeVar

from finetune import distributed as dist
from finetune.checkpoint_format.outdir import OutputDir, committed
from finetune.config import ConfigError
from finetune.io import seams
from finetune.io.remote import PendingUpload, RemoteError, S3Storage, transient
from finetune.remote.lease import LEASE, RemoteLease, acquire
from finetune.run_config import FILE_NAME as RUN_CONFIG

PROBE = b"finetune probe\n"
# How long a restart waits for an unreachable bucket before it exits 75 (FINETUNE_REMOTE_WAIT_S);
# one attempt under way when it runs out is let finish (the client's own retries bound it).
WAIT_S = 300.0
FIRST_RETRY_S = 2.0  # the wait between attempts: doubling from this…
MAX_RETRY_S = 30.0  # …to this
# What the launchers that restart a job export: SLURM's requeue count (with the job's id), and
# torchrun's count of restarts of its workers (--max-restarts).
RESTART_COUNTS = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")
# The flags whose value in OUT's run_config.yaml says an earlier run used this bucket prefix.
REMOTE_FLAGS = ("remote_output_dir", "resume_from_checkpoint")
# A multipart upload is left alone unless it began at least this long before the lease was taken
# (both by the server's clock, whose timestamps may be whole seconds, and whose hosts' clocks may
# differ a little): one that began nearer the lease may be this run's own.
UPLOAD_MARGIN_S = 5.0

T = TypeVar("T")
logger = logging.getLogger("finetune")


class Unreachable(Exception):
    """The bucket's service did not answer, or failed on its side: an outage, or (on a first
    start) a wrong endpoint. Its message is the one line a first start exits 2 with."""


class RemoteUnavailable(Exception):
    """A restart found the bucket unreachable for ``WAIT_S``. Raised alike on every rank: the run
    exits 75 (exit_status.json reason "remote unavailable") so the job is requeued."""


@dataclass
class Prefix:
    """``--remote_output_dir`` opened: its storage, and (rank 0) this run's lease on it."""

    storage: S3Storage
    run_id: str
    lease: RemoteLease | None = None

    def release(self) -> None:
        """The prefix's lease, deleted if it is still this run's (rank 0); never raises."""
        if self.lease is not None:
            self.lease.release()


def open_remote(uri: str, run_id: str, output_dir: str | os.PathLike) -> Prefix:
    """The remote storage, probed by every rank (each uploads its own files, so all must be able
    to write there; all fail alike), and rank 0's lease on it. ConfigError (exit 2) naming the
    flag otherwise; RemoteUnavailable when a restart waited for an unreachable bucket in vain.
    Collective."""
    flag = f"--remote_output_dir {uri}"

    def probe() -> S3Storage:
        try:
            return _probed(S3Storage(uri), f".probe-{run_id}-{dist.rank()}")
        except RemoteError as e:
            raise ConfigError(f"{flag}: {e}") from None
        except Exception as e:  # noqa: BLE001 — the client's errors (credentials, endpoint, bucket)
            raise client_error(e, f"{flag}: cannot write there") from None

    storage = reach(probe, uri, output_dir, step="checking --remote_output_dir")

    def take() -> RemoteLease:
        try:
            return acquire(storage, run_id)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 — the client's errors
            raise client_error(e, f"{flag}: cannot take its lease") from None

    lease = reach(
        take, uri, output_dir, on=dist.is_main(), step="taking --remote_output_dir's lease"
    )
    _tidy_uploads(storage)
    return Prefix(storage, run_id, lease)


def abort_stale_uploads(storage: S3Storage, taken: datetime) -> list[PendingUpload]:
    """Abort the multipart uploads pending under the prefix that began ``UPLOAD_MARGIN_S``
    or more before ``taken`` (when this run took the prefix's lease, by the server's clock, as
    the uploads' start times are): an earlier run's, cut off with it, since no other run writes
    here while this one holds the lease. The ones aborted."""
    cutoff = taken - timedelta(seconds=UPLOAD_MARGIN_S)
    stale = [u for u in storage.pending_uploads() if u.initiated < cutoff]
    for upload in stale:
        storage.abort_upload(upload)
    return stale


def _tidy_uploads(storage: S3Storage) -> None:
    """Rank 0 aborts the prefix's stale multipart uploads, dated by the lease it has just taken
    (the lease object's last write, which the server dates). Housekeeping: a failure (a bucket
    that refuses to list or abort them) is a warning, and the run goes on. Collective."""

    def tidy() -> list[PendingUpload]:
        lease = storage.head(LEASE)
        if lease is None:
            raise RemoteError(f"{storage.describe(LEASE)} is not there to date them by")
        return abort_stale_uploads(storage, lease["LastModified"])

    step = "aborting the multipart uploads an earlier run left pending"
    out = dist.gather_outcomes(tidy, dist.is_main(), step=step, deadline_s=dist.io_deadline())
    if not out.ok:
        dist.log_main(
            logging.WARNING,
            "%s: could not abort the multipart uploads an earlier run left pending (%s); the "
            "run goes on, and `finetune ls %s` lists them",
            storage.describe(),
            out.describe(),
            storage.describe(),
        )
    elif out.result:
        keys = ", ".join(u.rel for u in out.result[:3]) + (", …" if len(out.result) > 3 else "")
        logger.info(
            "%s: aborted %d multipart upload(s) an earlier run left pending (%s)",
            storage.describe(),
            len(out.result),
            keys,
        )


def client_error(e: Exception, what: str) -> Exception:
    """The client's error ``e`` while doing ``what``, as one line: Unreachable when the service
    did not answer, a ConfigError (exit 2) otherwise."""
    line = f"{what} ({_why(e)})"
    return Unreachable(line) if transient(e) else ConfigError(line)


def reach(
    fn: Callable[[], T],
    uri: str,
    output_dir: str | os.PathLike,
    *,
    on: bool = True,
    share: bool = False,
    step: str = "",
) -> T | None:
    """``fn``, a start-up step on bucket ``uri``, agreed on every rank (run where ``on``): its
    result (``share``: rank 0's, on every rank). When it failed only because the bucket did not
    answer (``Unreachable`` on some ranks, no other failure anywhere): a ConfigError on a first
    start (exit 2); on a restart, tried again with backoff until ``WAIT_S`` has passed, then
    RemoteUnavailable on every rank. Collective."""
    wait_s = seams.number(seams.REMOTE_WAIT_S, WAIT_S)
    start = time.monotonic()
    delay = FIRST_RETRY_S
    restart: bool | None = None  # asked once, on the first outage
    while True:
        out = dist.gather_outcomes(fn, on, share=share, step=step)
        if out.ok:
            return out.results[0] if share else out.result
        others = {r: kind for r, kind in out.kinds.items() if kind != Unreachable.__name__}
        if others:
            # another failure anywhere decides, as without an outage, on every rank alike
            own = None if isinstance(out.own, Unreachable) else out.own
            errors = {r: out.errors[r] for r in others}
            dist.Outcomes(errors=errors, kinds=others, own=own).raise_any()
        why = out.errors[min(out.errors)].split(": ", 1)[-1]
        if restart is None:
            # every rank's view: a node whose OUT shows the prefix was used makes it a restart
            restart = dist.any_rank(restarted(output_dir, uri))
        if not restart:
            raise ConfigError(why)
        left = wait_s - (time.monotonic() - start)
        if dist.any_rank(left <= 0):  # agreed: every rank gives up at the same attempt
            raise RemoteUnavailable(f"{why}; still unreachable after {wait_s:g} s")
        pause = min(delay, max(left, 0.0))
        dist.log_main(
            logging.WARNING,
            "%s; a restart waits for the bucket (%.0f s left): trying again in %.1f s",
            why,
            max(left, 0.0),
            pause,
        )
        time.sleep(pause)
        delay = min(delay * 2, MAX_RETRY_S)


def restarted(
    output_dir: str | os.PathLike, uri: str, env: Mapping[str, str] | None = None
) -> bool:
    """Whether this start restarts a run that used bucket ``uri``: a requeued job
    (``RESTART_COUNTS`` above 0; SLURM's only with a job id), or an output dir that holds a
    committed checkpoint or whose run_config.yaml names ``uri`` in ``REMOTE_FLAGS``. Reads this
    rank's environment and OUT only."""
    env = os.environ if env is None else env
    for name in RESTART_COUNTS:
        count = env.get(name, "")
        if count.isdigit() and int(count) > 0:
            if name != "SLURM_RESTART_COUNT" or env.get("SLURM_JOB_ID"):
                return True
    return bool(committed(OutputDir(output_dir))) or _named(Path(output_dir) / RUN_CONFIG, uri)


def _named(run_config: Path, uri: str) -> bool:
    """Whether an earlier run's run_config.yaml gave ``uri`` to one of ``REMOTE_FLAGS``."""
    import yaml  # PyYAML: a dependency of transformers and huggingface_hub

    try:
        flags = yaml.safe_load(run_config.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False  # none, or unreadable: no evidence either way
    if not isinstance(flags, dict):
        return False
    want = uri.rstrip("/")
    return any(
        isinstance(flags.get(name), str) and flags[name].rstrip("/") == want
        for name in REMOTE_FLAGS
    )


def _probed(remote: S3Storage, rel: str) -> S3Storage:
    """``remote`` once a probe object ``rel`` was written, read back intact and deleted."""
    remote.write_bytes(rel, PROBE)
    if remote.read_bytes(rel) != PROBE:
        raise RemoteError("a probe object read back different bytes")
    remote.remove(rel)
    return remote


def _why(e: Exception) -> str:
    """A client error in one line: its type and its message's first line."""
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}"
