"""Preemption: a worker told to stop (SIGTERM, as a reclaimed spot instance or an evicted pod
is) saves a checkpoint at the next step boundary before it goes.

Ray's worker processes answer SIGTERM by exiting at once, and Python lets only the main thread
install a signal handler, while Ray Train runs the training function in a thread of its
worker actor. So the handler is installed by a task sent to the worker's own actor, which
Ray runs on that main thread; it only records the request. The training loop asks at every
step boundary whether any rank got one (one all-reduce of a single integer), and if so every
rank saves and reports a checkpoint and then raises :class:`Preempted`: Ray Train counts a
worker-group failure and, within ``train.max_failures``, restarts from that checkpoint on
the workers that are left, which loses no step. A second SIGTERM while the first is pending
exits at once, as Ray would have.

Written by hand because Ray Train's own preemption support reacts to node drains reported
by Ray's autoscaler, not to a signal sent to a process.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist


class Preempted(RuntimeError):
    """Raised on every rank after the checkpoint a SIGTERM asked for is saved."""


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


def any_rank_requested(device: torch.device) -> bool:
    """Whether any rank was asked to stop: all ranks must call this at the same step."""
    flag = requested()
    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
