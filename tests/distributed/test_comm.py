"""What FSDP2 moves per step over 2 gloo ranks, read from the profiler as `python -m raylm.bench
comm` reads it, and what parallel.reduce_dtype and parallel.prefetch change: bf16 halves the
reduce-scatter's bytes and moves the losses by a bounded amount; prefetching moves no number."""

from __future__ import annotations

import torch

from tests.distributed.shared import worker
from tests.ranks import free_port, run_ranks

SPEC = {"preset": "tiny", "vocab": 300, "seq_len": 32, "global_batch": 4, "micro_batch": 2,
        "warmup": 10, "steps": 2, "lr": 1e-3, "device": "cpu", "precision": "fp32"}
SETTINGS = {"default": {}, "bf16": {"reduce_dtype": "bf16"}, "prefetch": {"prefetch": 1}}


def run(world: int, rank: int, out: dict, pretrained: str) -> None:
    from raylm.bench.comm import train_and_profile

    for name, plan in SETTINGS.items():
        out[name] = train_and_profile(rank, world, {**SPEC, "plan": plan})


def test_reduce_dtype_halves_the_reduce_scatter_and_bounds_the_loss_difference(tmp_path):
    path = str(tmp_path / "out.pt")
    run_ranks(worker, args=(2, free_port(), path, "", run), world=2)
    out = torch.load(path)
    default, bf16, prefetch = (out[k] for k in SETTINGS)
    # The tiny preset's parameters in fp32: every one gathered once in forward and once in
    # backward (the last block's and the root's kept from forward), every gradient reduced.
    assert default["reduce_scatter_bytes"] > 0 and default["all_gather_bytes"] > 0
    assert bf16["reduce_scatter_bytes"] == default["reduce_scatter_bytes"] / 2
    assert bf16["all_gather_bytes"] == default["all_gather_bytes"]
    assert default["all_reduces"] >= 1  # the gradient norm
    for r in out.values():
        assert r["collective_s"] > 0 and 0 <= r["overlapped_share"] <= 1
        assert 0 <= r["exposed_s"] <= r["collective_s"]
    # 12 steps on four batches in turn: the loss falls, and gradients rounded to bf16 before
    # the sum move it by little, but by something.
    losses, rounded = default["losses"], bf16["losses"]
    assert losses[-1] < losses[0] - 0.1
    differences = [abs(a - b) for a, b in zip(losses, rounded, strict=True)]
    assert 0 < max(differences) < 5e-4, differences
    # Prefetching changes when weights are gathered, never what is computed.
    assert prefetch["losses"] == losses
    assert prefetch["all_gather_bytes"] == default["all_gather_bytes"]
