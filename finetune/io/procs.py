"""Facts about processes on this machine: whether a pid is still the process it was, and where a
pid means the same process at all (host, boot, pid namespace). The lease (finetune/lease.py)
judges its holder by them.

A pid means the same process only on the same host, boot and pid namespace, and only while its
start time (field 22 of /proc/<pid>/stat) matches.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


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
