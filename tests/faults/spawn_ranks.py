"""Start N finetune ranks as independent processes, the way ``srun`` (without --kill-on-bad-exit)
or ``mpirun`` do: no launcher kills the survivors when one rank dies, so a rank that would hang
waiting for a dead or failed peer shows up as one.

    python spawn_ranks.py NPROCS REPORT.json MASTER_PORT -- [finetune flags...]

Each rank gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT and inherits this
process's group and output. When every rank has exited, REPORT.json holds each rank's exit code
(negative: killed by that signal) and the wall-clock time it exited; the exit code is the first
non-zero rank's (as the shell reports a signal: 128 + signal), else 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    nprocs, report, port = int(argv[0]), argv[1], argv[2]
    args = argv[4:] if argv[3:4] == ["--"] else argv[3:]
    started = time.time()
    procs = []
    for r in range(nprocs):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(nprocs),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(subprocess.Popen([sys.executable, "-m", "finetune", *args], env=env))
    codes: list[int | None] = [None] * nprocs
    ended: list[float | None] = [None] * nprocs
    while None in codes:
        for r, p in enumerate(procs):
            if codes[r] is None and p.poll() is not None:
                codes[r], ended[r] = p.returncode, time.time()
        time.sleep(0.02)
    with open(report + ".tmp", "w") as f:
        json.dump(
            {"pids": [p.pid for p in procs], "codes": codes, "ended": ended, "started": started}, f
        )
    os.replace(report + ".tmp", report)
    failed = next((c for c in codes if c), 0)
    return 128 - failed if failed < 0 else failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
