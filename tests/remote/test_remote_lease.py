"""One run per --remote_output_dir prefix: PREFIX/.lease in a real S3 server (SeaweedFS on
loopback), taken and renewed by conditional writes. The judgement rules are lease.py's (tested in
tests/checkpoint/test_lease.py); here: that the object-store steps keep them atomic."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
from s3_server import require_s3

from finetune import lease as lease_mod
from finetune.config import ConfigError
from finetune.io.remote import S3Storage
from finetune.lease import encode, identity
from finetune.remote.lease import LEASE, RemoteLeaseHeld, acquire, held_by, holder

require_s3()  # skips the module without boto3 or the `weed` binary

BUCKET = "leases"
AT_ONCE = 5.0
ELSEWHERE = {"host": "node-elsewhere", "boot_id": "another-boot", "pid_ns": "pid:[1]"}


@pytest.fixture
def remote(server, monkeypatch, request, caplog) -> S3Storage:
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    for var in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_CLUSTER_NAME"):
        monkeypatch.delenv(var, raising=False)
    caplog.set_level(logging.INFO, logger="finetune")
    return S3Storage(f"s3://{BUCKET}/{request.node.name}")


def put_lease(remote: S3Storage, **fields) -> dict:
    info = {**identity("earlier", 30.0), **fields}
    remote.write_bytes(LEASE, encode(info))
    return info


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_free_prefix_is_taken_renewed_and_released(remote):
    lease = acquire(remote, "first", renew_s=0.1)
    info = holder(remote)
    assert (info["run_id"], info["pid"], info["beat"]) == ("first", os.getpid(), 0)
    assert held_by(remote, "first") and not held_by(remote, "second")
    deadline = time.monotonic() + AT_ONCE
    while holder(remote)["beat"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert holder(remote)["beat"] >= 3, "the heartbeat renews the object"
    assert lease.check() and not lease.lost
    lease.release()
    assert remote.read_tagged(LEASE) is None
    lease.release()  # idempotent


def test_a_live_run_on_the_prefix_is_refused_naming_it(remote):
    lease = acquire(remote, "first")
    t0 = time.monotonic()
    with pytest.raises(
        RemoteLeaseHeld,
        match=r"--remote_output_dir s3://leases/.* is in use by "
        r"another run \(run id first, pid \d+ on host",
    ):
        acquire(remote, "second")
    assert time.monotonic() - t0 < AT_ONCE, "the same machine: decided from the pid, at once"
    assert holder(remote)["run_id"] == "first"
    lease.release()


def test_a_dead_holder_on_this_machine_is_taken_over_at_once(remote, caplog):
    put_lease(remote, pid=dead_pid())
    t0 = time.monotonic()
    lease = acquire(remote, "next")
    assert time.monotonic() - t0 < AT_ONCE and holder(remote)["run_id"] == "next"
    assert (
        "the previous run (run id earlier" in caplog.text and "took its lease over" in caplog.text
    )
    lease.release()


def test_a_silent_holder_elsewhere_is_watched_then_taken_a_beating_one_refused(remote, monkeypatch):
    put_lease(remote, **ELSEWHERE)
    t0 = time.monotonic()
    lease = acquire(remote, "next", observe_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < AT_ONCE and holder(remote)["run_id"] == "next"
    lease.release()
    with monkeypatch.context() as m:
        m.setattr(lease_mod, "machine", lambda: dict(ELSEWHERE))
        far = acquire(remote, "far", renew_s=0.1)
    with pytest.raises(RemoteLeaseHeld, match="run id far, pid .* on host node-elsewhere"):
        acquire(remote, "next", observe_s=5.0)
    far.release()


def test_a_requeued_slurm_job_takes_over_its_predecessor_at_once(remote, monkeypatch):
    put_lease(remote, slurm_job_id="42", slurm_restart_count=0, slurm_cluster=None, **ELSEWHERE)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    t0 = time.monotonic()
    lease = acquire(remote, "42.1")  # the default observe_s would be 75 s
    assert time.monotonic() - t0 < AT_ONCE and holder(remote)["slurm_job_id"] == "42"
    lease.release()


def test_of_two_takers_of_one_dead_lease_exactly_one_wins(remote):
    """Both judge the same dead holder; the conditional PUT (If-Match its ETag) lets one in."""
    put_lease(remote, pid=dead_pid())
    go, results = threading.Event(), {}

    def take(name: str) -> None:
        go.wait()
        try:
            results[name] = acquire(S3Storage(remote.describe()), name)
        except RemoteLeaseHeld as e:  # the winner is this process: alive
            results[name] = e

    threads = [threading.Thread(target=take, args=(f"taker{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(60)
    won = [n for n, r in results.items() if not isinstance(r, Exception)]
    assert len(won) == 1 and len(results) == 4, results
    assert holder(remote)["run_id"] == won[0]
    results[won[0]].release()


def test_a_run_whose_lease_was_taken_over_learns_it_and_leaves_the_new_one(remote, caplog):
    """Another run judged this one dead (it stalled) and took the prefix: this run's heartbeat
    and check() see it, and its release does not delete the other run's lease."""
    lease = acquire(remote, "stalled", renew_s=0.1)
    other = {**identity("newer", 30.0), **ELSEWHERE}
    remote.write_bytes(LEASE, encode(other))
    deadline = time.monotonic() + AT_ONCE
    while not lease.lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lease.lost and not lease.check()
    assert "now belongs to another run (run id newer" in caplog.text
    assert not held_by(remote, "stalled")
    lease.release()
    assert holder(remote)["run_id"] == "newer", "a lost lease is never deleted on release"


def test_a_server_that_ignores_conditional_writes_is_refused(remote):
    class Unconditional(S3Storage):
        def put_if(self, rel, data, etag):
            self.write_bytes(rel, data)
            return self.read_tagged(rel)[1]

    loose = Unconditional(remote.describe())
    with pytest.raises(ConfigError, match="ignores conditional writes"):
        acquire(loose, "first")
    assert remote.read_tagged(LEASE) is None, "nothing left behind"


def test_the_lease_is_json_with_no_credentials(remote, server):
    lease = acquire(remote, "first")
    raw = remote.read_bytes(LEASE).decode()
    assert json.loads(raw)["run_id"] == "first"
    for secret in server.env().values():
        if "secret" in secret.lower():
            assert secret not in raw
    lease.release()
