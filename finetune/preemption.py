"""Preemption: a signal asks for a committed checkpoint at the next optimizer-step boundary.

A handler on every rank only records the signal (nothing else is safe inside a handler, and a
rank may be inside a collective when it arrives). At each step boundary the trainer's one
all-reduce carries whether this rank has ``received`` one: if *any* rank saw a signal, all of them
save the same step together and stop with ``EXIT_PREEMPTED``, which job scripts read as "requeue
me". So it is enough for the signal to reach one rank (a launcher that signals only its own node,
SLURM's ``--signal``, ``kill`` on one pid). Further signals are recorded and ignored: the save in
flight finishes and commits.
"""

from __future__ import annotations

import os
import signal
from types import FrameType

from finetune.exit_status import EXIT_PREEMPTED

# Signals that arrive while Python is still importing torch (seconds): recorded by catch_early(),
# then handed to Preemption, or re-raised if this run does not treat them as preemption.
_EARLY_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_early: list[int] = []


def _record_early(signum: int, frame: FrameType | None) -> None:
    _early.append(signum)


def catch_early() -> None:
    """First thing in ``python -m finetune``: a SLURM warning signal in the first seconds
    of start-up must become exit 75 (requeue), not death by SIGUSR1. Stdlib only: nothing
    heavy is imported yet."""
    for sig in _EARLY_SIGNALS:
        signal.signal(sig, _record_early)


def release_early(keep: tuple[signal.Signals, ...] = ()) -> list[str]:
    """Give the early signals back their default action, except those in ``keep``; a signal that
    already arrived and is not kept is delivered again now (a SIGTERM still terminates). Returns
    the names of the kept signals that arrived."""
    for sig in _EARLY_SIGNALS:
        if sig not in keep and signal.getsignal(sig) is _record_early:
            signal.signal(sig, signal.SIG_DFL)
    arrived = [signal.Signals(n).name for n in _early if n in keep]
    for n in [n for n in _early if n not in keep]:
        signal.raise_signal(n)
    _early.clear()
    return arrived


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """``"SIGTERM,USR1"`` → signals; ``"none"`` or ``""`` → (). Raises ValueError
    naming a bad one."""
    if text.strip().lower() in ("", "none"):
        return ()
    out = []
    for name in (n.strip().upper() for n in text.split(",")):
        full = name if name.startswith("SIG") else f"SIG{name}"
        if full in ("SIGKILL", "SIGSTOP") or not hasattr(signal.Signals, full):
            raise ValueError(name)
        out.append(signal.Signals[full])
    return tuple(out)


class Preempted(Exception):
    """Start-up work that can take hours (a universal conversion) was stopped for a preemption
    signal, what it finished kept; raised alike on every rank: the run exits 75 (requeue). The
    build raises it for the resume's own ``ConversionStopped``."""


class Preemption:
    """Records signals; the trainer's step-boundary all-reduce turns one rank's into
    every rank's decision."""

    def __init__(self, signals: tuple[signal.Signals, ...]):
        self.signals = signals
        self.received: list[str] = []
        for sig in signals:
            signal.signal(sig, self._handle)
        self.received[:0] = release_early(keep=signals)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        from finetune import distributed as dist

        name = signal.Signals(signum).name
        self.received.append(name)
        # os.write, not logging: a handler may interrupt logging itself (its lock is not reentrant).
        if len(self.received) == 1:
            msg = (
                f"[finetune] [rank{dist.env_rank()}] {name} received: saving a checkpoint at the "
                f"next step boundary, then exiting with code {EXIT_PREEMPTED}\n"
            )
        else:
            msg = (
                f"[finetune] [rank{dist.env_rank()}] {name} received again: already stopping "
                "(a save in progress goes on)\n"
            )
        try:
            os.write(2, msg.encode())
        except OSError:
            pass

    @property
    def enabled(self) -> bool:
        return bool(self.signals)
