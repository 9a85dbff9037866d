"""Bounded waits (raylm.workers.watchdog): a worker stuck past its bound names itself and what
it waited for, and ends, so that Ray Train restarts the group."""

from __future__ import annotations

import subprocess
import sys
import time

from raylm.workers.watchdog import STALLED, bounded

STUCK = """
import time
from raylm.workers.watchdog import bounded
with bounded("checkpoint s3://bucket/run/checkpoint_7 to be read", timeout_s=0.5, rank=3,
             setting="checkpoint.timeout_s"):
    time.sleep(60)  # a read that never returns
print("not reached")
"""


def test_a_stuck_read_ends_the_worker_naming_the_rank_and_the_wait():
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", STUCK], capture_output=True, text=True,
                          timeout=30)
    assert time.monotonic() - t0 < 20
    assert done.returncode == STALLED and "not reached" not in done.stdout
    assert ("raylm: rank 3 waited 1s for checkpoint s3://bucket/run/checkpoint_7 to be read "
            "(checkpoint.timeout_s=0.5); ending this worker so that the group restarts"
            ) in done.stderr


def test_a_wait_within_its_bound_or_unbounded_goes_on():
    said = []
    with bounded("a quick read", timeout_s=5, rank=0, setting="x", on_expiry=said.append):
        time.sleep(0.05)
    with bounded("anything", timeout_s=0, rank=0, setting="x", on_expiry=said.append):
        time.sleep(0.05)
    time.sleep(0.1)
    assert said == []
    with bounded("a slow read", timeout_s=0.05, rank=1, setting="x", on_expiry=said.append):
        time.sleep(0.3)
    assert said and "rank 1 waited 0s for a slow read (x=0.05)" in said[0]
