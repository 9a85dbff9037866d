"""The per-step core: build the model to train, one optimizer step, evaluation.

Needs only torch and transformers (no Ray, no MLflow): it runs in one process, under torchrun,
inside Ray Train's workers (:mod:`raylm.worker` drives it there) and on GPU machines that have
nothing else. ``train_step`` takes micro-batches and returns (loss, grad norm): the one seam a
loss mask, adapters or a pipeline schedule plug into.

Loss arithmetic: every block holds exactly ``seq_len`` targets (no padding), so each
micro-batch's mean cross-entropy divided by the accumulation steps, summed over micro-batches
and averaged over ranks by FSDP's gradient reduction, is exactly the mean over the global batch:
``global_batch = micro_batch x accumulation x workers`` sequences (16 x 256 = 4,096 targets per
optimizer step with the defaults).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from raylm.attention import AttentionChoice, choose_attention
from raylm.checkpoint import load_pretrained_weights
from raylm.lora import add_adapters, check_nf4_shapes, init_adapters, load_quantized_base
from raylm.model import build_config, build_meta_model, init_weights
from raylm.parallelize import (
    DATA_PARALLEL,
    ParallelPlan,
    autocast,
    loss_context,
    parallelize,
    resolve_precision,
)


@dataclass
class TrainState:
    """What a checkpoint needs besides model and optimizer to continue exactly."""

    step: int = 0
    """Optimizer steps done."""
    tokens_seen: int = 0
    """Target tokens trained on, all workers."""
    data_position: int = 0
    """Next position in the global sample order (= step x global batch)."""
    lr: float | None = None
    """Learning rate of the last step done: a resume under settings that move the schedule
    is noticed by it (checkpoints written before it existed have none)."""
    energy_j: float | None = None
    """Joules drawn by the run's GPUs so far, every worker group (None: not measured, on
    CPUs or without NVML)."""
    gpu_s: float | None = None
    """GPU-seconds so far: each group's wall time x its GPUs (None on CPUs)."""

    def advance(self, *, samples: int, tokens: int, lr: float | None = None) -> None:
        """One optimizer step over ``samples`` sequences holding ``tokens`` targets, at
        ``lr``."""
        self.step += 1
        self.tokens_seen += tokens
        self.data_position += samples
        self.lr = lr

    def add_usage(self, *, joules: float | None, gpu_seconds: float | None) -> None:
        """Count a report window's energy and GPU time into the run's totals."""
        if joules is not None:
            self.energy_j = (self.energy_j or 0.0) + joules
        if gpu_seconds is not None:
            self.gpu_s = (self.gpu_s or 0.0) + gpu_seconds

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.data_position = int(state["data_position"])
        self.lr = state.get("lr")
        self.energy_j = state.get("energy_j")
        self.gpu_s = state.get("gpu_s")


# Targets that carry no loss (cross_entropy's ignore_index).
IGNORE = -100


@dataclass
class Built:
    model: nn.Module
    attention: AttentionChoice
    precision: str
    device: torch.device
    config: object
    plan: ParallelPlan = DATA_PARALLEL


def build_training_model(*, preset: str | None, path: str | None, vocab_size: int, eos_id: int,
                         device: torch.device, precision: str = "auto", attention: str = "auto",
                         cross_document: bool = True, plan: ParallelPlan = DATA_PARALLEL,
                         seed: int = 0, lora: dict[str, Any] | None = None,
                         base_quantization: str = "none") -> Built:
    """Build on meta (with LoRA adapters when ``lora`` gives a rank: see :mod:`raylm.lora`),
    parallelize, materialize on ``device``, initialize (or load pretrained weights, read once
    on rank 0 and scattered). With ``base_quantization="nf4"`` (QLoRA) the adapted layers'
    base weights are NF4-quantized as they are loaded, before sharding."""
    precision = resolve_precision(precision, device.type)
    choice = choose_attention(device.type, requested=attention, cross_document=cross_document,
                              precision=precision)
    config = build_config(preset=preset, path=path, vocab_size=vocab_size, eos_id=eos_id,
                          attn_implementation=choice.implementation)
    model = build_meta_model(config)
    adapters = bool(lora and lora.get("rank"))
    if adapters:
        model = add_adapters(model, **lora)
    if base_quantization == "nf4":
        if not (adapters and path):
            raise ValueError("an NF4 base needs LoRA adapters and a pretrained model.path")
        check_nf4_shapes(model, lora["target_modules"],
                         dist.get_world_size() if dist.is_initialized() else 1)
        if precision == "bf16-true":
            model.to(torch.bfloat16)  # quantized from bf16, as it would be parallelized
        load_quantized_base(model, path, device)
        parallelize(model, device_type=device.type, precision=precision, plan=plan)
    else:
        parallelize(model, device_type=device.type, precision=precision, plan=plan)
        model.to_empty(device=device)
        if path:
            load_pretrained_weights(model, path)
        else:
            init_weights(model, seed=seed, num_layers=config.num_hidden_layers)
    if adapters:
        init_adapters(model, seed=seed)
    model.train()
    return Built(model, choice, precision, device, config, plan)


def batch_loss(built: Built, batch: dict[str, torch.Tensor], *, cross_document: bool
               ) -> torch.Tensor:
    """Next-token cross-entropy of a batch of packed blocks (fp32 loss): the mean over every
    target, or, for blocks with a ``loss_mask``, the sum over the trained targets (the caller
    divides by the trained targets of the whole global batch). Under tensor parallelism it is
    a replicated DTensor, and it and its backward must run in ``loss_context(built.plan)``."""
    tokens = batch["input_ids"].to(built.device, non_blocking=True)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    kwargs = {}
    if not cross_document:
        kwargs["position_ids"] = batch["position_ids"][:, :-1].to(built.device,
                                                                   non_blocking=True)
    with built.attention.context(), autocast(built.precision, built.device.type):
        logits = built.model(input_ids=inputs, **kwargs).logits
    logits = logits.float().reshape(-1, logits.size(-1))
    if "loss_mask" not in batch:
        return F.cross_entropy(logits, targets.reshape(-1))
    trained = batch["loss_mask"][:, 1:].to(built.device, non_blocking=True).bool()
    targets = targets.masked_fill(~trained, IGNORE)
    return F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE, reduction="sum")


def trained_targets(batches: Iterable[dict[str, torch.Tensor]], device: torch.device
                    ) -> torch.Tensor:
    """Targets that carry loss in ``batches``, summed over every rank (all call it)."""
    # Counted on the host (the masks are host tensors) and written by a fill kernel: a copy
    # from pageable host memory may wait for the GPU's queue to drain.
    local = sum(int(b["loss_mask"][:, 1:].sum()) for b in batches)
    n = torch.full((), local, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(n)
    return n


def plain(value: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss under tensor parallelism) as the tensor it holds."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm over all shards (clipped when ``max_norm`` > 0)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    # Under FSDP the norm is a DTensor reduced over every shard; make it a plain tensor.
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def train_step(built: Built, optimizer: torch.optim.Optimizer,
               micro_batches: Iterable[dict[str, torch.Tensor]], *, accumulation: int,
               grad_clip: float, cross_document: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over ``accumulation`` micro-batches; returns (loss averaged over the
    global batch, global gradient norm before clipping) as 0-d tensors on the device.

    Nothing here waits for the device: a Python float of the loss at every step would stop the
    host until the GPU has finished the step, and the next step's kernels would only start
    queueing then. Callers convert when they report.

    Blocks with a loss mask are averaged over the trained targets of the whole global batch,
    not per micro-batch: micro-batches hold different numbers of trained targets, and a mean of
    per-micro-batch means would weigh a target by how crowded its micro-batch is, so the update
    would change with the accumulation and the worker count. FSDP2 averages gradients over the
    data-parallel ranks, hence the factor of the world size: the ranks of a tensor-parallel
    group count the same targets, so world / count is dp / (the dp ranks' targets)."""
    micro_batches = list(micro_batches)
    if len(micro_batches) != accumulation:
        raise RuntimeError(f"expected {accumulation} micro-batches, got {len(micro_batches)}")
    total = torch.zeros((), device=built.device)
    if "loss_mask" in micro_batches[0]:
        world = dist.get_world_size() if dist.is_initialized() else 1
        count = trained_targets(micro_batches, built.device).float()
        for batch in micro_batches:
            with loss_context(built.plan):
                loss_sum = batch_loss(built, batch, cross_document=cross_document)
                with built.attention.context():  # activation checkpointing recomputes here
                    (loss_sum * world / count).backward()
            total += plain(loss_sum.detach())
        if dist.is_initialized():
            dist.all_reduce(total)
        mean = total / count
    else:
        for batch in micro_batches:
            with loss_context(built.plan):
                loss = batch_loss(built, batch, cross_document=cross_document)
                with built.attention.context():
                    (loss / accumulation).backward()
            total += plain(loss.detach())
        mean = total / accumulation
        if dist.is_initialized():
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    norm = clip_grad_norm(built.model, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return mean.detach(), norm.detach()


@torch.no_grad()
def evaluate(built: Built, batches: Iterable[dict[str, torch.Tensor]], *,
             cross_document: bool = True) -> float:
    """Mean loss over ``batches`` (equal counts on every rank), averaged over ranks; over the
    trained targets for blocks with a loss mask."""
    built.model.eval()
    total = torch.zeros((), device=built.device)
    n = torch.zeros((), device=built.device)
    for batch in batches:
        with loss_context(built.plan):
            total += plain(batch_loss(built, batch, cross_document=cross_document))
        n += int(batch["loss_mask"][:, 1:].sum()) if "loss_mask" in batch else 1
    built.model.train()
    if dist.is_initialized():
        dist.all_reduce(total)
        dist.all_reduce(n)
    return float(total / n) if n > 0 else float("nan")
