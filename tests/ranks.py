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
"""

from __future__ import annotations

import multiprocessing
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


def run_ranks(fn: Callable, *, args: tuple, world: int) -> None:
    """``fn(rank, *args)`` on ``world`` processes; raises what a rank raised."""
    # Takes effect when the server starts, so every call names the same list.
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=world, join=True, start_method="forkserver")
