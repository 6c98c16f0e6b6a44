"""A real one-node SLURM cluster on localhost for the tests: munged, slurmctld and slurmd.

Debian's ``slurm-wlm`` and ``munge`` packages (``.ci/run`` installs them); daemons run as root in
the foreground from a temporary directory with their own ports, state and logs, and stop at the
end of the session. ``start()`` raises ``Unavailable`` with the reason when this cannot work here.

Partitions, all on the one node: ``test`` (the default; never preempted), and for preemption tests
``low`` (PreemptMode=REQUEUE, GraceTime=``grace_time``) and ``high`` (a higher PriorityTier: a job
there that does not fit preempts ``low``'s). ``KillWait=kill_wait`` (30 s, SLURM's default).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = (
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "scontrol",
    "squeue",
    "scancel",
    "sinfo",
    "srun",
)


class Unavailable(RuntimeError):
    pass


def running_cluster(root: Path, **options):
    """A module fixture's body: a started cluster for the module's tests, stopped after them; the
    tests skip, with the reason, where SLURM cannot run here."""
    import pytest

    cluster = SlurmCluster(root, **options)
    try:
        cluster.start()
    except Unavailable as e:
        pytest.skip(f"no SLURM test cluster here: {e}")
    yield cluster
    cluster.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self, root: Path, grace_time: int = 60, kill_wait: int = 30):
        self.root = root
        self.grace_time = grace_time
        self.kill_wait = kill_wait
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.node = socket.gethostname().split(".")[0]

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> SlurmCluster:
        missing = [
            d for d in DAEMONS if not (shutil.which(d) or shutil.which(d, path="/usr/sbin:/sbin"))
        ]
        if missing:
            raise Unavailable(
                f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge)"
            )
        if os.geteuid() != 0:
            raise Unavailable("slurmd must run as root to start jobs")
        self._start_munge()
        self._write_conf()
        for daemon, extra in (("slurmctld", ["-i"]), ("slurmd", ["-N", self.node])):
            log = open(self.root / f"{daemon}.out", "w")
            exe = shutil.which(daemon) or shutil.which(daemon, path="/usr/sbin:/sbin")
            self.procs.append(
                subprocess.Popen(
                    [exe, "-D", "-f", str(self.conf), *extra],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env(),
                )
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()
            if state and set(state.split()) <= {"idle", "mixed"}:  # one line per partition
                return self
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.5)
        logs = "\n".join(
            (self.root / f).read_text()[-1500:]
            for f in ("slurmctld.log", "slurmd.log")
            if (self.root / f).exists()
        )
        self.stop()
        raise Unavailable(f"the node did not become idle within 60 s (state {state!r}):\n{logs}")

    def stop(self) -> None:
        if self.conf.exists():
            self.run(
                "scancel", "--full", "--signal=KILL", "--state=RUNNING", "-u", "root", check=False
            )
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs.clear()

    def _start_munge(self) -> None:
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return  # a munged is already running
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            subprocess.run(["mungekey", "--create"], check=True, capture_output=True)
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [shutil.which("munged", path="/usr/sbin:/sbin") or "munged", "--force"],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise Unavailable(f"munged did not start: {proc.stderr.strip()}")
        for _ in range(50):
            if (
                subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode
                == 0
            ):
                return
            time.sleep(0.1)
        raise Unavailable("munged started but does not answer")

    def _write_conf(self) -> None:
        detected = subprocess.run(
            [shutil.which("slurmd", path="/usr/sbin:/sbin") or "slurmd", "-C"],
            capture_output=True,
            text=True,
        ).stdout.splitlines()[0]
        # What slurmd detects (a configured count above it would drain the node), under our name.
        node_line = re.sub(r"^NodeName=\S+", f"NodeName={self.node} NodeAddr=127.0.0.1", detected)
        node_line = re.sub(r"RealMemory=\d+", "RealMemory=1000", node_line)
        r = self.root
        for d in ("state", "spool"):
            (r / d).mkdir(exist_ok=True)
        self.conf.write_text(f"""\
ClusterName=finetunetest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits for its old credential to expire before it may start again (default 120 s).
AuthInfo=cred_expire=10
# and then for a scheduling pass, as does a preemption: passes every 2 s instead of the main loop's
# 60 s and backfill's 30 s (one node and a job or two: a pass costs nothing).
SchedulerParameters=sched_interval=2,bf_interval=2
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
KillWait={self.kill_wait}
MinJobAge=600
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
{node_line} State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES \
PreemptMode=OFF
# Preemption by partition priority on the same node: a job in "high" that does not fit requeues the
# "low" jobs in its way, after SIGCONT+SIGTERM and a GraceTime (then SIGTERM again, KillWait,
# SIGKILL).
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=low Nodes={self.node} MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE \
GraceTime={self.grace_time}
PartitionName=high Nodes={self.node} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
""")

    # --- use -------------------------------------------------------------------------------

    def env(self, base: dict | None = None) -> dict:
        return {**(base if base is not None else os.environ), "SLURM_CONF": str(self.conf)}

    def run(
        self,
        *cmd: str,
        check: bool = True,
        env: dict | None = None,
        timeout: float = 60,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            list(cmd), capture_output=True, text=True, env=self.env(env), timeout=timeout, cwd=cwd
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr}{proc.stdout}"
            )
        return proc

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, …)."""
        text = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_for_state(self, job_id: str, states: set[str], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        info = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(1)
        raise AssertionError(f"job {job_id} not in {states} after {timeout}s: {info}")
