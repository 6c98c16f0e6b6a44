"""Preemption signals in a plain process: recorded before torch is imported, kept or
re-delivered."""

from __future__ import annotations

import signal
import subprocess
import sys

SCRIPT = """
import os, signal, sys
from finetune.preemption import Preemption, catch_early, parse_signals
catch_early()
os.kill(os.getpid(), signal.SIGUSR1)      # arrives "during start-up"
p = Preemption(parse_signals(sys.argv[1]))
print("received", p.received, flush=True)
os.kill(os.getpid(), signal.SIGTERM)      # later signals: recorded, not fatal, when configured
print("received", p.received, flush=True)
"""


def _run(signals: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, signals], capture_output=True, text=True, timeout=60
    )


def test_a_signal_during_start_up_becomes_a_preemption_request():
    proc = _run("SIGTERM,SIGUSR1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["received ['SIGUSR1']", "received ['SIGUSR1', 'SIGTERM']"]
    assert "SIGTERM received again: already stopping" in proc.stderr


def test_a_start_up_signal_that_is_not_a_preemption_signal_keeps_its_default_action():
    proc = _run("none")
    assert proc.returncode == -signal.SIGUSR1  # delivered again, and fatal as without finetune
    assert "received" not in proc.stdout


def test_other_commands_do_not_swallow_sigterm(tmp_path):
    # `python -m finetune verify` installs the early handlers too, then gives them back.
    code = (
        "import os, signal, sys; from finetune.preemption import catch_early; catch_early(); "
        "from finetune.cli import main; sys.argv = ['finetune', 'verify', sys.argv[1]]; "
        "os.kill(os.getpid(), signal.SIGTERM); main()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGTERM, proc.stderr
