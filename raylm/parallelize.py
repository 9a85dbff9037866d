"""Apply parallelism to a model that knows nothing of it: activation checkpointing, then
torch.compile, then FSDP2 ``fully_shard`` per decoder block and at the root.

Sharding happens on the meta device, before any weight exists, so no process ever holds the full
model; :func:`raylm.model.init_weights` then fills each rank's shards. Per-block sharding lets
FSDP gather one block's parameters at a time (peak memory = shards + one block), and overlap the
next block's all-gather with the current block's compute.

Precision (``train.precision``):

    fp32        parameters, compute, gradients and reduction in fp32
    bf16-mixed  fp32 master parameters; FSDP casts to bf16 for compute (MixedPrecisionPolicy
                param_dtype=bf16) and reduces gradients in fp32; bf16 autocast for the rest
    bf16-true   parameters, compute and gradients in bf16 (least memory, least precise)

``auto`` is bf16-mixed on CUDA devices with bf16 support, fp32 elsewhere: on CPUs without native
bf16 (AVX2 only) bf16 autocast made a 7.4M-parameter Llama step 33x slower than fp32 (83 vs
2,739 tokens/s, measured on this project's 2-core machines).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """How :func:`parallelize` lays a model out, beyond data-parallel sharding (which follows
    from the world size). Tensor and pipeline degrees belong here when they come."""

    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in backward."""
    compile: bool = False
    """torch.compile each decoder block."""


DATA_PARALLEL = ParallelPlan()
"""FSDP2 over every rank and nothing else."""


def resolve_precision(precision: str, device_type: str) -> str:
    if precision != "auto":
        if precision.startswith("bf16") and device_type == "cuda" and not (
                torch.cuda.is_bf16_supported()):
            raise ValueError(f"train.precision={precision} but this GPU has no bf16 support; "
                             f"use fp32.")
        return precision
    if device_type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "fp32"


def autocast(precision: str, device_type: str):
    """The autocast context for forward passes under ``precision``."""
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated decoder layers of a transformers causal LM."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers; raylm shards Llama-style "
                         f"decoder stacks (Llama, Mistral, Qwen2, ...).")
    return layers


def build_mesh(device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def parallelize(model: nn.Module, *, device_type: str, precision: str,
                plan: ParallelPlan = DATA_PARALLEL) -> nn.Module:
    """Checkpoint, compile and shard ``model`` in place as ``plan`` says (sharding only when
    torch.distributed is initialized with more than one rank); returns it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    # An NF4 base arrives in bf16 already, and ``.to(dtype)`` would dequantize it.
    if precision == "bf16-true" and any(p.dtype != torch.bfloat16 for p in model.parameters()):
        model.to(torch.bfloat16)
    blocks = decoder_blocks(model)
    for i, block in enumerate(blocks):
        if plan.activation_checkpointing:
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if plan.compile:
            block.compile()
        blocks[i] = block
    if not dist.is_initialized() or dist.get_world_size() == 1:
        # One worker has nothing to shard with; FSDP's gather/scatter copies would cost ~5% of
        # a step for nothing (measured on the tiny preset, CPU). DCP checkpoints of the plain
        # model still reshard onto any later world size.
        return model
    return shard(model, mesh=build_mesh(device_type), precision=precision)


def shard(model: nn.Module, *, mesh, precision: str) -> nn.Module:
    """FSDP2 ``fully_shard`` per decoder block and at the root over ``mesh``, with the mixed
    precision policy of ``precision``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if precision == "bf16-mixed":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    blocks = decoder_blocks(model)
    n = len(blocks)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < n - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
