"""The per-step core: build the model to train, one optimizer step, evaluation.

Needs only torch and transformers (no Ray, no MLflow): it runs in one process, under torchrun,
inside Ray Train's workers (:mod:`raylm.workers.loop` drives it there) and on GPU machines that have
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
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from raylm.model.attention import AttentionChoice, choose_attention, fit_to_model
from raylm.model.build import build_config, build_meta_model, init_weights, materialize
from raylm.model.head_loss import IGNORE, fusable, head_loss, use_loss_head
from raylm.model.lora import add_adapters, check_nf4_shapes, init_adapters, load_quantized_base
from raylm.model.parallelize import (
    DATA_PARALLEL,
    ParallelPlan,
    autocast,
    layout_of,
    loss_context,
    parallelize,
    resolve_precision,
    set_dtypes,
)
from raylm.model.pipeline import Pipeline, Stage
from raylm.model.weights import load_pretrained_weights

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




@dataclass
class Built:
    model: nn.Module
    attention: AttentionChoice
    precision: str
    device: torch.device
    config: object
    plan: ParallelPlan = DATA_PARALLEL
    pipeline: Pipeline | None = None
    """The schedules driving this rank's stage, under pipeline parallelism."""
    cross_document: bool = True
    """Whether the attention kernel was chosen for blocks whose documents see each other
    (False: a per-document kernel, which takes the position ids that restart at each
    document)."""
    fused_loss: bool = False
    """Whether the output head computes the loss in chunks (:mod:`raylm.model.head_loss`)."""


def build_training_model(*, preset: str | None, path: str | None, vocab_size: int, eos_id: int,
                         device: torch.device, precision: str = "auto", attention: str = "auto",
                         cross_document: bool = True, plan: ParallelPlan = DATA_PARALLEL,
                         seed: int = 0, lora: dict[str, Any] | None = None,
                         base_quantization: str = "none", pipeline_schedule: str = "1f1b",
                         fused_loss: bool = True) -> Built:
    """Build on meta (with LoRA adapters when ``lora`` gives a rank: see :mod:`raylm.model.lora`),
    cut to this rank's pipeline stage, parallelize, materialize on ``device``, initialize (or
    load pretrained weights, read once on rank 0 and scattered; under pipeline parallelism
    each rank reads its own stage's). With ``base_quantization="nf4"`` (QLoRA) the adapted
    layers' base weights are NF4-quantized as they are loaded, before sharding. With
    ``fused_loss`` the output head computes training losses in chunks of tokens where it can
    (not under pipeline parallelism: :mod:`raylm.model.head_loss`)."""
    precision = resolve_precision(precision, device.type)
    choice = choose_attention(device.type, requested=attention, cross_document=cross_document,
                              precision=precision)
    config = build_config(preset=preset, path=path, vocab_size=vocab_size, eos_id=eos_id,
                          attn_implementation=choice.implementation)
    choice = fit_to_model(choice, config, requested=attention, device_type=device.type)
    config._attn_implementation = choice.implementation
    model = build_meta_model(config)
    fused_loss = fused_loss and plan.pipeline == 1 and fusable(model)
    if fused_loss:
        use_loss_head(model)
    adapters = bool(lora and lora.get("rank"))
    if adapters:
        model = add_adapters(model, **lora)
    set_dtypes(model, precision)
    if plan.pipeline > 1:
        if not dist.is_initialized():
            raise ValueError(f"parallel.pipeline={plan.pipeline} needs that many ranks; this "
                             f"process runs alone")
        index = layout_of(dist.get_rank(), dist.get_world_size(), plan).pp_rank
        model = Stage(model, index=index, num_stages=plan.pipeline)
    if base_quantization == "nf4":
        if not (adapters and path):
            raise ValueError("an NF4 base needs LoRA adapters and a pretrained model.path")
        check_nf4_shapes(model, lora["target_modules"],
                         dist.get_world_size() if dist.is_initialized() else 1)
        if precision == "bf16-true":
            model.to(torch.bfloat16)  # quantized from bf16, as it would be parallelized
        load_quantized_base(model, path, device, own_stage=isinstance(model, Stage))
        parallelize(model, device_type=device.type, precision=precision, plan=plan)
    else:
        parallelize(model, device_type=device.type, precision=precision, plan=plan)
        materialize(model, device)
        if path:
            load_pretrained_weights(model, path, own_stage=isinstance(model, Stage))
        else:
            init_weights(model, seed=seed, num_layers=config.num_hidden_layers)
    if adapters:
        init_adapters(model, seed=seed)
    model.train()
    pipe = None
    if isinstance(model, Stage):
        pipe = Pipeline(model, group=model.pp_group, device=device, schedule=pipeline_schedule)
    return Built(model, choice, precision, device, config, plan, pipe, cross_document,
                 fused_loss)


def batch_loss(built: Built, batch: dict[str, torch.Tensor], *, cross_document: bool
               ) -> torch.Tensor:
    """Next-token cross-entropy of a batch of packed blocks (fp32 loss): the mean over every
    target, or, for blocks with a ``loss_mask``, the sum over the trained targets (the caller
    divides by the trained targets of the whole global batch). With the chunked head loss
    (``built.fused_loss``) the head computes it without whole logits (:mod:`raylm.model.
    head_loss`); with the plain head under tensor parallelism it is a replicated DTensor, and
    it and its backward must run in ``loss_context(built.plan)``."""
    tokens = batch["input_ids"].to(built.device, non_blocking=True)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    kwargs = {}
    if not cross_document:
        kwargs["position_ids"] = batch["position_ids"][:, :-1].to(built.device,
                                                                   non_blocking=True)
    masked = "loss_mask" in batch
    if masked:
        trained = batch["loss_mask"][:, 1:].to(built.device, non_blocking=True).bool()
        targets = targets.masked_fill(~trained, IGNORE)
    if built.fused_loss:
        with (built.attention.context(), autocast(built.precision, built.device.type),
              head_loss(targets, built.config) as pending):
            built.model(input_ids=inputs, **kwargs)
        return pending.loss if masked else pending.loss / targets.numel()
    with built.attention.context(), autocast(built.precision, built.device.type):
        logits = built.model(input_ids=inputs, **kwargs).logits
    return token_loss(logits, targets, summed=masked)


@torch.no_grad()
def logit_spread(built: Built, batch: dict[str, torch.Tensor], *, cross_document: bool
                 ) -> float:
    """The largest standard deviation of the logits over the vocabulary, at any position of
    ``batch``'s first sequence on any rank (every rank calls it): 0 for a model that predicts
    every token alike, whatever its input (a head or a final norm of zeros, head rows all
    equal), and clearly above 0 for any other, trained or randomly initialized (0.16 for a
    tiny random-weight Qwen3). One forward of the micro-batch as :func:`evaluate` runs it
    (the same shapes and mode, so compiled blocks compile nothing new for it)."""
    tokens = batch["input_ids"][:, :-1].to(built.device, non_blocking=True)
    kwargs = {}
    if not cross_document:
        kwargs["position_ids"] = batch["position_ids"][:, :-1].to(built.device,
                                                                   non_blocking=True)
    built.model.eval()
    with built.attention.context(), autocast(built.precision, built.device.type):
        logits = plain(built.model(input_ids=tokens, **kwargs).logits)[0]
    built.model.train()
    # fp32 a slice of positions at a time: a 150k vocabulary makes each position 0.6 MB.
    spread = torch.zeros((), device=built.device)
    for chunk in logits.split(256):
        spread = torch.maximum(spread, chunk.float().std(dim=-1).max())
    if dist.is_initialized():
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return float(spread)


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


def token_loss(logits: torch.Tensor, targets: torch.Tensor, *, summed: bool) -> torch.Tensor:
    """fp32 cross-entropy of ``logits`` against ``targets`` (``IGNORE`` where untrained): the
    sum over trained targets with ``summed``, else the mean over all."""
    logits = logits.float().reshape(-1, logits.size(-1))
    if summed:
        return F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE,
                               reduction="sum")
    return F.cross_entropy(logits, targets.reshape(-1))


def run_pipeline(built: Built, batches: list[dict[str, torch.Tensor]], *, loss_fn,
                 train: bool, cross_document: bool) -> list[torch.Tensor]:
    """``batches`` through the pipeline's schedule as its micro-batches; the losses
    ``loss_fn`` gave on the last stage (none elsewhere)."""
    tokens = torch.cat([b["input_ids"] for b in batches]).to(built.device, non_blocking=True)
    targets = tokens[:, 1:]
    if "loss_mask" in batches[0]:
        trained = torch.cat([b["loss_mask"][:, 1:] for b in batches]).to(built.device).bool()
        targets = targets.masked_fill(~trained, IGNORE)
    positions = None
    if not cross_document:
        positions = torch.cat([b["position_ids"][:, :-1] for b in batches]).to(built.device)
    with (loss_context(built.plan), built.attention.context(),
          autocast(built.precision, built.device.type)):
        losses = built.pipeline.run(tokens[:, :-1], targets,
                                    microbatches=equal_microbatches(batches),
                                    loss_fn=loss_fn, train=train, position_ids=positions)
    return [plain(x.detach()) for x in losses]


def equal_microbatches(batches: list[dict[str, torch.Tensor]]) -> int:
    """How many equal micro-batches a schedule splits ``batches`` into: one per batch, or
    fewer where validation batches end with a short one (training batches are equal)."""
    rows, n = sum(len(b["input_ids"]) for b in batches), len(batches)
    while rows % n:
        n -= 1
    return n


def shared_loss(built: Built, raw: list[torch.Tensor], denominator: torch.Tensor | float
                ) -> torch.Tensor:
    """The global mean of the losses ``raw`` the last stage computed, on every rank.

    ``denominator`` counts over every rank: the trained targets (``raw`` holds sums), ranks x
    micro-batches (``raw`` holds means), or ranks (``raw`` holds the step's scaled losses).
    Only the last stage's ranks add their losses to the sum (the others add zero) while every
    stage counts, hence the factor pp; the ranks of a tensor-parallel group add and count
    alike."""
    total = torch.stack(raw).sum() if raw else torch.zeros((), device=built.device)
    dist.all_reduce(total)
    # A count known on the host stays a Python number: a host tensor copied to the GPU at
    # every step could wait for its queue to drain.
    return total * built.plan.pipeline / denominator


@torch.no_grad()
def evaluate(built: Built, batches: Iterable[dict[str, torch.Tensor]], *,
             cross_document: bool = True) -> float:
    """Mean loss over ``batches`` (equal counts on every rank), averaged over ranks; over the
    trained targets for blocks with a loss mask."""
    built.model.eval()
    if built.pipeline is not None:
        return pipeline_evaluate(built, list(batches), cross_document=cross_document)
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


def pipeline_evaluate(built: Built, batches: list[dict[str, torch.Tensor]], *,
                      cross_document: bool) -> float:
    """:func:`evaluate` under pipeline parallelism: the batches are the schedule's
    micro-batches."""
    if not batches:  # every rank alike: the validation split is shared out equally
        built.model.train()
        return float("nan")
    masked = "loss_mask" in batches[0]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_loss(logits, targets, summed=masked)

    raw = run_pipeline(built, batches, loss_fn=loss_fn, train=False,
                       cross_document=cross_document)
    built.model.train()
    n = (trained_targets(batches, built.device).float() if masked else
         float(dist.get_world_size() * equal_microbatches(batches)))
    return float(shared_loss(built, raw, n))
