"""``--remote_output_dir`` opened at the start of a run, before training: every rank writes, reads
back and deletes a probe object there (a wrong bucket, endpoint or credential is exit 2 naming the
flag), then rank 0 takes the prefix's lease (another live run there is exit 2 naming it).
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune import distributed as dist
from finetune.config import ConfigError
from finetune.io.remote import RemoteError, S3Storage
from finetune.remote.lease import RemoteLease, acquire

PROBE = b"finetune probe\n"


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


def open_remote(uri: str, run_id: str) -> Prefix:
    """The remote storage, probed by every rank (each uploads its own files, so all must be able
    to write there; all fail alike), and rank 0's lease on it. ConfigError (exit 2) naming the
    flag otherwise. Collective."""

    def probe() -> S3Storage:
        try:
            return _probed(S3Storage(uri), f".probe-{run_id}-{dist.rank()}")
        except RemoteError as e:
            raise ConfigError(f"--remote_output_dir {uri}: {e}") from None
        except Exception as e:  # noqa: BLE001 — the client's errors (credentials, endpoint, bucket)
            raise ConfigError(
                f"--remote_output_dir {uri}: cannot write there ({_why(e)})"
            ) from None

    storage = dist.run_agreed(probe, step="checking --remote_output_dir")

    def take() -> RemoteLease:
        try:
            return acquire(storage, run_id)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 — the client's errors
            raise ConfigError(
                f"--remote_output_dir {uri}: cannot take its lease ({_why(e)})"
            ) from None

    lease = dist.run_agreed(take, on=dist.is_main(), step="taking --remote_output_dir's lease")
    return Prefix(storage, run_id, lease)


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
