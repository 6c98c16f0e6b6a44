"""The running job's copy to the bucket in one process: the poll's all-reduce payload (PollTally)
encoded and decoded, and a RemoteCopy's offer → upload → poll → commit against a real S3 server
(SeaweedFS on loopback), the all-reduce of one rank being its own tally. The multi-rank runs are
tests/distributed/test_remote_copy.py's."""

from __future__ import annotations

import time

import pytest
from remote.bucket import commit_locally
from s3_server import require_s3

from finetune import distributed as dist
from finetune.checkpoint_format.manifest import MANIFEST
from finetune.io import seams
from finetune.lease import encode, identity
from finetune.remote.copy import SAVE_ID_KEY, RemoteCopy
from finetune.remote.lease import LEASE, RemoteLeaseLost
from finetune.remote.prefix import Prefix
from finetune.remote.tally import PollTally, TagTally

BUCKET = "copies"
AT_ONCE = 10.0


def test_a_tally_encodes_to_one_vector_and_decodes_back():
    tally = PollTally(0, [TagTally(uploaded=1), TagTally(upload_failed=1, commit_failed=1)])
    encoded = tally.encode()
    assert encoded == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert PollTally.decode(encoded) == tally
    assert PollTally.decode([1.0]) == PollTally(1, [])


def test_summed_tallies_count_the_ranks():
    rank0 = PollTally(0, [TagTally(uploaded=1), TagTally(uploaded=1, committed=1)])
    rank1 = PollTally(1, [TagTally(upload_failed=1), TagTally(uploaded=1)])
    summed = [a + b for a, b in zip(rank0.encode(), rank1.encode())]  # what all_reduce_sum does
    seen = PollTally.decode(summed)
    assert seen.lost == 1
    assert [(t.uploaded, t.failed, t.committed) for t in seen.tags] == [(1, 1, 0), (2, 0, 1)]


# --- one rank against a real S3 server ------------------------------------------------------------


@pytest.fixture
def copy_of(server, monkeypatch, request, tmp_path):
    """A RemoteCopy of ``tmp_path/out`` to a prefix of its own, this process as the only rank (its
    all-reduce the identity); ``events`` records what it reports."""
    require_s3()
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dist, "all_reduce_sum", list)
    from finetune.io.remote import S3Storage

    storage = S3Storage(f"s3://{BUCKET}/{request.node.name}")
    copy = RemoteCopy(Prefix(storage, "run-1"), tmp_path / "out", leader=True)
    copy.events = []
    copy.on_event = lambda kind, step, **details: copy.events.append((kind, step, details))
    return copy


def poll_until(copy: RemoteCopy, done) -> None:
    deadline = time.monotonic() + AT_ONCE
    while not done() and time.monotonic() < deadline:
        copy.poll(7)
        time.sleep(0.05)
    assert done()


def test_an_offered_checkpoint_is_uploaded_then_committed_manifest_last(copy_of):
    copy = copy_of
    files = commit_locally(copy.out, 2, "save-a", **{"model_states.pt": b"w" * 100})
    copy.offer("global_step2", files, files, "save-a")
    assert copy.unconfirmed() == {"global_step2"}
    poll_until(copy, lambda: not copy.outstanding)
    assert copy.remote_head == "global_step2"
    assert copy.remote.read_bytes("latest") == b"global_step2\n"
    assert copy.remote.head(f"global_step2/{MANIFEST}")["Metadata"][SAVE_ID_KEY] == "save-a"
    assert copy.remote.read_bytes("global_step2/model_states.pt") == b"w" * 100
    assert copy.events == [
        (
            "remote_checkpoint",
            2,
            {"tag": "global_step2", "uri": copy.remote.describe("global_step2"), "seen_at": 7},
        )
    ]
    assert copy.unconfirmed() == set()


def test_a_failed_upload_is_counted_kept_and_tried_again_until_drain_gives_up(copy_of, monkeypatch):
    monkeypatch.setenv(seams.REMOTE_RETRY_S, "0.05")
    copy = copy_of
    files = commit_locally(copy.out, 4, "save-b", **{"model_states.pt": b"w"})
    (copy.out / "global_step4" / "model_states.pt").unlink()  # the upload cannot read it
    copy.offer("global_step4", files, files, "save-b")
    assert copy.drain(7, tries=2) is False
    assert copy.failures == {"global_step4": 2}
    assert copy.unconfirmed() == {"global_step4"}  # retention keeps what is not copied
    # why, for exit_status.json: the tries and each rank's last error
    assert copy.failed is not None and copy.failed.startswith(
        "remote copy of global_step4 did not finish: 2 tries failed (rank 0: FileNotFoundError"
    ), copy.failed
    assert [(kind, details["tries"]) for kind, _, details in copy.events] == [
        ("remote_upload_failed", 1),
        ("remote_upload_failed", 2),
    ]
    assert copy.remote.read_bytes(f"global_step4/{MANIFEST}") is None


def test_another_runs_lease_on_the_prefix_stops_the_run_at_the_next_poll(copy_of):
    copy = copy_of
    copy.remote.write_bytes(LEASE, encode(identity("another-run", 30.0)))
    files = commit_locally(copy.out, 6, "save-c", **{"model_states.pt": b"w"})
    copy.offer("global_step6", files, files, "save-c")
    with pytest.raises(RemoteLeaseLost, match="another run took over .*nothing more is copied"):
        poll_until(copy, lambda: False)
    assert copy.remote.read_bytes("global_step6/model_states.pt") is None  # never over its objects
