"""Test seams: every ``FINETUNE_*`` environment variable that only tests set, read here and nowhere
else, so a reader sees in one place what a test can change about a run and where.

None is a user-facing setting (those are flags, docs/FLAGS.md); a user who sets one gets what the
test gets. Each is read when its moment comes, not once at import: a test sets it in the
environment of the ranks it launches.

  FINETUNE_FAULT=<site>:<rank>[:<step>][:<kind>]   a named fault site fails (faults.py)
  FINETUNE_SLOW_SAVE=<s>          a pause after each checkpoint file a rank writes, and after each
                                  consolidated shard's header: time for a test to fill the disk
  FINETUNE_SLOW_COPY=<s>          a pause before an --async_save snapshot's tensors are copied: the
                                  optimizer steps after the save must wait for the copy
  FINETUNE_SLOW_COMMIT=<s>        a pause before the leader writes the manifest, same purpose
  FINETUNE_SLOW_UNIVERSAL=<s>     a pause before each piece of a universal conversion: time to
                                  interrupt one midway
  FINETUNE_SLOW_UPLOAD=<s>        a pause before each file a rank copies to --remote_output_dir:
                                  time to kill a rank, or the server, mid-copy
  FINETUNE_REMOTE_RETRY_S=<s>     the first wait before a failed copy to --remote_output_dir is
                                  tried again (default 2 s, doubling to 60 s): a test of a copy
                                  that always fails ends in seconds
  FINETUNE_REMOTE_WAIT_S=<s>      how long a restart waits for an unreachable --remote_output_dir
                                  before it exits 75 (default 300 s, remote/prefix.py): a test of
                                  an outage at start ends in seconds
  FINETUNE_BUFFERED_WRITES=1      checkpoint rank files written through the page cache, not with
                                  O_DIRECT (io/direct.py): the path before it, for benchmarks
  FINETUNE_SKIP_SPACE_CHECK=1     no free-space check before a save: a real ENOSPC mid-write
  FINETUNE_STREAM_BYTES=<n>       parameters of at least n bytes are streamed to rank 0 in pieces
                                  by the consolidated save (default 8 MiB): tiny models take that
                                  path too
  FINETUNE_SAVE_IO=<dir>          each rank writes what one save cost it (phase times, bytes read
                                  and written) to <dir>/<tag>-rank<r>.json
  FINETUNE_LEASE_RENEW_S=<s>      the output dir lease's heartbeat (default 30 s): a takeover seen
                                  in time
  FINETUNE_PROBE_LOGITS=<file>    the trained model's logits on a fixed input, saved after the
                                  final evaluation (probe.py): compared with an exported model
  FINETUNE_FAIL_BATCH=<r>:<k>     rank r fails preparing optimizer step k's batches
"""

from __future__ import annotations

import os
import time

FAULT = "FINETUNE_FAULT"
SLOW_SAVE = "FINETUNE_SLOW_SAVE"
SLOW_COPY = "FINETUNE_SLOW_COPY"
SLOW_COMMIT = "FINETUNE_SLOW_COMMIT"
SLOW_UNIVERSAL = "FINETUNE_SLOW_UNIVERSAL"
SLOW_UPLOAD = "FINETUNE_SLOW_UPLOAD"
REMOTE_RETRY_S = "FINETUNE_REMOTE_RETRY_S"
REMOTE_WAIT_S = "FINETUNE_REMOTE_WAIT_S"
SKIP_SPACE_CHECK = "FINETUNE_SKIP_SPACE_CHECK"
BUFFERED_WRITES = "FINETUNE_BUFFERED_WRITES"
STREAM_BYTES = "FINETUNE_STREAM_BYTES"
SAVE_IO = "FINETUNE_SAVE_IO"
LEASE_RENEW_S = "FINETUNE_LEASE_RENEW_S"
PROBE_LOGITS = "FINETUNE_PROBE_LOGITS"
FAIL_BATCH = "FINETUNE_FAIL_BATCH"

ALL = (
    FAULT,
    SLOW_SAVE,
    SLOW_COPY,
    SLOW_COMMIT,
    SLOW_UNIVERSAL,
    SLOW_UPLOAD,
    REMOTE_RETRY_S,
    REMOTE_WAIT_S,
    SKIP_SPACE_CHECK,
    BUFFERED_WRITES,
    STREAM_BYTES,
    SAVE_IO,
    LEASE_RENEW_S,
    PROBE_LOGITS,
    FAIL_BATCH,
)


def value(name: str) -> str | None:
    """The seam's setting; None when it is unset or empty."""
    return os.environ.get(name) or None


def number(name: str, default: float) -> float:
    """A numeric seam's setting, or ``default`` when unset."""
    text = value(name)
    return default if text is None else float(text)


def pause(name: str) -> float:
    """Sleep the seconds a SLOW_* seam asks for (none when unset); the seconds slept."""
    seconds = number(name, 0.0)
    if seconds > 0:
        time.sleep(seconds)
    return seconds


def enabled(name: str) -> bool:
    """A switch seam (``=1``)."""
    return value(name) == "1"
