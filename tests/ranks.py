"""Gloo ranks for the distributed tests, forked from one server that imported the training
stack once.

A spawned rank is a fresh interpreter that imports torch, its distributed packages,
transformers' Llama code, peft and raylm's training modules before doing anything: about 9
CPU-s per rank on the 2-core CI machine, and the suite starts 16 ranks. multiprocessing's
forkserver imports them once, in a process that does nothing else (no tensor math, so no
thread pool is forked), and forks every rank from there; a rank then pays only for what its
test does. Each rank still runs its test's function from the start, so what a rank computes is
what a spawned rank computes: the recorded losses (tests/losses.json) are unchanged.

The server keeps the environment of the moment it starts (the first ``run_ranks`` call):
ranks get their rendezvous (MASTER_ADDR, MASTER_PORT) as arguments, not from the
environment.

Forking is only safe from a process with one thread, and pyarrow (raylm.storage imports its
filesystems) starts jemalloc's background purging thread when it loads. The server is started
with that thread switched off, and every rank checks that its server had one thread, so an
import that starts a thread fails here by name instead of as a rare heap corruption in a rank.
A rank that dies on a signal prints every thread's Python stack first (faulthandler).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import socket
from collections.abc import Callable

import torch.multiprocessing as mp

from raylm.console import quiet_torchao

# The server imports this module first: torchao's import-time warnings about its installation
# (it comes in with peft and transformers) are quieted there, as raylm quiets them in every
# process that builds a model.
quiet_torchao()

# What every rank imports; a module missing here is imported by the rank itself.
PRELOAD = [
    "tests.ranks",
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.tensor.parallel",
    "transformers.models.llama.modeling_llama",
    "peft",
    "raylm.workers.checkpoint",
    "raylm.workers.optim",
    "raylm.workers.step",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# jemalloc's run-time options as pyarrow's copy reads them.
ARROW_JEMALLOC = "JE_ARROW_MALLOC_CONF"


def _start_server() -> None:
    multiprocessing.set_forkserver_preload(PRELOAD)
    before = os.environ.get(ARROW_JEMALLOC)
    os.environ[ARROW_JEMALLOC] = "background_thread:false"
    try:
        # Does nothing once the server runs; the option reaches the server only, not Ray's
        # processes that later tests start from this one.
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ[ARROW_JEMALLOC]
        else:
            os.environ[ARROW_JEMALLOC] = before


def _rank(rank: int, fn: Callable, args: tuple) -> None:
    threads = os.listdir(f"/proc/{os.getppid()}/task")
    if len(threads) != 1:
        names = sorted(open(f"/proc/{os.getppid()}/task/{t}/comm").read().strip()
                       for t in threads)
        raise RuntimeError(f"the rank server has {len(threads)} threads ({', '.join(names)}): "
                           "a module in PRELOAD starts a thread; fork from it is unsafe")
    faulthandler.enable(all_threads=True)
    fn(rank, *args)


def run_ranks(fn: Callable, *, args: tuple, world: int) -> None:
    """``fn(rank, *args)`` on ``world`` processes; raises what a rank raised."""
    _start_server()
    mp.start_processes(_rank, args=(fn, args), nprocs=world, join=True,
                       start_method="forkserver")
