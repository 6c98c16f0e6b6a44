"""OUT/exit_status.json: how a run ended, for job scripts whose launcher loses the exit code.

torchrun reports any rank's non-zero exit as 1, and ``srun --kill-on-bad-exit`` can turn the
ranks still shutting down into signal deaths; the file keeps finetune's own code (75 =
preempted after a committed checkpoint). ``run_id`` echoes $FINETUNE_RUN_ID, which the scripts
set per launch, so a stale file from an earlier run is never mistaken for this one. ``reason``
tells ends with the same code apart: a run whose copy to --remote_output_dir was given up exits 1
like a crash, but says ``"remote copy failed"`` (its checkpoints committed in OUT, ``error``
naming the copy), so a job script can tell it from a crash.

For shell scripts (no torch import; fast)::

    python -m finetune.exit_status outdir [finetune flags...]      # prints the --output_dir
    python -m finetune.exit_status code RC [finetune flags...]     # prints the exit code to use
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry"
# another run took over the output dir's lease: this one stopped and wrote nothing more
EXIT_LEASE_LOST = 3
# exit 1 because the bucket's copy was given up (its tries failed, or no progress within its
# deadline); the local checkpoint is committed
REMOTE_COPY_FAILED = "remote copy failed"
EXIT_STATUS = "exit_status.json"
RUN_ID_ENV = "FINETUNE_RUN_ID"


def write_exit_status(output_dir: str, code: int | None, note: dict | None) -> None:
    """Rank 0, once its inputs are checked (code None) and at the end: the file,
    replaced atomically.

    Never raises: rank 0 alone calls it between collectives, and a full disk here must not leave
    the other ranks waiting for it; the launcher's own exit code still tells the outcome.
    """
    from finetune.io.durable import replace_text

    status = {
        "exit_code": code,
        "reason": "finished" if code == 0 else "failed",
        **(note or {}),
        "run_id": os.environ.get(RUN_ID_ENV),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        replace_text(Path(output_dir) / EXIT_STATUS, json.dumps(status, indent=2) + "\n")
    except OSError as e:
        print(
            f"[finetune] warning: cannot write {EXIT_STATUS} in {output_dir}: {e}", file=sys.stderr
        )


def clear_exit_status(output_dir: str) -> None:
    """Rank 0, as a run starts: remove a previous run's file (creates nothing; never raises)."""
    try:
        (Path(output_dir) / EXIT_STATUS).unlink(missing_ok=True)
    except OSError as e:
        print(
            f"[finetune] warning: cannot remove an old {EXIT_STATUS} in {output_dir}: {e}",
            file=sys.stderr,
        )


def output_dir_of(flags: list[str]) -> str:
    """The --output_dir finetune will use for these flags (the last one wins, like argparse)."""
    from finetune.config import CheckpointArgs

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--output_dir", default=CheckpointArgs.output_dir)
    return parser.parse_known_args(flags)[0].output_dir


def exit_code(launcher_code: int, output_dir: str, run_id: str | None) -> int:
    """The launcher's code, except a failure that this run's exit_status.json
    records as preempted."""
    if launcher_code == 0 or not run_id:
        return launcher_code
    try:
        status = json.loads((Path(output_dir) / EXIT_STATUS).read_text())
    except (OSError, ValueError):
        return launcher_code
    if status.get("run_id") == run_id and status.get("exit_code") == EXIT_PREEMPTED:
        return EXIT_PREEMPTED
    return launcher_code


def main(argv: list[str]) -> int:
    if argv[:1] == ["outdir"]:
        print(output_dir_of(argv[1:]))
        return 0
    if argv[:1] == ["code"] and len(argv) >= 2 and argv[1].lstrip("-").isdigit():
        print(exit_code(int(argv[1]), output_dir_of(argv[2:]), os.environ.get(RUN_ID_ENV)))
        return 0
    print(__doc__.split("For shell scripts")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
