"""Progress of the agreed step this thread works for, so a deadline can tell a hung filesystem
from a slow one.

``distributed.gather_outcomes`` runs rank-local work (a verification, a deletion, a background
write) with a deadline counted from the work's last sign of life. Long loops call ``progress()``
once per piece (a chunk hashed, a file deleted); a syscall stuck in D-state never returns to call
it, so the deadline trips. A leaf module: the I/O helpers that report progress import nothing else.
"""

from __future__ import annotations

import threading
import time


class _Current(threading.local):
    step: dict | None = None  # {"last": monotonic time of the last progress} of the agreed step


_current = _Current()


def progress() -> None:
    """This thread's agreed work is still moving (a no-op outside agreed work)."""
    step = _current.step
    if step is not None:
        step["last"] = time.monotonic()


def watch(step: dict | None) -> None:
    """From now on this thread's ``progress()`` calls go to ``step`` (None: nowhere)."""
    _current.step = step


def carry(fn):
    """``fn``, reporting its progress to this thread's agreed step from whichever thread runs it
    (a pool's worker): a deadline sees work done on helper threads as progress."""
    step = _current.step

    def run(*args, **kwargs):
        before = _current.step  # the running thread's own (the caller's, when it runs there)
        watch(step)
        try:
            return fn(*args, **kwargs)
        finally:
            watch(before)

    return run
