"""Every wait of the running job's copy has a deadline, in one process against a real S3 server
(SeaweedFS on loopback), the all-gather of one rank being its own view: an upload that hangs
(FINETUNE_FAULT's ``hang``: the thread sleeps for good, as in D-state) gives the copy up in the
final drain and at the next offer, naming the checkpoint and what the rank was stuck on; a copy
that fails every try says so; a slow upload (each file paused, but moving) is not given up; a copy
given up mid-run stops the Checkpointer's step with exit 1, the step's checkpoint committed in
OUT. The multi-rank runs, their exit code and exit_status.json, are
tests/distributed/test_remote_deadline.py's."""

from __future__ import annotations

import time

import pytest
from checkpoint.fake_engine import (
    _fake_engines_model_is_not_checked,
    make_cfg,
    make_manager,
    tiny_module,
)
from remote.bucket import commit_locally
from s3_server import require_s3

from finetune import distributed as dist
from finetune.checkpoint_format.manifest import MANIFEST
from finetune.checkpoint_format.outdir import OutputDir
from finetune.io import seams
from finetune.remote.copy import RemoteCopy
from finetune.remote.prefix import Prefix

BUCKET = "deadlines"
DEADLINE_S = 1.0  # the copy's deadline here (a run's is --ddp_timeout)
# fake_engine's, found by pytest under these names
FIXTURES = (tiny_module, _fake_engines_model_is_not_checked)


@pytest.fixture
def copy_of(server, monkeypatch, request, tmp_path):
    """A RemoteCopy of ``tmp_path/out`` to a prefix of its own with a short deadline, this process
    as the only rank."""
    require_s3()
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dist, "all_reduce_sum", list)
    monkeypatch.delenv("RANK", raising=False)
    from finetune.io.remote import S3Storage

    storage = S3Storage(f"s3://{BUCKET}/{request.node.name}")
    # The bucket's first object written here, not by the copy: SeaweedFS grows a volume at a
    # bucket's first write, which has taken over 2 s under `make check`'s load on 2 cores, and
    # that would count as the copy's own stall.
    warm = tmp_path / "warm-up"
    warm.write_bytes(b"w")
    S3Storage(f"s3://{BUCKET}/warm-up").upload_file(warm, request.node.name, "-")
    copy = RemoteCopy(Prefix(storage, "run-1"), tmp_path / "out", leader=True)
    copy.deadline_s = DEADLINE_S
    return copy


def wait_stuck(copy: RemoteCopy, doing: str) -> None:
    """Until the copy's thread reaches the hang (its deadline counts from there)."""
    deadline = time.monotonic() + 10
    while not (copy._doing or "").startswith(doing) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_hung_upload_fails_the_final_drain_within_its_deadline(copy_of, monkeypatch):
    monkeypatch.setenv(seams.FAULT, "remote.upload:0:4:hang")
    copy = copy_of
    files = commit_locally(copy.out, 4, "save-a", **{"model_states.pt": b"w" * 10})
    copy.offer("global_step4", files, files, "save-a")
    t0 = time.monotonic()
    assert copy.drain(4) is False
    waited = time.monotonic() - t0
    assert DEADLINE_S - 0.1 <= waited < DEADLINE_S + 5, waited
    assert copy.failed == (
        f"remote copy of global_step4 did not finish: no progress for {DEADLINE_S:g} s "
        "(rank 0: uploading global_step4/model_states.pt)"
    )
    assert copy.unconfirmed() == {"global_step4"}, "kept locally"
    assert copy.remote.read_bytes(f"global_step4/{MANIFEST}") is None
    # the thread is still stuck in the upload: a daemon, so the process can exit past it
    assert copy._thread.is_alive() and copy._thread.daemon


def test_a_hung_upload_is_given_up_at_the_next_offer(copy_of, monkeypatch):
    monkeypatch.setenv(seams.FAULT, "remote.upload:0:2:hang")
    copy = copy_of
    two = commit_locally(copy.out, 2, "save-b", **{"model_states.pt": b"w"})
    copy.offer("global_step2", two, two, "save-b")
    stuck_on = "uploading global_step2/model_states.pt"
    wait_stuck(copy, stuck_on)
    four = commit_locally(copy.out, 4, "save-c", **{"model_states.pt": b"v"})
    copy.offer("global_step4", four, four, "save-c")
    assert copy.failed is None, "within its deadline, a copy is not given up"
    time.sleep(DEADLINE_S + 0.2)
    six = commit_locally(copy.out, 6, "save-d", **{"model_states.pt": b"u"})
    copy.offer("global_step6", six, six, "save-d")
    assert copy.failed is not None
    assert copy.failed.startswith("remote copy of global_step4 did not finish: no progress")
    assert f"(rank 0: {stuck_on})" in copy.failed
    assert copy.unconfirmed() == {"global_step2", "global_step4", "global_step6"}
    assert copy.drain(6) is False, "a copy given up is not waited for again"


def test_a_slow_upload_that_moves_is_not_given_up(copy_of, monkeypatch):
    # Each file paused 0.5 s, six of them: 3 s in all, past a deadline of 2 s, which leaves 1.5 s
    # for a file's own work beside its pause.
    copy = copy_of
    copy.deadline_s = 2.0
    monkeypatch.setenv(seams.SLOW_UPLOAD, "0.5")
    names = {f"file{i}.pt": b"w" * 10 for i in range(6)}
    files = commit_locally(copy.out, 2, "save-f", **names)
    copy.offer("global_step2", files, files, "save-f")
    assert copy.drain(2) is True
    assert copy.failed is None and copy.remote_head == "global_step2"


def test_a_copy_given_up_mid_run_stops_the_step_with_exit_1_its_checkpoint_committed(
    copy_of, tiny_module, monkeypatch
):
    monkeypatch.setenv(seams.FAULT, "remote.upload:0:2:hang")
    copy = copy_of
    m, progress, _ = make_manager(make_cfg(copy.out, save_steps=1), tiny_module, remote=copy)
    for step in (1, 2):
        progress.global_step = step
        assert m.at_step(step, 6) is None
    wait_stuck(copy, "uploading global_step2/")
    time.sleep(DEADLINE_S + 0.2)
    progress.global_step = 3
    assert m.at_step(3, 6) == 1, "the copy given up at step 3's offer stops the run"
    assert copy.failed is not None
    assert copy.failed.startswith("remote copy of global_step2 did not finish: no progress")
    assert "global_step3" in OutputDir(copy.out).tags()
