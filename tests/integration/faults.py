"""Interfering with a run from outside, as a failing machine or a scheduler would."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from raylm import rundir


def train_workers():
    """The live Ray Train worker processes of the (one) run in progress."""
    import psutil

    return [p for p in psutil.process_iter(["cmdline"])
            if any("ray::RayTrainWorker" in part for part in (p.info["cmdline"] or []))]


def generator_processes():
    """The live generator actor processes of a reinforcement-learning run."""
    import psutil

    return [p for p in psutil.process_iter(["cmdline"])
            if any(part.startswith("ray::Generator") for part in (p.info["cmdline"] or []))]


def signal_all(processes, sig) -> None:
    """Send ``sig`` to each of ``processes`` that is still there."""
    import psutil

    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)


def hold_until(ready: Callable[[], bool], *, what: str, timeout: float = 240.0) -> list:
    """Hold the run's training workers, stopped 0.2 s in every 0.25 s, until ``ready()``
    (checked while they are stopped, so no save lands meanwhile) holds; returns them, stopped.
    Reports reach the record at the controller's polls, a second or more behind training when
    steps take tens of ms: held, a run cannot reach its next checkpoint before its record has
    caught up with the one before."""
    deadline = time.time() + timeout
    while True:
        assert time.time() < deadline, f"waited {timeout:.0f} s for {what}"
        workers = train_workers()
        signal_all(workers, signal.SIGSTOP)
        if ready():
            return workers
        time.sleep(0.2)
        signal_all(workers, signal.SIGCONT)
        time.sleep(0.05)


def checkpoint_step(run_dir: str | Path) -> int:
    """The step of the run's newest checkpoint with its marker (0 if none). The marker is
    written last, once every rank's files are: what a test waits for, read without hashing
    the checkpoint's files (``rundir.latest_verified`` does, 15 ms of CPU a call here, which a
    test polling it every 20 ms took from the run it watched)."""
    from raylm.contracts import CHECKPOINT_MARKER, Marker

    for path in rundir.candidates(run_dir):
        try:
            return Marker.from_json((Path(path) / CHECKPOINT_MARKER).read_text()).step
        except (OSError, ValueError):
            return 0
    return 0


def run_and_interfere(run: Callable[[], dict], run_dir: Path, *,
                      acts: list[tuple[int, Callable[[], None]]],
                      timeout: float = 240.0) -> dict:
    """Call ``run()`` (a training run writing to ``run_dir``) in a thread and interfere with it
    once per ``(step, act)`` of ``acts``, in order: the k-th ``act()`` comes once the run has a
    checkpoint at ``step`` or later and the controller has heard of its k-th worker
    group (reports reach it at its next poll), so each act after the first hits the group
    that the previous one made the run start. Returns the run's summary."""
    from raylm.contracts.events import GroupStart
    from raylm.run import record

    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(summary=run()), daemon=True)
    thread.start()
    deadline = time.time() + timeout
    for k, (when_step, act) in enumerate(acts):
        while time.time() < deadline:
            groups = [e for e in record.read(str(run_dir)) if isinstance(e, GroupStart)]
            if checkpoint_step(run_dir) >= when_step and len(groups) > k:
                act()
                break
            time.sleep(0.02)
        else:
            raise AssertionError(f"no checkpoint at step {when_step} of worker group {k + 1} "
                                 f"within {timeout}s")
    thread.join(timeout)
    assert "summary" in out, "the run did not finish"
    return out["summary"]


def kill_a_worker_during_an_async_save(*, before_step: int, timeout: float = 120.0
                                       ) -> tuple[int, int]:
    """SIGKILL a training worker while a checkpoint is being written in the background, before
    its step ``before_step``; returns (pid, the step of the save cut short).

    A save is in flight while every worker has its staging directory for that step and none
    holds the marker (rank 0 writes it there once every rank's shards are written, before the
    upload). Every worker is stopped (SIGSTOP) to look at that without a race; if it holds,
    one is killed and the others go on and find their peer gone, else they go on and the next
    save is awaited."""
    import signal
    import tempfile

    from raylm.contracts import CHECKPOINT_MARKER as MARKER

    deadline = time.time() + timeout
    workers, listed = [], 0.0
    while time.time() < deadline:
        # The processes are listed once a second (5 ms of CPU each time here), the staging
        # directories looked at every 2 ms.
        if not workers or time.time() - listed > 1:
            workers, listed = train_workers(), time.time()
        if not workers or not _save_in_flight(workers, before_step):
            time.sleep(0.002)
            continue
        for p in workers:
            p.send_signal(signal.SIGSTOP)
        step = _save_in_flight(workers, before_step)
        if step:
            workers[0].send_signal(signal.SIGKILL)
        for p in workers[1:] if step else workers:
            p.send_signal(signal.SIGCONT)
        if step:
            return workers[0].pid, step
    raise AssertionError(f"no asynchronous save in flight within {timeout}s "
                         f"(staging directories under {tempfile.gettempdir()}, {MARKER})")


def _save_in_flight(workers, before_step: int) -> int | None:
    """The step of a save every worker is staging and none has marked yet, if any."""
    import tempfile

    from raylm.contracts import CHECKPOINT_MARKER as MARKER

    # raylm-ckpt-<pid>-step<step>-<random>: (step, directory) of each process's saves.
    by_pid: dict[int, list[tuple[int, Path]]] = {}
    for d in Path(tempfile.gettempdir()).glob("raylm-ckpt-*-step*"):
        pid, step = d.name[len("raylm-ckpt-"):].split("-")[:2]
        by_pid.setdefault(int(pid), []).append((int(step[len("step"):]), d))
    saves = [by_pid.get(p.pid, []) for p in workers]
    if not all(len(s) == 1 for s in saves):
        return None
    steps = {s[0][0] for s in saves}
    if len(steps) != 1 or any((s[0][1] / MARKER).exists() for s in saves):
        return None
    step = steps.pop()
    return step if step < before_step else None


def reward_that_stalls_or_exits(prompt, completion, *, answer: str, **columns) -> float:
    """A reward function (``rl.reward``) that takes 0.6 s a completion on the rows answered
    "slow" and ends its process on those answered "exit", as a reward running generated code
    can."""
    if answer == "slow":
        time.sleep(0.6)
    if answer == "exit":
        os._exit(3)
    return 0.0
