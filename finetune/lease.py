"""One live run per output dir: ``OUT/.lease``, held and heartbeated while a run writes there.

A run that would write into an output dir that a live run is using is refused with one line naming
that run (``LeaseHeld``, a ``ConfigError``: the CLI exits 2). A run whose predecessor died (SIGKILL,
node loss, a SLURM requeue) takes the lease over, so a restart is never blocked by a dead holder.
The output dir may be a local disk or a network filesystem (NFS, Lustre) shared by hosts whose
clocks disagree.

The lease is a small JSON object (``identity``, below): who holds it, where, since when, and
``beat``, a counter the heartbeat advances.

How ``acquire`` judges an existing lease's holder (the first rule that applies):

1. Unreadable, empty or garbled: dead (a crash mid-write). It is read twice, 0.1 s apart, first:
   where hard links are unsupported a writer's file is briefly partial.
2. The same SLURM job (cluster and job id) at an earlier ``SLURM_RESTART_COUNT``: dead at once,
   because SLURM requeues a job only after killing all of it. The same job at the *same* restart
   count proves nothing: two runs started in one ``salloc`` share a job id and are both alive.
3. The same machine (hostname, kernel boot id and pid namespace all equal): alive iff its pid
   exists, is not a zombie, and started when the lease says (a reused pid started later). Decided at
   once. A hostname alone is not enough: containers with host networking share one but not their
   pids, and after a reboot an old pid means nothing.
4. Another machine: alive iff its ``beat`` changes within ``observe_s`` (default 2.5 × the larger of
   both runs' ``renew_s``, i.e. 75 s with the default 30 s heartbeat). The lease is re-read every
   ≤ 1 s, so a live holder is recognised within about one heartbeat. A counter, not a timestamp or
   an mtime, because the hosts' clocks may be skewed.

So a dead predecessor costs the next run nothing on the same machine or after a requeue, and 75 s
(logged) when it ran on another machine.

Atomicity on NFS and Lustre too (create by ``link``, take over through an exclusive marker renamed
over the dead lease, heartbeat by temp file + rename, a lost lease stops the run): each step and
why it holds, and the one window left, are in docs/CHECKPOINTS.md, "How the lease stays atomic".

Test seam: ``FINETUNE_LEASE_RENEW_S=<seconds>``, the heartbeat of a run (default 30).
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import logging
import os
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from finetune.config import ConfigError
from finetune.io import seams
from finetune.io.faults import fault_point
from finetune.io.procs import machine, proc_stat, process_gone, same_machine

logger = logging.getLogger("finetune")

LEASE = ".lease"
TAKING = ".lease.taking"  # + .<hash of the dead lease>.<n>: one taker at a time replaces that lease
RENEW_S = 30.0
# a holder on another machine is dead after this many of its heartbeats pass unseen
OBSERVE_FACTOR = 2.5
_RECHECK_S = 0.1  # between the two reads of a garbled lease
MAX_TRIES = 20  # judge-and-take rounds before giving up on a lease that keeps changing hands
_JOIN_S = 10.0  # release() waits this long for a heartbeat write in flight
_NO_HARDLINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
# Two leases with these equal were written by the same process of the same run.
_OWNER_KEYS = ("run_id", "host", "boot_id", "pid_ns", "pid", "pid_start", "started")

# judge's verdicts on a lease's holder
ALIVE = "alive"
DEAD = "dead"
CHANGED = "changed"  # the lease changed while it was judged: judge it again


class LeaseLost(RuntimeError):
    """This run no longer holds its output dir's lease: another run took it over (this one stalled
    for longer than that one watched). Raised alike on every rank; the run stops with exit code 3
    (``exit_status.EXIT_LEASE_LOST``) and writes nothing more into the output dir."""


class LeaseHeld(ConfigError):
    """A live run holds the lease of ``where`` (the value of ``flag``); ``holder`` is its lease."""

    def __init__(self, where: str | os.PathLike, holder: dict, flag: str = "--output_dir"):
        self.holder = holder
        super().__init__(
            f"{flag} {where} is in use by another run ({describe(holder)}); "
            f"wait for it to finish or choose another {flag}"
        )


def describe(info: dict) -> str:
    """``run id R, pid P on host H, started T``, with the SLURM job when there is one."""
    text = f"run id {info.get('run_id')}, pid {info.get('pid')} on host {info.get('host')}"
    if info.get("slurm_job_id"):
        text += f", SLURM job {info['slurm_job_id']}"
    return f"{text}, started {info.get('started')}"


def holder(out: str | os.PathLike) -> dict | None:
    """The output dir's lease, or None when it has none (or only an unreadable one)."""
    return parse(_read(Path(out) / LEASE))


def describe_holder(out: str | os.PathLike) -> str:
    """Who holds the output dir's lease now, for the message of a run that lost it."""
    try:
        info = holder(out)
    except OSError as e:
        return f"its lease is unreadable: {e}"
    return describe(info) if info else "its lease is gone"


def acquire(
    out: str | os.PathLike,
    run_id: str | None = None,
    *,
    renew_s: float | None = None,
    observe_s: float | None = None,
) -> Lease:
    """Take ``OUT/.lease`` (creating OUT) for this process, taking it over from a dead holder.

    Raises ``LeaseHeld`` when a live run holds it, and ``ConfigError`` when it cannot be written.
    ``renew_s``: the heartbeat (default RENEW_S; test seam: $FINETUNE_LEASE_RENEW_S). ``observe_s``:
    how long to watch a holder on another machine (default: see the module doc).
    """
    if renew_s is None:
        renew_s = seams.number(seams.LEASE_RENEW_S, RENEW_S)
    if renew_s <= 0:
        raise ValueError(f"renew_s must be positive, not {renew_s}")
    out = Path(out)
    me = identity(run_id or uuid.uuid4().hex[:12], renew_s)
    try:
        fault_point("lease.acquire")
        out.mkdir(parents=True, exist_ok=True)
        _take(out / LEASE, me, observe_s)
    except OSError as e:
        raise ConfigError(f"--output_dir {out}: cannot take its lease {out / LEASE}: {e}") from e
    return Lease(out, me)


class Lease:
    """This process's hold on ``OUT/.lease``, renewed by a daemon thread until ``release()``."""

    def __init__(self, out: Path, info: dict):
        self.path = Path(out) / LEASE
        self.info = info
        self._tag = _tag(info["run_id"])
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._released = False  # release() has begun
        self._lost = False  # another run holds the lease now
        self._failing = False  # the last renewal failed (logged once until one succeeds)
        self._thread = threading.Thread(target=self._run, name="finetune-lease", daemon=True)
        self._thread.start()

    @property
    def lost(self) -> bool:
        """True once another run has taken the lease over (this one stalled for longer
        than it watched)."""
        return self._lost

    def check(self) -> bool:
        """Re-read the lease now (before a commit, a publish, retention): False, and ``lost`` from
        then on, when another run holds it. A missing lease counts as ours (the heartbeat writes it
        again). Raises OSError when it cannot be read."""
        if self._lost:
            return False
        raw = _read(self.path)
        other = parse(raw)
        if other is not None and not is_ours(raw, self.info):
            self._lost = True
            logger.error(
                "%s now belongs to another run (%s): this run stops "
                "and writes nothing more into %s",
                self.path,
                describe(other),
                self.path.parent,
            )
            return False
        return True

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still ours. Idempotent; never raises."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=_JOIN_S)
        try:
            if is_ours(_read(self.path), self.info):
                self.path.unlink()
        except OSError as e:
            logger.warning("could not remove this run's lease %s: %s", self.path, e)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _run(self) -> None:
        while not self._stop.wait(self.info["renew_s"]):
            if not self._beat():
                return

    def _beat(self) -> bool:
        """Renew the lease once; False when it is lost and beating must stop.

        The new lease is written and synced to a temp file first; only then is the lease read and,
        if still ours, replaced: the window in which a takeover can be overwritten is the read and
        the rename, not the fsync (which a loaded disk can stretch to seconds)."""
        info = {**self.info, "beat": self.info["beat"] + 1}
        tmp = self.path.with_name(f"{LEASE}.tmp.{self._tag}")
        try:
            _write_file(tmp, encode(info))
            current = _read(self.path)
            other = parse(current)
            if other is not None and not is_ours(current, self.info):
                self._lost = True
                logger.error(
                    "%s now belongs to another run (%s): this run stalled for longer than "
                    "that run watched its heartbeat; it stops at its next step boundary "
                    "and writes nothing more into %s",
                    self.path,
                    describe(other),
                    self.path.parent,
                )
                return False
            if current is None:
                logger.warning("%s vanished while this run held it; creating it again", self.path)
                if not _publish(self.path, encode(info), self._tag):
                    return True  # another run's now: the next beat says whose
            elif self._stop.is_set():
                return False  # release() may be about to remove the lease: don't bring it back
            else:
                os.replace(tmp, self.path)
            self.info = info
        except OSError as e:
            if not self._failing:
                logger.warning(
                    "cannot renew %s (retrying every %g s): %s", self.path, self.info["renew_s"], e
                )
            self._failing = True
            return True
        finally:
            tmp.unlink(missing_ok=True)
        if self._failing:
            logger.info("renewed %s again", self.path)
            self._failing = False
        return True


def _take(path: Path, me: dict, observe_s: float | None) -> None:
    for _ in range(MAX_TRIES):
        if _publish(path, encode(me), _tag(me["run_id"])):
            return
        raw = _read(path)
        if raw is None:
            continue  # released between our attempt and our read
        verdict, raw, why = judge(lambda: _read(path), str(path), raw, me, observe_s)
        if verdict == ALIVE:
            raise LeaseHeld(path.parent, parse(raw))
        if verdict == DEAD and _evict(path, raw, me, observe_s):
            old = parse(raw)
            logger.warning(
                "%s: the previous run (%s) is dead (%s); took its lease over",
                path.parent,
                describe(old) if old else "holder unknown",
                why,
            )
            return
    raise ConfigError(
        f"--output_dir {path.parent}: its lease changed hands {MAX_TRIES} times while this run "
        "tried to take it; are several runs starting on it at once?"
    )


def judge(
    read: Callable[[], bytes | None], where: str, raw: bytes, me: dict, observe_s: float | None
) -> tuple[str, bytes | None, str]:
    """(verdict, the lease bytes it applies to, why dead) for the lease ``raw`` just read at
    ``where``; ``read()`` reads it again (a file here, an object for the remote lease)."""
    info = parse(raw)
    if info is None:
        time.sleep(_RECHECK_S)
        again = read()
        if again != raw:
            return CHANGED, again, ""
        return DEAD, raw, "its lease is unreadable, left by a crash mid-write"
    if requeued_predecessor(info, me):
        restarts = f"{info.get('slurm_restart_count') or 0} → {me['slurm_restart_count']}"
        return DEAD, raw, f"SLURM requeued job {me['slurm_job_id']}: restart {restarts}"
    if same_machine(info, me):
        why = process_gone(info["pid"], info.get("pid_start"))
        return (DEAD, raw, why) if why else (ALIVE, raw, "")
    return _observe(read, where, raw, info, _observe_time(info, me, observe_s))


def _observe_time(info: dict, me: dict, observe_s: float | None) -> float:
    if observe_s is not None:
        return observe_s
    theirs = info.get("renew_s")
    theirs = theirs if isinstance(theirs, (int, float)) and theirs > 0 else 0
    return OBSERVE_FACTOR * max(me["renew_s"], theirs)


def _observe(
    read: Callable[[], bytes | None], where: str, raw: bytes, info: dict, observe_s: float
) -> tuple[str, bytes | None, str]:
    """Watch a holder on another machine: alive as soon as its beat moves; dead if it stays put."""
    logger.info(
        "%s is held by %s on another machine; watching its heartbeat for up to %g s to see "
        "whether it is alive",
        where,
        describe(info),
        observe_s,
    )
    poll = min(1.0, observe_s / 10)
    deadline = time.monotonic() + observe_s
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(poll, left))
        now = read()
        if now == raw:
            continue
        return (ALIVE if is_ours(now, info) else CHANGED), now, ""
    return DEAD, raw, f"its heartbeat stayed at beat {info['beat']} for {observe_s:g} s"


def _evict(path: Path, raw: bytes, me: dict, observe_s: float | None) -> bool:
    """Replace the lease ``raw``, judged dead, by ours; False (nothing changed) once
    it is not current."""
    key = hashlib.sha256(raw).hexdigest()[:16]
    for n in itertools.count(1):
        marker = path.with_name(f"{TAKING}.{key}.{n}")
        if _publish(marker, encode(me), _tag(me["run_id"])):
            break
        if _await_taker(path, raw, marker, me, observe_s) == CHANGED:
            return False
        # DEAD: that taker died holding marker n; the next one is ours to try
    # replaced before we won the marker (whose previous copy was then removed)
    if _read(path) != raw:
        marker.unlink(missing_ok=True)
        return False
    try:
        os.replace(marker, path)
    except FileNotFoundError:  # NFS: a retried rename whose first reply was lost
        if not is_ours(_read(path), me):
            raise
    # markers of replaced leases only: nobody can have judged ours dead yet
    for leftover in path.parent.glob(f"{TAKING}.*"):
        leftover.unlink(missing_ok=True)
    return True


def _await_taker(path: Path, raw: bytes, marker: Path, me: dict, observe_s: float | None) -> str:
    """Another taker holds ``marker`` for the dead lease ``raw``: CHANGED once the lease
    (or the marker) changes, DEAD once that taker is seen dead. Raises LeaseHeld if it
    lives but never finishes."""
    mraw = _read(marker)
    taker = parse(mraw)
    if mraw is None:
        return CHANGED  # removed by a taker that has finished
    if taker is None:  # garbled: crashed mid-write, or (without hard links) still writing
        time.sleep(_RECHECK_S)
        return CHANGED if _read(marker) != mraw else DEAD
    local = same_machine(taker, me)
    deadline = time.monotonic() + _observe_time(taker, me, observe_s)
    pause = 0.005
    while _read(path) == raw and _read(marker) == mraw:
        if local and process_gone(taker["pid"], taker.get("pid_start")):
            return DEAD
        if time.monotonic() > deadline:
            if local:
                raise LeaseHeld(path.parent, taker)
            return DEAD
        time.sleep(pause)
        pause = min(2 * pause, 1.0)
    return CHANGED


def _tag(run_id: str) -> str:
    """A file-name-safe name for this call's temp files, unique among racing takers."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:64]
    return f"{safe}.{os.getpid()}.{secrets.token_hex(3)}"


def is_ours(raw: bytes | None, info: dict) -> bool:
    """Whether lease bytes ``raw`` were written by the process and run that ``info`` describes."""
    other = parse(raw)
    return other is not None and all(other.get(k) == info.get(k) for k in _OWNER_KEYS)


def parse(raw: bytes | None) -> dict | None:
    """A lease's content, or None when it is missing, garbled, or lacks what the rules need."""
    if raw is None:
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(info, dict):
        return None
    pid = info.get("pid")
    beat = info.get("beat")
    if (
        not isinstance(info.get("run_id"), str)
        or not isinstance(info.get("host"), str)
        or type(pid) is not int
        or pid <= 0
        or type(beat) is not int
    ):
        return None  # (a pid <= 0 would make os.kill signal a whole process group)
    return info


def encode(info: dict) -> bytes:
    return (json.dumps(info, indent=2) + "\n").encode()


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _publish(path: Path, data: bytes, tag: str) -> bool:
    """Create ``path`` holding ``data``, complete or not at all; False if it already exists."""
    tmp = path.with_name(f"{LEASE}.tmp.{tag}")
    try:
        _write_file(tmp, data)
        os.link(tmp, path)
        return True
    except FileExistsError:
        # NFS: a retried link that had succeeded (see the module doc)
        return os.stat(tmp).st_nlink == 2
    except OSError as e:
        if e.errno not in _NO_HARDLINKS:
            raise
        return _create_exclusive(path, data)
    finally:
        tmp.unlink(missing_ok=True)


def _create_exclusive(path: Path, data: bytes) -> bool:
    """``_publish`` without hard links: readers may briefly see a partial file (hence
    rule 1's re-read)."""
    try:
        _write_file(path, data, "xb")
    except FileExistsError:
        return False
    return True


def _write_file(path: Path, data: bytes, mode: str = "wb") -> None:
    with open(path, mode) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# ---------- who holds a lease, and whether that process is still alive ----------
# A SLURM job at a higher restart count is a requeue of the same job, whose earlier incarnation
# SLURM has killed. Whether a pid is alive, and where: io/procs.py.


def requeued_predecessor(info: dict, me: dict) -> bool:
    return (
        me["slurm_job_id"] is not None
        and info.get("slurm_job_id") == me["slurm_job_id"]
        and info.get("slurm_cluster") == me["slurm_cluster"]
        and as_int(info.get("slurm_restart_count")) < me["slurm_restart_count"]
    )


def identity(run_id: str, renew_s: float) -> dict:
    pid = os.getpid()
    env = os.environ
    job = env.get("SLURM_JOB_ID") or None
    stat = proc_stat(pid)
    return {
        "run_id": run_id,
        **machine(),  # host, boot_id, pid_ns
        "pid": pid,
        "pid_start": stat[1] if stat else None,
        "started": datetime.now().astimezone().isoformat(timespec="seconds"),
        "slurm_job_id": job,
        "beat": 0,
        "slurm_restart_count": as_int(env.get("SLURM_RESTART_COUNT")) if job else None,
        "slurm_cluster": env.get("SLURM_CLUSTER_NAME") if job else None,
        "renew_s": renew_s,
    }


def as_int(value: object) -> int:
    """A SLURM count as the environment or a lease holds it (an int or a string of digits); 0
    otherwise."""
    return (
        int(value) if isinstance(value, int) or (isinstance(value, str) and value.isdigit()) else 0
    )
