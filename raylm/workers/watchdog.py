"""Bounds on the waits of one worker that can hold a whole run.

Collectives are bounded by the process group's timeout (``train.collective_timeout_s``, set as
the group forms: :mod:`raylm.run.group`): a rank that does not join an all-reduce or a barrier
makes it fail on the others, naming the operation, and Ray Train restarts the group. What a
process group cannot bound is the rank that does not arrive because it is stuck in a read: a
restore from a storage mount that stopped answering, a checkpoint's write that never finishes.
The others then wait in their next collective until its timeout, and the error they raise names
the collective, not the rank or what it was doing.

:func:`bounded` puts a limit on such a wait. When it expires, the worker says which rank waited
how long for what, and ends its own process: a thread blocked in a read cannot be interrupted
from Python, and ending the process is what makes Ray Train see the group fail at once and
restart it (``train.max_failures`` applies). Written by hand: neither torch nor Ray Train
bounds a worker's own file or object-storage reads.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# The exit status of a worker that ended itself after a wait ran past its bound.
STALLED = 75


def _end_process(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(STALLED)


@contextmanager
def bounded(what: str, *, timeout_s: float, rank: int, setting: str,
            on_expiry: Callable[[str], None] = _end_process) -> Iterator[None]:
    """Run the block; if it takes longer than ``timeout_s``, call ``on_expiry`` with a line
    naming ``rank``, the wait and ``setting`` (by default: print it and end this process).
    ``timeout_s <= 0``: no bound."""
    if timeout_s <= 0:
        yield
        return
    started = time.monotonic()

    def expire() -> None:
        on_expiry(f"raylm: rank {rank} waited {time.monotonic() - started:.0f}s for {what} "
                  f"({setting}={timeout_s:g}); ending this worker so that the group restarts")

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
