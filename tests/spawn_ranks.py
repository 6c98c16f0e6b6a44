"""Start N finetune ranks as independent processes, the way ``srun`` (without --kill-on-bad-exit)
or ``mpirun`` do: no launcher kills the survivors when one rank dies, so a rank that would hang
waiting for a dead or failed peer shows up as one.

    python spawn_ranks.py NPROCS REPORT.json MASTER_PORT [--fork] -- [finetune flags...]

Each rank gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT and inherits this
process's group and output. REPORT.json.pids holds ``{rank: pid}`` once every rank is started. When
every rank has exited, REPORT.json holds each rank's exit code (negative: killed by that signal)
and the wall-clock time it exited; REPORT ``-`` writes neither. The exit code is the first non-zero
rank's (as the shell reports a signal: 128 + signal), else 0: a rank's own code passes through, as
under DeepSpeed's launcher (torchrun reports any failure as 1).

Without ``--fork`` each rank is ``python -m finetune``. With it, this process imports the libraries
every rank imports (torch, transformers, DeepSpeed, datasets: ~6 s of one core) once, then forks
the ranks, which run ``python -m finetune``'s code from there: the same processes, minus the
imports, which are ~40 % of a short test run's CPU. What a fault test looks at (saves, commits,
kills, signals, exits) starts after that; a test about signals *during* start-up runs without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

# What every rank imports before its first step (import order as in a run); finetune itself is
# not preloaded: its modules read their environment (the fault to inject, the rank) when imported.
PRELOAD = (
    "torch",
    "torch.distributed",
    "deepspeed",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.muon.muon_optimizer",  # imported by DeepSpeed's ZeRO optimizer check
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.optimization",
    "datasets",
)


def _rank_env(rank: int, nprocs: int, port: str) -> dict:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }


def _forked_rank(env: dict, args: list[str]) -> None:
    """In the child: become ``python -m finetune ARGS`` (finetune/__main__.py's two steps); never
    returns (finetune's entry leaves with os._exit)."""
    os.environ.update(env)
    sys.argv = [sys.argv[0], *args]
    sys.path[0] = os.getcwd()  # as under -m: the working directory, not this script's folder
    code = 1
    try:
        from finetune.preemption import catch_early

        catch_early()
        from finetune.cli import entry

        entry()
    finally:
        os._exit(code)  # only when entry itself failed to import or raised


def main(argv: list[str]) -> int:
    nprocs, report, port = int(argv[0]), argv[1], argv[2]
    rest = argv[3:]
    fork = rest[:1] == ["--fork"]
    rest = rest[1:] if fork else rest
    args = rest[1:] if rest[:1] == ["--"] else rest
    started = time.time()
    pids: list[int] = []
    if fork:
        import importlib

        for name in PRELOAD:
            importlib.import_module(name)
        sys.stdout.flush()
        sys.stderr.flush()
        for r in range(nprocs):
            pid = os.fork()
            if pid == 0:
                _forked_rank(_rank_env(r, nprocs, port), args)
            pids.append(pid)
    else:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "finetune", *args],
                env=dict(os.environ, **_rank_env(r, nprocs, port)),
            )
            for r in range(nprocs)
        ]
        pids = [p.pid for p in procs]
    if report != "-":
        with open(report + ".pids.tmp", "w") as f:
            json.dump({str(r): pid for r, pid in enumerate(pids)}, f)
        os.replace(report + ".pids.tmp", report + ".pids")
    codes: list[int | None] = [None] * nprocs
    ended: list[float | None] = [None] * nprocs
    while None in codes:
        for r, pid in enumerate(pids):
            if codes[r] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[r], ended[r] = os.waitstatus_to_exitcode(status), time.time()
        time.sleep(0.02)
    if report != "-":
        with open(report + ".tmp", "w") as f:
            json.dump({"pids": pids, "codes": codes, "ended": ended, "started": started}, f)
        os.replace(report + ".tmp", report)
    failed = next((c for c in codes if c), 0)
    return 128 - failed if failed < 0 else failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
