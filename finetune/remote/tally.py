"""The running job's copy's poll (remote/copy.py): one all-reduce of what every rank's copy thread
did of each outstanding checkpoint, as a dataclass that encodes itself into the reduced vector and
decodes back."""

from __future__ import annotations

from dataclasses import dataclass, fields

from finetune import distributed as dist


@dataclass
class TagTally:
    """One outstanding checkpoint in a poll: on one rank each field is 1 or 0; summed over the
    ranks, how many ranks."""

    uploaded: int = 0  # this rank's files of it are in the bucket
    upload_failed: int = 0  # this rank's upload of it failed
    committed: int = 0  # the leader's remote commit of it (manifest, then latest) is done
    commit_failed: int = 0  # the leader's remote commit of it failed

    @property
    def failed(self) -> int:
        """The ranks whose upload or commit of it failed."""
        return self.upload_failed + self.commit_failed


@dataclass
class PollTally:
    """A poll's one all-reduce: whether a rank found another run holding the prefix, and a
    ``TagTally`` per outstanding checkpoint (in the order of ``RemoteCopy.outstanding``, the same
    on every rank). Encoded as ``[lost, then each tag's fields in TagTally's order]``: encode and
    decode are the only code that knows it."""

    lost: int  # ranks that found another run's lease on the prefix
    tags: list[TagTally]

    def encode(self) -> list[float]:
        values = [float(self.lost)]
        for tally in self.tags:
            values += [float(getattr(tally, f.name)) for f in fields(TagTally)]
        return values

    @classmethod
    def decode(cls, values: list[float]) -> PollTally:
        counts = [round(v) for v in values]
        width = len(fields(TagTally))
        tags = [TagTally(*counts[i : i + width]) for i in range(1, len(counts), width)]
        return cls(counts[0], tags)

    def summed(self) -> PollTally:
        """Every rank's tally added up. Collective."""
        return PollTally.decode(dist.all_reduce_sum(self.encode()))
