"""Preemption: a worker told to stop saves a checkpoint at the next step boundary before it
goes. It is told by SIGTERM (an evicted pod, a process manager) or by a node drain, which is
how Ray hears that a cloud reclaims a spot node or the autoscaler removes one.

Drains: Ray Train watches its workers' nodes (every 5 s, ``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S``)
and hands each worker a notice with the deadline, which raylm reads from the worker's Train
context at every step (not through ``ray.train.get_preemption_info()``, which broadcasts from
rank 0 on every call) and folds into the SIGTERM vote. Ray's guide suggests saving and
training on until the node goes; raylm stops at once instead: every step trained after the
save would be trained again (up to 2 minutes of work on a spot notice), and the group
restart it costs is paid anyway when the node goes.

SIGTERM: Ray's workers exit on it at once, and only the main thread may install a handler,
while Ray Train runs the training function in a thread: the handler is installed by a task
sent to the worker's own actor, which Ray runs on that main thread, and only records the
request (by hand: Ray Train's preemption support reacts to drains, not signals). At every step
boundary the ranks ask whether any got one (one all-reduce of three integers, :class:`Vote`);
if so every rank saves and reports a checkpoint, waits until the controller has taken it
(:func:`hand_over`) and raises :class:`Preempted`: Ray Train counts a group failure and,
within ``train.max_failures``, restarts from that checkpoint on the workers left, losing no
step. A second SIGTERM while the first is pending exits at once, as Ray would have.
"""

from __future__ import annotations

import queue
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

_requested: dict[str, float] = {}
_previous: list = []


def _on_sigterm(signum, frame) -> None:
    if "at" in _requested and _previous and callable(_previous[0]):
        _previous[0](signum, frame)  # asked twice: stop now
        return
    _requested.setdefault("at", time.time())


def _install() -> None:
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    if previous is not _on_sigterm:
        _previous[:] = [previous]


def _uninstall() -> None:
    if _previous and signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, _previous[0])


def install_in_ray_worker() -> None:
    """Install the SIGTERM handler on the main thread of this Ray Train worker; called from
    the training thread, it runs as a task of the worker's own actor."""
    import ray

    _requested.clear()
    try:
        execute = ray.get_runtime_context().current_actor.execute
    except AttributeError:  # a Ray whose worker actor has no `execute`: train on without
        print("warning: raylm cannot handle SIGTERM in this Ray version; a preempted worker "
              "loses the steps since the last checkpoint", flush=True)
        return
    ray.get(execute.remote(_install))


def uninstall_in_ray_worker() -> None:
    """Give SIGTERM back to Ray's handler (the worker process may be reused)."""
    import ray

    if _previous:
        ray.get(ray.get_runtime_context().current_actor.execute.remote(_uninstall))


def requested() -> bool:
    """Whether this process was asked to stop."""
    return "at" in _requested


def drain_notice() -> str | None:
    """This worker's node-drain notice from Ray Train, in words, or None (none yet, or not in
    a Ray Train worker of a Ray that gives one)."""
    try:
        from raylm.compat import get_train_context

        info = get_train_context().preemption_context.preemption_info
    except (ImportError, AttributeError, RuntimeError):
        return None
    if info is None:
        return None
    nodes = ", ".join(n[:12] for n in info.preempted_node_ids)
    if info.deadline_ms is None:
        return f"node {nodes} is draining (no deadline given)"
    left = info.deadline_ms / 1000 - time.time()
    return f"node {nodes} is draining ({left:.0f} s to its deadline)"


def report_queue() -> queue.Queue | None:
    """This Ray Train worker's queue of reports the controller has not taken yet (it holds
    one), or None outside a Ray Train worker."""
    try:
        from raylm.compat import get_train_context

        return get_train_context().get_result_queue()
    except (ImportError, AttributeError, RuntimeError):
        return None


def hand_over(timeout_s: float = 60.0) -> None:
    """Return once the controller has taken every report of every rank, so that the report of
    the preemption checkpoint reaches the run's record, MLflow and Ray Train's checkpoint list
    before the group stops.

    Ray Train's controller takes one report per worker per poll (raylm.run.launch sets how
    often) and joins them once every rank has delivered; a rank that raises before its last
    report was taken ends the group in that poll, and the other ranks' copy of the report is
    dropped with it. So each rank waits until its own report queue is empty, then all ranks
    meet: after the barrier every rank's last report has been taken, and the join happens in
    the poll that took the last one. Outside a Ray Train worker this is only the barrier."""
    reports = report_queue()
    deadline = time.monotonic() + timeout_s
    while reports is not None and reports.unfinished_tasks:
        if time.monotonic() > deadline:
            print(f"warning: the controller did not take this worker's last report within "
                  f"{timeout_s:.0f} s; the group stops without it (the checkpoint is saved)",
                  flush=True)
            break
        time.sleep(0.05)
    if dist.is_initialized():
        dist.barrier()


@dataclass(frozen=True)
class Verdict:
    """What every rank agrees on after a step (:class:`Vote`)."""

    cause: str | None
    """Why the group must stop now ("SIGTERM" or "node drain"), or None."""
    busy: bool
    """Some rank's last report may still wait for the controller (or its checkpoint for its
    upload): a report now would block that rank's loop until Ray Train's next poll."""


class Vote:
    """Every rank's flags, all-reduced at every step, so that all ranks act alike: the stop
    flags (SIGTERM, node drain), so that all ranks stop at the same step, and whether a report
    is still waiting (the loop's reports, :class:`raylm.workers.checkpoint.Checkpointer`, are
    sent only when no rank would wait for it); all ranks must call it at every step and
    :meth:`reported` after every report.

    On a GPU the result is read one step late. Reading an all-reduced flag back at once makes
    the host wait until the GPU has run everything queued before it (the whole step) before it
    can queue the next step, and the GPU then idles while the host prepares it. So each step's
    flags are all-reduced and copied to pinned host memory without waiting, and read at the
    next step: by then that copy, queued behind the previous step's kernels, is done or nearly.
    Every rank reads the same step's result, so all stop together, one step after the request;
    flags taken before the last report count as busy. On a CPU the result is read at once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pending: tuple[torch.Tensor, torch.cuda.Event, int] | None = None
        self.calls = 0
        self.reported_at = 0  # the call after which the last report was made

    def reported(self) -> None:
        """A report went out after the last call (its flags cannot say it was taken)."""
        self.reported_at = self.calls

    def __call__(self, *, busy: bool = False) -> Verdict:
        """The group's verdict; ``busy``: this rank's last report is not taken yet."""
        self.calls += 1
        # Set on the device by fill kernels: a copy from pageable host memory may wait for
        # the GPU's queue to drain, which is the wait this class exists to avoid.
        flags = torch.zeros(3, dtype=torch.int32, device=self.device)
        if requested():
            flags[0] = 1
        if drain_notice() is not None:
            flags[1] = 1
        if busy:
            flags[2] = 1
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if self.device.type != "cuda":
            return self._verdict(flags.tolist(), self.calls)
        host = flags.to("cpu", non_blocking=True)  # pinned: the copy does not block
        done = torch.cuda.Event()
        done.record()
        previous, self.pending = self.pending, (host, done, self.calls)
        if previous is None:
            return Verdict(cause=None, busy=True)
        previous[1].synchronize()
        return self._verdict(previous[0].tolist(), previous[2])

    def _verdict(self, flags: list[int], taken_at: int) -> Verdict:
        sigterm, drain, busy = (bool(v) for v in flags)
        return Verdict(cause="SIGTERM" if sigterm else "node drain" if drain else None,
                       busy=busy or taken_at <= self.reported_at)
