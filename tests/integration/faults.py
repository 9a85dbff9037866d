"""Interfering with a run from outside, as a failing machine or a scheduler would."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path


def train_workers():
    """The live Ray Train worker processes of the (one) run in progress."""
    import psutil

    return [p for p in psutil.process_iter(["cmdline"])
            if any("ray::RayTrainWorker" in part for part in (p.info["cmdline"] or []))]


def run_and_interfere(run: Callable[[], dict], run_dir: Path, *,
                      acts: list[tuple[int, Callable[[], None]]],
                      timeout: float = 240.0) -> dict:
    """Call ``run()`` (a training run writing to ``run_dir``) in a thread and interfere with it
    once per ``(step, act)`` of ``acts``, in order: the k-th ``act()`` comes once the run has a
    verified checkpoint at ``step`` or later and the controller has heard of its k-th worker
    group (reports reach it at its next poll), so each act after the first hits the group
    that the previous one made the run start. Returns the run's summary."""
    from raylm import checkpoint, record

    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(summary=run()), daemon=True)
    thread.start()
    deadline = time.time() + timeout
    for k, (when_step, act) in enumerate(acts):
        while time.time() < deadline:
            found = checkpoint.latest_verified(run_dir, warn=lambda m: None)
            groups = [e for e in record.read(str(run_dir)) if e["event"] == "group_start"]
            if found and found[1]["state"]["step"] >= when_step and len(groups) > k:
                act()
                break
            time.sleep(0.02)
        else:
            raise AssertionError(f"no checkpoint at step {when_step} of worker group {k + 1} "
                                 f"within {timeout}s")
    thread.join(timeout)
    assert "summary" in out, "the run did not finish"
    return out["summary"]


def kill_a_worker() -> int:
    """SIGKILL one training worker, as a lost process; its pid."""
    import signal

    victim = train_workers()[0]
    victim.send_signal(signal.SIGKILL)
    return victim.pid
