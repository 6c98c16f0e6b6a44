"""The output dir's lease: one live run per dir, and a dead holder never blocks the next run."""

from __future__ import annotations

import errno
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from finetune import lease as lease_mod
from finetune.config import ConfigError
from finetune.lease import LEASE, LeaseHeld, acquire, holder

REPO = Path(__file__).resolve().parents[2]
AT_ONCE = 5.0  # seconds: "decided at once", against the 75 s a holder on another machine is watched
ELSEWHERE = {"host": "node-elsewhere", "boot_id": "another-boot", "pid_ns": "pid:[1]"}

# A process that takes the lease and holds it until killed.
HOLD = """
import sys, time
from finetune.lease import acquire
lease = acquire(sys.argv[1], sys.argv[2], renew_s=float(sys.argv[3]))
print("held", flush=True)
time.sleep(60)
"""

# A process that races for the lease when the file argv[2] appears, says how it went, and holds a
# lease it won until its stdin closes.
RACE = """
import pathlib, sys, time
from finetune.lease import LeaseHeld, acquire
print("ready", flush=True)
go = pathlib.Path(sys.argv[2])
while not go.exists():
    time.sleep(0.001)
try:
    lease = acquire(sys.argv[1], sys.argv[3])
except LeaseHeld:
    print("held", flush=True)
    sys.exit(0)
print("won", flush=True)
sys.stdin.read()
"""


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch, caplog):
    for var in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_CLUSTER_NAME"):
        monkeypatch.delenv(var, raising=False)
    caplog.set_level(logging.INFO, logger="finetune")


@pytest.fixture
def spawn():
    """Start ``python -c SCRIPT args…`` with the repo importable; every child is killed at
    teardown."""
    procs = []

    def start(script: str, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", script, *args],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def write_lease(out: Path, **fields) -> dict:
    """A lease as another run would have written it: this machine's, unless ``fields`` say
    otherwise."""
    out.mkdir(parents=True, exist_ok=True)
    info = {**lease_mod.identity("other-run", 30.0), **fields}
    (out / LEASE).write_bytes(lease_mod.encode(info))
    return info


def files(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


def wait_for(cond, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def timed_acquire(out: Path, *args, **kw):
    t0 = time.monotonic()
    lease = acquire(out, *args, **kw)
    return lease, time.monotonic() - t0


def test_acquire_writes_the_lease_and_release_removes_it(tmp_path):
    out = tmp_path / "new" / "out"
    lease = acquire(out, "run-1")
    info = holder(out)
    assert info == lease.info
    assert (info["run_id"], info["pid"], info["host"], info["beat"]) == (
        "run-1",
        os.getpid(),
        socket.gethostname(),
        0,
    )
    assert {"pid_start", "started", "slurm_job_id"} <= info.keys()
    assert files(out) == [LEASE]
    lease.release()
    lease.release()  # idempotent
    assert files(out) == [] and holder(out) is None
    with acquire(out) as again:
        assert holder(out)["run_id"] == again.info["run_id"]
    assert files(out) == []


def test_a_live_holder_on_this_machine_is_refused_with_its_details(tmp_path):
    out = tmp_path / "out"
    with acquire(out, "first"):
        with pytest.raises(LeaseHeld) as e:
            acquire(out, "second")
    assert isinstance(e.value, ConfigError)  # the CLI prints it as one line and exits 2
    msg = str(e.value)
    assert msg.startswith(f"--output_dir {out} is in use by another run")
    for part in ("run id first", f"pid {os.getpid()}", f"host {socket.gethostname()}", "started "):
        assert part in msg
    assert "\n" not in msg


def test_a_sigkilled_holder_is_taken_over_at_once(tmp_path, spawn, caplog):
    out = tmp_path / "out"
    proc = spawn(HOLD, str(out), "victim", "30")
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(LeaseHeld, match=f"run id victim, pid {proc.pid} on host"):
        acquire(out, "next")
    proc.kill()
    # Not reaped yet: a zombie is dead too.
    wait_for(lambda: (lease_mod.proc_stat(proc.pid) or ("Z",))[0] == "Z")
    lease, took = timed_acquire(out, "next")
    assert took < AT_ONCE and holder(out)["run_id"] == "next"
    assert "took its lease over" in caplog.text and "run id victim" in caplog.text
    assert files(out) == [LEASE]
    lease.release()


def test_a_reused_pid_is_not_the_holder(tmp_path, caplog):
    out = tmp_path / "out"
    mine = lease_mod.proc_stat(os.getpid())[1]
    write_lease(out, pid=os.getpid(), pid_start=mine + 1000)  # a live pid, but a later process
    lease, took = timed_acquire(out, "next")
    assert took < AT_ONCE and holder(out)["run_id"] == "next"
    assert "now belongs to another process" in caplog.text
    lease.release()


def test_a_silent_holder_on_another_machine_is_taken_over_after_observe_s(tmp_path, caplog):
    out = tmp_path / "out"
    write_lease(out, **ELSEWHERE)
    lease, took = timed_acquire(out, "next", observe_s=0.2)
    assert 0.2 <= took < AT_ONCE and holder(out)["run_id"] == "next"
    assert "watching its heartbeat" in caplog.text and "stayed at beat 0" in caplog.text
    assert files(out) == [LEASE]
    lease.release()


def test_a_holder_on_another_machine_that_releases_while_watched_lets_us_in(tmp_path):
    out = tmp_path / "out"
    write_lease(out, **ELSEWHERE)
    threading.Timer(0.1, (out / LEASE).unlink).start()
    lease, took = timed_acquire(out, "next", observe_s=5.0)
    # as soon as it is gone, not after observe_s
    assert took < 3.0 and holder(out)["run_id"] == "next"
    lease.release()


def test_observe_s_defaults_to_a_few_of_the_slower_heartbeats(tmp_path):
    out = tmp_path / "out"
    write_lease(out, renew_s=0.1, **ELSEWHERE)
    lease, took = timed_acquire(out, "next", renew_s=0.04)
    assert 2.5 * 0.1 <= took < AT_ONCE
    lease.release()


def test_a_beating_holder_on_another_machine_is_refused(tmp_path, monkeypatch):
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(lease_mod, "machine", lambda: dict(ELSEWHERE))
        far = acquire(out, "far", renew_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(LeaseHeld, match="run id far, pid .* on host node-elsewhere"):
        acquire(out, "next", observe_s=5.0)
    assert time.monotonic() - t0 < 3.0  # recognised by its first beat, not after observe_s
    far.release()


def test_a_requeued_slurm_job_takes_over_its_predecessor_at_once(tmp_path, monkeypatch):
    out = tmp_path / "out"
    write_lease(out, slurm_job_id="777", slurm_restart_count=0, slurm_cluster=None, **ELSEWHERE)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lease, took = timed_acquire(out, "777.1")  # the default observe_s would be 75 s
    assert took < AT_ONCE and holder(out)["slurm_job_id"] == "777"
    lease.release()


def test_two_runs_in_one_slurm_allocation_are_still_refused(tmp_path, monkeypatch):
    """Same job id, same restart count: as from two shells in one salloc."""
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    out = tmp_path / "out"
    with acquire(out, "a"):
        with pytest.raises(LeaseHeld, match="SLURM job 777"):
            acquire(out, "b")
    write_lease(out, slurm_job_id="777", slurm_restart_count=0, slurm_cluster=None, **ELSEWHERE)
    lease, took = timed_acquire(out, "b", observe_s=0.2)  # not at once: watched like any other
    assert took >= 0.2
    lease.release()


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b'{"run_id": "x", "ho',
        b"\x00\xff",
        b"[1, 2]",
        b'{"run_id": "x", "host": "h", "pid": 0, "beat": 0}',
    ],
)
def test_an_unreadable_lease_is_taken_over(tmp_path, content, caplog):
    out = tmp_path / "out"
    out.mkdir()
    (out / LEASE).write_bytes(content)
    assert holder(out) is None
    lease, took = timed_acquire(out, "next")
    assert took < AT_ONCE and holder(out)["run_id"] == "next"
    assert "unreadable" in caplog.text
    lease.release()


@pytest.mark.parametrize("stale", [False, True], ids=["free", "stale"])
def test_racing_threads_exactly_one_wins(tmp_path, stale):
    for round_ in range(10):
        out = tmp_path / str(round_)
        if stale:
            write_lease(out, pid=os.getpid(), pid_start=-1)
        barrier = threading.Barrier(8)
        won, refused = [], []

        def race(i, barrier=barrier, won=won, refused=refused, out=out):
            barrier.wait()
            try:
                won.append(acquire(out, f"racer{i}"))
            except LeaseHeld:
                refused.append(i)

        threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(refused) == 7
        assert holder(out)["run_id"] == won[0].info["run_id"] and files(out) == [LEASE]
        won[0].release()


def test_racing_processes_exactly_one_wins(tmp_path, spawn):
    out, go = tmp_path / "out", tmp_path / "go"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    write_lease(out, pid=int(dead.stdout), pid_start=None)  # a predecessor that has exited
    procs = [spawn(RACE, str(out), str(go), f"racer{i}") for i in range(4)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    go.touch()
    outcomes = [p.stdout.readline().strip() for p in procs]
    assert sorted(outcomes) == ["held"] * 3 + ["won"]
    assert holder(out)["run_id"] == f"racer{outcomes.index('won')}" and files(out) == [LEASE]


def test_a_slow_taker_leaves_a_lease_that_changed_since_it_was_judged(tmp_path):
    """It must not replace the lease a faster taker has just written (its marker was removed by
    then)."""
    out = tmp_path / "out"
    old = lease_mod.encode(write_lease(out, run_id="dead"))
    new = lease_mod.encode(write_lease(out, run_id="fast-taker"))
    me = lease_mod.identity("slow-taker", 30.0)
    assert not lease_mod._evict(out / LEASE, old, me, None)
    assert (out / LEASE).read_bytes() == new and files(out) == [LEASE]


def test_a_taker_that_died_mid_takeover_does_not_block_the_next(tmp_path, caplog):
    out = tmp_path / "out"
    dead = write_lease(out, pid=os.getpid(), pid_start=-1)
    key = lease_mod.hashlib.sha256(lease_mod.encode(dead)).hexdigest()[:16]
    crashed = lease_mod.identity("crashed-taker", 30.0) | {"pid_start": -1}  # its process is gone
    (out / f"{lease_mod.TAKING}.{key}.1").write_bytes(lease_mod.encode(crashed))
    lease, took = timed_acquire(out, "next")
    assert took < AT_ONCE and holder(out)["run_id"] == "next" and files(out) == [LEASE]
    lease.release()


def test_a_live_taker_that_never_finishes_is_named(tmp_path):
    out = tmp_path / "out"
    dead = write_lease(out, pid=os.getpid(), pid_start=-1)
    key = lease_mod.hashlib.sha256(lease_mod.encode(dead)).hexdigest()[:16]
    # this live process, as if stopped mid-takeover
    stuck = lease_mod.identity("stuck-taker", 30.0)
    (out / f"{lease_mod.TAKING}.{key}.1").write_bytes(lease_mod.encode(stuck))
    with pytest.raises(LeaseHeld, match="run id stuck-taker"):
        acquire(out, "next", observe_s=0.2)


@pytest.mark.parametrize(
    "theirs",
    [dict(run_id="theirs", **ELSEWHERE), dict(run_id="mine", pid=1)],
    ids=["another run", "same run id, another process"],
)
def test_release_leaves_someone_elses_lease(tmp_path, theirs):
    out = tmp_path / "out"
    lease = acquire(out, "mine")
    written = write_lease(out, **theirs)
    lease.release()
    assert holder(out) == written


def test_the_heartbeat_advances_beat(tmp_path):
    out = tmp_path / "out"
    with acquire(out, "run", renew_s=0.02) as lease:
        wait_for(lambda: holder(out)["beat"] >= 3)
        assert lease_mod.is_ours((out / LEASE).read_bytes(), lease.info) and not lease.lost
    assert files(out) == []


def test_the_heartbeat_never_overwrites_a_run_that_took_over(tmp_path, caplog):
    out = tmp_path / "out"
    lease = acquire(out, "stalled", renew_s=0.1)
    # Just after a beat, so the takeover does not land inside the heartbeat's read-then-replace.
    wait_for(lambda: holder(out)["beat"] >= 1)
    written = write_lease(out, run_id="newcomer", **ELSEWHERE)
    wait_for(lambda: lease.lost)
    time.sleep(0.3)  # more heartbeat periods
    assert holder(out) == written
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "run id newcomer" in errors[0].getMessage()
    lease.release()
    assert holder(out) == written


def test_a_takeover_while_the_heartbeat_syncs_is_seen_not_overwritten(tmp_path, monkeypatch):
    """The heartbeat's slow part (write and fsync of the next lease) comes before it reads the
    lease: a takeover landing during that sync is read, and the run stops beating. Read first,
    the run would rename its lease over the newcomer's."""
    out = tmp_path / "out"
    lease = acquire(out, "stalled", renew_s=0.05)
    wait_for(lambda: holder(out)["beat"] >= 1)
    taken = threading.Event()
    write = lease_mod._write_file

    def slow_sync(path, data, mode="wb"):
        write(path, data, mode)
        if ".tmp." in path.name and not taken.is_set():
            taken.set()
            write_lease(out, run_id="newcomer", **ELSEWHERE)

    monkeypatch.setattr(lease_mod, "_write_file", slow_sync)
    wait_for(lambda: lease.lost)
    assert holder(out)["run_id"] == "newcomer"
    lease.release()
    assert holder(out)["run_id"] == "newcomer"


def test_a_failing_heartbeat_warns_and_keeps_trying(tmp_path, monkeypatch, caplog):
    out = tmp_path / "out"
    lease = acquire(out, "run", renew_s=0.02)

    def disk_full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(lease_mod, "_write_file", disk_full)
        time.sleep(0.15)
        assert lease._thread.is_alive()
    beat = holder(out)["beat"]
    wait_for(lambda: holder(out)["beat"] > beat and "renewed" in caplog.text)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left" in warnings[0]
    assert files(out) == [LEASE]
    lease.release()


def test_the_heartbeat_recreates_a_removed_lease(tmp_path):
    out = tmp_path / "out"
    with acquire(out, "run", renew_s=0.02):
        (out / LEASE).unlink()
        wait_for(lambda: (holder(out) or {}).get("run_id") == "run")


def test_an_unwritable_output_dir_is_a_config_error(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("")
    with pytest.raises(ConfigError, match="--output_dir"):
        acquire(path)
