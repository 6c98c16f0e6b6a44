"""What the Checkpointer uses of --remote_output_dir's copy, as a protocol: ``BucketCopy``.

The copy itself (uploads on a thread, the remote commit, the bucket's lease and retention) is
``finetune.remote.copy.RemoteCopy``; build.py makes one when --remote_output_dir is given and
``NoRemoteCopy`` otherwise, and hands it to the Checkpointer, which never imports the bucket. The
Checkpointer calls ``catch_up`` when it is built, ``offer`` after each commit, ``unconfirmed``
before retention, ``poll`` at each step boundary and ``drain`` at the end. A copy that makes no
progress within its deadline, or whose final checkpoint fails every try, is given up on every rank
alike: ``failed`` says why, and the run stops with exit 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from finetune.checkpoint.writer import Files
from finetune.checkpoint_format.outdir import OutputDir


class BucketCopy(Protocol):
    """Every method is called on every rank."""

    # Where the copy's events go (MetricsWriter.event: remote_checkpoint, remote_upload_failed,
    # remote_skipped); build.py sets it once the metrics exist.
    on_event: Callable[..., None]
    # Why the copy was given up (the same on every rank: "remote copy of global_step4 did not
    # finish: …"); None while it goes on.
    failed: str | None

    def catch_up(self, out: OutputDir) -> None:
        """At start: copy OUT's newest committed checkpoint when the bucket holds none as new (a
        run stopped while copying it). Collective."""

    def offer(
        self,
        tag: str,
        written: Files,
        committed: Files,
        save_id: str | None = None,
        lineage: str | None = None,
    ) -> None:
        """``tag`` was committed in OUT: copy, in the background, the files of ``committed``
        this rank wrote (``written``); ``save_id``, ``lineage``: the commit's. A copy stuck past
        its deadline on any rank is given up here (``failed``). Collective."""

    def poll(self, step: int = 0) -> None:
        """At step boundary ``step``: learn which copies every rank finished, commit the newest
        in the bucket. Collective."""

    def unconfirmed(self) -> set[str]:
        """The tags committed in OUT whose copy is not yet committed in the bucket: retention
        keeps them."""

    def drain(self, step: int = 0) -> bool:
        """At the end of training: wait for the newest checkpoint's copy, within its deadline;
        False when it failed (``failed`` says why). Collective."""


class NoRemoteCopy:
    """No --remote_output_dir: nothing to copy, nothing kept for it."""

    def __init__(self) -> None:
        self.on_event: Callable[..., None] = lambda kind, step, **details: None
        self.failed: str | None = None

    def catch_up(self, out: OutputDir) -> None:
        pass

    def offer(
        self,
        tag: str,
        written: Files,
        committed: Files,
        save_id: str | None = None,
        lineage: str | None = None,
    ) -> None:
        pass

    def poll(self, step: int = 0) -> None:
        pass

    def unconfirmed(self) -> set[str]:
        return set()

    def drain(self, step: int = 0) -> bool:
        return True
