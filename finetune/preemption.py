"""Preemption: a signal asks for a committed checkpoint at the next optimizer-step boundary.

A handler on every rank only records the signal (nothing else is safe inside a handler, and a
rank may be inside a collective when it arrives). At each step boundary every rank calls
``requested()``, one all-reduce: if *any* rank saw a signal, all of them save the same step
together and stop with ``EXIT_PREEMPTED``, which job scripts read as "requeue me". So it is
enough for the signal to reach one rank (a launcher that signals only its own node, SLURM's
``--signal``, ``kill`` on one pid). Further signals are recorded and ignored: the save in flight
finishes and commits.
"""

from __future__ import annotations

import os
import signal

from finetune import distributed as dist
from finetune.exit_status import EXIT_PREEMPTED
DEFAULT_SIGNALS = "SIGTERM,SIGUSR1"


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """``"SIGTERM,USR1"`` → signals; ``"none"`` or ``""`` → (). Raises ValueError naming a bad one."""
    if text.strip().lower() in ("", "none"):
        return ()
    out = []
    for name in (n.strip().upper() for n in text.split(",")):
        full = name if name.startswith("SIG") else f"SIG{name}"
        if full in ("SIGKILL", "SIGSTOP") or not hasattr(signal.Signals, full):
            raise ValueError(name)
        out.append(signal.Signals[full])
    return tuple(out)


class Preemption:
    """Records signals; ``requested()`` turns one rank's signal into every rank's decision."""

    def __init__(self, signals: tuple[signal.Signals, ...]):
        self.signals = signals
        self.received: list[str] = []
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        self.received.append(name)
        # os.write, not logging: a handler may interrupt logging itself (its lock is not reentrant).
        if len(self.received) == 1:
            msg = f"[finetune] [rank{dist.env_rank()}] {name} received: saving a checkpoint at the next step boundary, then exiting with code {EXIT_PREEMPTED}\n"
        else:
            msg = f"[finetune] [rank{dist.env_rank()}] {name} received again: the save in progress goes on\n"
        try:
            os.write(2, msg.encode())
        except OSError:
            pass

    @property
    def enabled(self) -> bool:
        return bool(self.signals)

    def requested(self) -> bool:
        """Collective (when enabled): True on every rank iff any rank has received a signal."""
        if not self.enabled:
            return False
        return dist.all_reduce_sum([1.0 if self.received else 0.0])[0] > 0

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
