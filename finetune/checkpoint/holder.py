"""Who holds a lease, and whether that process is still alive: the facts lease.py judges by.

A pid means the same process only on the same host, boot and pid namespace, and only while its
start time (field 22 of /proc/<pid>/stat) matches; a SLURM job at a higher restart count is a
requeue of the same job, whose earlier incarnation SLURM has killed.
"""

from __future__ import annotations

import os
import socket
from datetime import datetime
from pathlib import Path


def requeued_predecessor(info: dict, me: dict) -> bool:
    return (
        me["slurm_job_id"] is not None
        and info.get("slurm_job_id") == me["slurm_job_id"]
        and info.get("slurm_cluster") == me["slurm_cluster"]
        and as_int(info.get("slurm_restart_count")) < me["slurm_restart_count"]
    )


def same_machine(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("host", "boot_id", "pid_ns"))


def process_gone(pid: int, pid_start: int | None) -> str | None:
    """Why process ``pid`` of this machine is not the lease's holder any more, or
    None if it still is."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"process {pid} has exited"
    except PermissionError:
        pass  # it exists, run by another user
    stat = proc_stat(pid)
    if stat is None:
        return None  # exists; no /proc to say more (or it hides other users' processes)
    state, start = stat
    if state in ("Z", "X"):
        return f"process {pid} has exited"
    if pid_start is not None and start != pid_start:
        return f"pid {pid} now belongs to another process"
    return None


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) from /proc/<pid>/stat; None without one."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # after the command name, which may hold spaces and ")"
    fields = text.rpartition(")")[2].split()
    try:
        return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)
    except (IndexError, ValueError):
        return None


def identity(run_id: str, renew_s: float) -> dict:
    pid = os.getpid()
    stat = proc_stat(pid)
    job = os.environ.get("SLURM_JOB_ID") or None
    where = machine()
    return {
        "run_id": run_id,
        "host": where["host"],
        "pid": pid,
        "pid_start": stat[1] if stat else None,
        "started": datetime.now().astimezone().isoformat(timespec="seconds"),
        "slurm_job_id": job,
        "beat": 0,
        "boot_id": where["boot_id"],
        "pid_ns": where["pid_ns"],
        "slurm_restart_count": as_int(os.environ.get("SLURM_RESTART_COUNT")) if job else None,
        "slurm_cluster": os.environ.get("SLURM_CLUSTER_NAME") if job else None,
        "renew_s": renew_s,
    }


def machine() -> dict:
    """Where a pid means the same process: the host, its current boot, and the pid namespace."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = None
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    return {"host": socket.gethostname(), "boot_id": boot_id, "pid_ns": pid_ns}


def as_int(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
