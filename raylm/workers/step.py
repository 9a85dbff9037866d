"""The optimizer step and the train state a checkpoint keeps beside the weights.

Needs only torch (no Ray, no MLflow): it runs in one process, under torchrun, inside Ray Train's
workers (:mod:`raylm.workers.loop` drives it there) and on GPU machines that have nothing else.
``train_step`` takes micro-batches of a :class:`raylm.model.assemble.Built` model and returns
(loss, grad norm): the one seam a loss mask, adapters or a pipeline schedule plug into. The
model, its loss and its evaluation are :mod:`raylm.model.assemble`'s.

The loop asks a run's objective (:class:`NextToken` here, ``Preference`` for DPO) for its step,
validation figures and FLOPs per token: another objective is another class, not loop branches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from raylm.model.assemble import (
    Built,
    batch_loss,
    evaluate,
    plain,
    run_pipeline,
    sequence_shards,
    shared_loss,
    token_loss,
    trained_targets,
)
from raylm.model.parallelize import loss_context
from raylm.workers.metrics import flops_per_token

if TYPE_CHECKING:
    from raylm.workers.health import Health


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
    skipped: list[list[int]] | None = None
    """The position ranges left out of the order when this was saved
    (:class:`raylm.data.packing.Skips`)."""
    clock: dict[str, Any] | None = None
    """The saving group's report clock at this step (:meth:`raylm.workers.loop.StepMeter.clock`,
    with the group's start time): the goodput account counts the steps up to a checkpoint the
    controller saw no report of."""

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
        self.clock = state.get("clock")
        self.skipped = state.get("skipped")


def clip_grad_norm(model: nn.Module, max_norm: float, *, pp_group=None) -> torch.Tensor:
    """Global gradient norm over all shards (clipped when ``max_norm`` > 0); with ``pp_group``,
    over every pipeline stage's parameters."""
    params = [p for p in model.parameters() if p.grad is not None]
    limit = max_norm if max_norm > 0 else float("inf")
    if pp_group is None:
        norm = torch.nn.utils.clip_grad_norm_(params, limit)
        # Under FSDP the norm is a DTensor reduced over every shard; make it a plain tensor.
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    # Each stage holds other parameters: the squared norms add up over the pipeline.
    norm = plain(torch.nn.utils.get_total_norm([p.grad for p in params]))
    squared = norm.double() ** 2
    dist.all_reduce(squared, group=pp_group)
    norm = squared.sqrt().to(norm.dtype)
    torch.nn.utils.clip_grads_with_norm_(params, limit, norm)
    return norm


def apply_update(optimizer: torch.optim.Optimizer, fault: torch.Tensor | None) -> None:
    """``optimizer.step()`` unless ``fault`` (a 0-d device flag from
    :meth:`raylm.workers.health.Health.check`) is set, then clear the gradients. A fused AdamW
    takes the flag as its ``found_inf`` and skips on the device; any other optimizer reads it
    (on CPUs, where raylm uses the foreach AdamW, that waits for nothing)."""
    if fault is None:
        optimizer.step()
    elif all(group.get("fused") for group in optimizer.param_groups):
        optimizer.found_inf = fault
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif not fault.item():
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step(built: Built, optimizer: torch.optim.Optimizer,
               micro_batches: Iterable[dict[str, torch.Tensor]], *, accumulation: int,
               grad_clip: float, cross_document: bool = True, health: Health | None = None
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
    group count the same targets, so world / count is dp / (the dp ranks' targets).

    With ``health``, a step whose loss or norm fails its check does not reach the weights
    (:mod:`raylm.workers.health`)."""
    micro_batches = list(micro_batches)
    if len(micro_batches) != accumulation:
        raise RuntimeError(f"expected {accumulation} micro-batches, got {len(micro_batches)}")
    if built.pipeline is not None:
        return pipeline_step(built, optimizer, micro_batches, grad_clip=grad_clip,
                             cross_document=cross_document, health=health)
    micro_batches = sequence_shards(built, micro_batches, cross_document=cross_document)
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
    apply_update(optimizer, health.check(mean, norm) if health is not None else None)
    return mean.detach(), norm.detach()


def pipeline_step(built: Built, optimizer: torch.optim.Optimizer,
                  micro_batches: list[dict[str, torch.Tensor]], *, grad_clip: float,
                  cross_document: bool, health: Health | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`train_step` under pipeline parallelism: the micro-batches go through the schedule
    in one call, the last stage computes each one's loss scaled as :func:`train_step` scales
    it, and the loss is then shared with every stage (ranks report alike)."""
    masked = "loss_mask" in micro_batches[0]
    count = trained_targets(micro_batches, built.device).float() if masked else None
    world = dist.get_world_size()
    n = len(micro_batches)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = token_loss(logits, targets, summed=masked)
        return loss * world / count if masked else loss / n

    scaled = run_pipeline(built, micro_batches, loss_fn=loss_fn, train=True,
                          cross_document=cross_document)
    # Scaled so, the last stage's losses add up (over micro-batches and data-parallel ranks,
    # tp times over a tensor-parallel group) to world / pp times the global mean.
    mean = shared_loss(built, scaled, float(world))
    norm = clip_grad_norm(built.model, grad_clip, pp_group=built.model.pp_group)
    apply_update(optimizer, health.check(mean, norm) if health is not None else None)
    return mean.detach(), norm.detach()


class Objective:
    """What the loop trains toward (:class:`NextToken`, DPO's
    :class:`raylm.workers.preference.Preference`, GRPO's :class:`raylm.workers.grpo.Reinforce`):
    each gives ``step``, ``evaluate`` and ``flops``; ``begin`` and ``saved`` are for an
    objective with parts beside the trainers (GRPO's generators), and do nothing by default.
    The driver's side of the same objective is :mod:`raylm.run.objectives`'."""

    checks_first_prediction = False
    """Whether the loop checks the first batch's predictions (that pretrained weights loaded)."""
    tokens: int | None = None
    """Tokens the last step trained, every rank's, when the objective counts them (GRPO's rows
    of prompt and completion); None: the loop's count of the step's blocks."""
    spent: dict[str, float] | None = None
    """Seconds, since the group started, of the objective's own goodput causes
    (:class:`raylm.workers.loop.StepMeter`)."""

    def step(self, built: Built, optimizer: torch.optim.Optimizer, micro, *, accumulation: int,
             grad_clip: float, health: Health | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """One optimizer step over the micro-batches ``micro``: (loss, gradient norm, the
        objective's own figures by report key), on the device."""
        raise NotImplementedError

    def evaluate(self, built: Built, batches) -> dict[str, float]:
        """The validation figures of ``batches`` by report key (every rank alike)."""
        raise NotImplementedError

    def flops(self, config, seq_len: int) -> float:
        """Model FLOPs per trained token (MFU's numerator)."""
        raise NotImplementedError

    def begin(self, built: Built, *, step: int, batches: Iterator[dict[str, torch.Tensor]],
              accumulation: int, resumed: str | None) -> Iterator[dict[str, torch.Tensor]]:
        """At the group's start, from ``step`` (the checkpoint ``resumed``, if any): returns
        the training stream to draw from."""
        return batches

    def saved(self) -> dict[str, bytes]:
        """The files a checkpoint keeps of the objective's own state, by name (rank 0)."""
        return {}


class NextToken(Objective):
    """Next-token cross-entropy over the trained targets (every target in pretraining)."""

    checks_first_prediction = True  # that pretrained weights loaded, on the first batch

    def __init__(self, *, cross_document: bool) -> None:
        self.cross_document = cross_document

    def step(self, built: Built, optimizer: torch.optim.Optimizer, micro, *, accumulation: int,
             grad_clip: float, health: Health | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, gradient norm, the objective's own figures by report key) on the device."""
        return (*train_step(built, optimizer, micro, accumulation=accumulation,
                            grad_clip=grad_clip, cross_document=self.cross_document,
                            health=health), {})

    def evaluate(self, built: Built, batches) -> dict[str, float]:
        val = evaluate(built, batches, cross_document=self.cross_document)
        return {"val_loss": val, "val_perplexity": float(np.exp(val))}

    def flops(self, config, seq_len: int) -> float:
        """Model FLOPs per trained token."""
        return flops_per_token(config, seq_len)
