"""Whether saves come faster than they are written (--async_save).

A background save is written while training goes on; the next save waits for it first (at most one
save is in flight). When a save keeps arriving before the previous one is written, training stalls
at every save for the difference, which no figure showed: ``Cadence`` measures it at each save, and
the run says so once, with the numbers and what to change, then an event at each save that
waited.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

# A wait shorter than this is the commit's own collectives, not a writer falling behind.
BEHIND_S = 0.5


@dataclass
class Behind:
    """A save that waited for the previous one's writes: ``waited`` s, that save's writes having
    taken ``writer_s`` since it started, ``interval_s`` (``steps`` steps) before this one."""

    step: int
    previous: int
    waited: float
    writer_s: float
    interval_s: float
    steps: int

    def save_steps(self) -> int:
        """The --save_steps at which the writer keeps up, at this run's seconds per step."""
        per_step = self.interval_s / self.steps
        return max(self.steps + 1, math.ceil(self.writer_s / per_step))

    def message(self) -> str:
        return (
            f"saves come faster than they are written: the save of step {self.step} waited "
            f"{self.waited:.1f} s for step {self.previous}'s writes, which took "
            f"{self.writer_s:.1f} s while saves come every {self.interval_s:.1f} s "
            f"({self.steps} steps). Training stalls at each save until the writer catches up: "
            f"raise --save_steps to {self.save_steps()} or more, or write to a faster disk"
        )

    def event(self) -> dict:
        """What the ``save_behind`` event records."""
        return {
            "waited_s": round(self.waited, 3),
            "previous_step": self.previous,
            "writer_s": round(self.writer_s, 3),
            "interval_s": round(self.interval_s, 3),
        }


class Cadence:
    """The start of each save and whether it had to wait for the one before it."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.last: tuple[int, float] | None = None  # (step, when its save started)
        self.said = False

    def started(self, step: int, since: float, in_flight: bool) -> Behind | None:
        """A save of ``step`` began at ``since`` and, when ``in_flight``, waited until now for the
        previous save's writes: the ``Behind`` when that wait was long enough to matter."""
        last, self.last = self.last, (step, since)
        waited = self.clock() - since
        if not in_flight or last is None or waited < BEHIND_S:
            return None
        previous, began = last
        interval = since - began
        return Behind(step, previous, waited, interval + waited, interval, step - previous)

    def first(self) -> bool:
        """True once: whether the message is still to be said."""
        first, self.said = not self.said, True
        return first
