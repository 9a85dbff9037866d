"""The one place a model is assembled: a preset or a pretrained directory, the vocabulary,
adapters (LoRA, or QLoRA's NF4 base), the attention kernel and the precision turned into a
:class:`Built` model with its weights, and the loss and evaluation that run on it.

Everything that runs a model uses it: the Train loop (:mod:`raylm.workers.loop`), the reference
pass's scorer, the exporter, ``raylm prune`` and ``raylm eval`` (a run's checkpoint read into
:func:`build_for_checkpoint`'s model) and the benchmarks. Needs only torch and transformers
(no Ray, no MLflow).

Loss arithmetic: every block holds exactly ``seq_len`` targets (no padding), so each
micro-batch's mean cross-entropy divided by the accumulation steps, summed over micro-batches
and averaged over ranks by FSDP's gradient reduction, is exactly the mean over the global batch:
``global_batch = micro_batch x accumulation x workers`` sequences (16 x 256 = 4,096 targets per
optimizer step with the defaults).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from raylm.model.attention import AttentionChoice, choose_attention, fit_to_model
from raylm.model.build import (
    build_config,
    build_meta_model,
    init_weights,
    materialize,
    reset_buffers,
)
from raylm.model.context import ATTENTION, Context
from raylm.model.context import use as use_context
from raylm.model.head_loss import IGNORE, fusable, head_loss, head_rows, use_loss_head
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


@dataclass
class Built:
    """A model assembled to run, with what its loss and evaluation need to know of it."""

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
    context: Context | None = None
    """This rank's context-parallel group, where sequences are split over ranks."""

    @classmethod
    def on_cpu(cls, model: nn.Module, cross_document: bool = True) -> Built:
        """A model loaded some other way (``from_pretrained``, a quantized copy) as the loss
        and evaluation take it, on this process's CPU in fp32."""
        return cls(model, choose_attention("cpu", cross_document=cross_document), "fp32",
                   torch.device("cpu"), model.config, cross_document=cross_document)


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
    config, choice = fitted_config(preset=preset, path=path, vocab_size=vocab_size,
                                   eos_id=eos_id, device_type=device.type, precision=precision,
                                   attention=attention, cross_document=cross_document)
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
    # Each rank reads its own weights: a pipeline stage its stage's, a model alone all of them.
    own = isinstance(model, Stage)
    if base_quantization == "nf4":
        if not (adapters and path):
            raise ValueError("an NF4 base needs LoRA adapters and a pretrained model.path")
        check_nf4_shapes(model, lora["target_modules"],
                         dist.get_world_size() if dist.is_initialized() and not plan.alone
                         else 1)
        if precision == "bf16-true":
            model.to(torch.bfloat16)  # quantized from bf16, as it would be parallelized
        load_quantized_base(model, path, device, own_stage=own or plan.alone)
        parallelize(model, device_type=device.type, precision=precision, plan=plan)
    else:
        parallelize(model, device_type=device.type, precision=precision, plan=plan)
        materialize(model, device)
        if path:
            load_pretrained_weights(model, path, own_stage=own, alone=plan.alone)
        else:
            init_weights(model, seed=seed, num_layers=config.num_hidden_layers)
    if adapters:
        init_adapters(model, seed=seed)
    model.train()
    pipe = None
    if isinstance(model, Stage):
        pipe = Pipeline(model, group=model.pp_group, device=device, schedule=pipeline_schedule)
    context = None
    if plan.context > 1:
        context = Context.start(plan.context)
        use_context(model, context)
        # Inside attention each rank runs causal attention over whole documents, unmasked:
        # the kernel blocks whose documents see each other get.
        inner = choose_attention(device.type, cross_document=True, precision=precision)
        choice = dataclasses.replace(inner, implementation=ATTENTION,
                                     backend=f"all-to-all+{inner.backend}")
    return Built(model, choice, precision, device, config, plan, pipe, cross_document,
                 fused_loss, context)


def fitted_config(*, preset: str | None, path: str | None, vocab_size: int, eos_id: int,
                  device_type: str, precision: str, attention: str = "auto",
                  cross_document: bool = True) -> tuple[Any, AttentionChoice]:
    """The transformers config of a preset or a pretrained directory, with the attention
    kernel chosen for ``device_type`` and fitted to what the model's family implements."""
    choice = choose_attention(device_type, requested=attention, cross_document=cross_document,
                              precision=precision)
    config = build_config(preset=preset, path=path, vocab_size=vocab_size, eos_id=eos_id,
                          attn_implementation=choice.implementation)
    choice = fit_to_model(choice, config, requested=attention, device_type=device_type)
    config._attn_implementation = choice.implementation
    return config, choice


def build_for_checkpoint(*, preset: str | None, path: str | None, vocab_size: int,
                         eos_id: int, lora: dict[str, Any] | None = None) -> Built:
    """The model a run's checkpoint is read into on this process's CPU, in fp32 and unsharded
    (DCP gathers the shards of any world size into it), with adapters where ``lora`` gives a
    rank: their frozen base is loaded from the pretrained ``path`` (a LoRA checkpoint holds
    the adapters alone). Nothing else is initialized: the checkpoint holds it."""
    config, choice = fitted_config(preset=preset, path=path, vocab_size=vocab_size,
                                   eos_id=eos_id, device_type="cpu", precision="fp32")
    model = build_meta_model(config)
    adapters = bool(lora and lora.get("rank"))
    if adapters:
        model = add_adapters(model, **lora)
    materialize(model, "cpu")
    reset_buffers(model)  # rotary frequencies are not in checkpoints
    if adapters:
        load_pretrained_weights(model, path)
    return Built(model, choice, "fp32", torch.device("cpu"), config)


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
    kwargs = _positions(built, batch, cross_document)
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


def _positions(built: Built, batch: dict[str, torch.Tensor], cross_document: bool) -> dict:
    """The inputs' positions, restarting at each document unless attention crosses them (a
    context-parallel shard's are its own: :meth:`raylm.model.context.Context.shard`)."""
    return {} if cross_document and built.context is None else {
        "position_ids": batch["position_ids"][:, :-1].to(built.device, non_blocking=True)}


def sequence_shards(built: Built, batches: Iterable[dict[str, torch.Tensor]], *,
                    cross_document: bool) -> list[dict[str, torch.Tensor]]:
    """``batches`` as this rank trains them: with context parallelism, its shard of each
    sequence."""
    if built.context is None:
        return list(batches)
    return [built.context.shard(b, cross_document=cross_document) for b in batches]


def row_logps(rows: torch.Tensor, targets: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The log-probability of the target at each flat position ``at`` of a (B, T) batch, from
    the logits of those positions alone (``rows``: (n, V), ``at`` on their device): fp32
    log-softmax of those rows only (answers are a part of a block: the prompts' and the
    padding's rows of the vocabulary-wide logits are never copied to fp32)."""
    rows = rows.float()
    picked = targets.reshape(-1).to(rows.device, non_blocking=True).index_select(0, at)
    return rows.gather(-1, picked.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(rows, dim=-1)


def _on(at: torch.Tensor, device: torch.device) -> torch.Tensor:
    if at.device != device:
        if device.type == "cuda":
            at = at.pin_memory()
        at = at.to(device, non_blocking=True)
    return at


def answer_rows(built: Built, batch: dict[str, torch.Tensor], at: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of the flat target positions ``at`` of ``batch`` (n, V), and ``at`` on the
    model's device. A model whose head computes losses in chunks projects those positions
    only (:func:`raylm.model.head_loss.head_rows`)."""
    if built.cross_document:
        # Its kernel was chosen for unmasked blocks: on CUDA, SDPA's flash kernel, which
        # takes no mask and fails at the first pair ("No available kernel").
        raise ValueError("answers are scored with per-document attention: build the model "
                         "with cross_document=False (data.cross_document_attention false), so "
                         "that a block's documents (a pair's halves) do not see each other")
    tokens = batch["input_ids"].to(built.device, non_blocking=True)
    positions = batch["position_ids"][:, :-1].to(built.device, non_blocking=True)
    at = _on(at, built.device)
    with built.attention.context(), autocast(built.precision, built.device.type):
        if built.fused_loss:
            with head_rows(at, built.config) as pending:
                built.model(input_ids=tokens[:, :-1], position_ids=positions)
            return pending.logits, at
        logits = built.model(input_ids=tokens[:, :-1], position_ids=positions).logits
    return logits.reshape(-1, logits.size(-1)).index_select(0, at), at


@torch.no_grad()
def logit_spread(built: Built, batch: dict[str, torch.Tensor], *, cross_document: bool
                 ) -> float:
    """The largest standard deviation of the logits over the vocabulary, at any position of
    ``batch``'s first sequence on any rank (every rank calls it): 0 for a model that predicts
    every token alike, whatever its input (a head or a final norm of zeros, head rows all
    equal), and clearly above 0 for any other, trained or randomly initialized (0.16 for a
    tiny random-weight Qwen3). One forward of the micro-batch as :func:`evaluate` runs it
    (the same shapes and mode, so compiled blocks compile nothing new for it)."""
    (batch,) = sequence_shards(built, [batch], cross_document=cross_document)
    tokens = batch["input_ids"][:, :-1].to(built.device, non_blocking=True)
    kwargs = _positions(built, batch, cross_document)
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
    return global_count(sum(int(b["loss_mask"][:, 1:].sum()) for b in batches), device)


def global_count(local: int, device: torch.device) -> torch.Tensor:
    """``local`` summed over every rank (all call it)."""
    n = torch.full((), local, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(n)
    return n


def plain(value: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss under tensor parallelism) as the tensor it holds."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


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
    batches = sequence_shards(built, batches, cross_document=cross_document)
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
