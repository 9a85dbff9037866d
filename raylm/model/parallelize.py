"""Apply parallelism to a model that knows nothing of it: tensor (with sequence) parallelism,
then activation checkpointing, then torch.compile, then FSDP2 ``fully_shard`` per decoder block
and at the root (torchtitan's order: FSDP2 shards what TP has already split). Under pipeline
parallelism the model arrives already cut to this rank's stage (:mod:`raylm.model.pipeline`),
and all of this applies to the stage.

The ranks form one named mesh ``(pp, dp, tp)`` (:func:`build_mesh`); FSDP2 shards over ``dp``,
tensor parallelism splits over ``tp``, pipeline stages follow one another over ``pp``. Ranks of
one ``tp`` group are neighbours (the last mesh dimension varies fastest), so on GPUs a TP group
stays inside a node, on its fast links; ``pp`` varies slowest, so with several nodes the stages
sit on different nodes and only the activations at the stage boundaries cross between them.

Tensor parallelism (``parallel.tensor``) follows the model's own plan for its projections
(transformers' ``base_model_tp_plan``: q/k/v/gate/up column-wise, o/down row-wise), and adds
what that plan leaves out because transformers only uses it for inference: sequence
parallelism (the norms and the residual stream hold 1/tp of the tokens, so activation memory
outside attention and MLP shrinks with tp as well), a vocabulary-split embedding, and an output
head whose logits stay split over the vocabulary for the loss (:func:`loss_context`: loss
parallel, no rank ever holds the full vocabulary's logits). Per micro-batch and block that is
two all-gathers and two reduce-scatters of the activations, forward, and as many backward.

Sharding happens on the meta device, before any weight exists, so no process ever holds the full
model; :func:`raylm.model.build.init_weights` then fills each rank's shards. Per-block sharding lets
FSDP gather one block's parameters at a time (peak memory = shards + one block), and overlap the
next block's all-gather with the current block's compute.

Precision (``train.precision``):

    fp32        parameters, compute, gradients and reduction in fp32
    bf16-mixed  fp32 master parameters; FSDP casts to bf16 for compute (MixedPrecisionPolicy
                param_dtype=bf16) and reduces gradients in fp32; bf16 autocast for the rest
    bf16-true   parameters, compute and gradients in bf16 (least memory, least precise)

A pretrained model is built in these dtypes, not the one its files are stored in (published
checkpoints are bf16: built as stored, a full fine-tune under bf16-mixed kept bf16 weights and
bf16 AdamW moments). Frozen weights (a LoRA base) are bf16 under bf16-mixed, as they are
computed with: half the memory of fp32, and FSDP casts them to bf16 for compute anyway.

``auto`` is bf16-mixed on CUDA devices with bf16 support, fp32 elsewhere (docs/training.md: on
CPUs without native bf16, bf16 autocast ran 33x slower than fp32).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from raylm.model.build import Shape, decoder_layers
from raylm.model.float8 import to_float8
from raylm.model.pipeline import Stage, owned_blocks


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """How :func:`parallelize` lays a model out; the data-parallel degree is what the world
    size leaves (``world / (tensor x pipeline)``)."""

    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in backward."""
    compile: bool = False
    """torch.compile each decoder block."""
    tensor: int = 1
    """Tensor-parallel degree: ranks that split every block's weights and activations."""
    pipeline: int = 1
    """Pipeline-parallel degree: ranks that each hold a contiguous run of blocks."""
    context: int = 1
    """Context-parallel degree: ranks that each hold a shard of every sequence
    (:mod:`raylm.model.context`)."""
    float8: str = "off"
    """Float8 matmuls in the blocks' linear layers: off, tensorwise or rowwise (see
    :mod:`raylm.model.float8`)."""
    reduce_dtype: str = "auto"
    """dtype of FSDP2's gradient reduce-scatter: auto (fp32, or bf16 under bf16-true, whose
    gradients are bf16), fp32 or bf16 (half the bytes)."""
    prefetch: int = 0
    """Blocks whose all-gather each block issues ahead, forward and backward (0: FSDP2's
    implicit prefetching)."""
    alone: bool = False
    """The whole model in this process, each rank reading its own weights, even inside a
    process group (a trainer's own generator: :mod:`raylm.rollout.generator`)."""


DATA_PARALLEL = ParallelPlan()
"""FSDP2 over every rank and nothing else."""
ALONE = ParallelPlan(alone=True)


@dataclass(frozen=True)
class Layout:
    """Where this rank sits on the ``(pp, dp, cp, tp)`` grid: data is split by ``dp_rank``
    over ``dp_size``; ranks with the same ``dp_rank`` see the same samples (a context-parallel
    group's each train its shard of them)."""

    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1

    def data_ranks(self) -> list[int]:
        """One global rank per data-parallel rank, in ``dp_rank`` order (the first of each
        context- and tensor-parallel group): whose batches make up a global batch."""
        return [d * self.cp_size * self.tp_size for d in range(self.dp_size)]


def layout_of(rank: int, world_size: int, plan: ParallelPlan = DATA_PARALLEL) -> Layout:
    """The position of ``rank`` (row-major over ``(pp, dp, cp, tp)``; the mesh
    :func:`build_mesh` builds is ``(pp, dp x cp, tp)``), computed without torch.distributed."""
    tp, pp, cp = plan.tensor, plan.pipeline, plan.context
    if world_size % (tp * pp * cp):
        raise ValueError(f"{world_size} ranks do not split into parallel.tensor={tp} x "
                         f"parallel.pipeline={pp} x parallel.context={cp} groups")
    dp = world_size // (tp * pp * cp)
    return Layout(dp_rank=rank // (tp * cp) % dp, dp_size=dp, tp_rank=rank % tp, tp_size=tp,
                  pp_rank=rank // (tp * cp * dp), pp_size=pp, cp_rank=rank // tp % cp,
                  cp_size=cp)


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


def set_dtypes(model: nn.Module, precision: str) -> None:
    """Give the parameters of ``model`` (on the meta device: no memory) the dtypes ``precision``
    trains them in (see the module docstring; bf16-true is cast by :func:`parallelize`)."""
    if precision == "bf16-true":
        return
    for p in model.parameters():
        want = torch.float32 if p.requires_grad or precision == "fp32" else torch.bfloat16
        if p.dtype != want:
            # In place, so a tied weight stays one Parameter under both its names.
            p.data = p.data.to(want)


def autocast(precision: str, device_type: str):
    """The autocast context for forward passes under ``precision``."""
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# The styles of transformers' TP plans that raylm applies (see tensor_parallel).
TP_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


def tp_plan(config, *, tensor: int) -> dict[str, str]:
    """The model's tensor-parallel plan (transformers' ``base_model_tp_plan``), refused where
    raylm cannot apply it."""
    family = type(config).__name__.removesuffix("Config")
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ValueError(f"parallel.tensor={tensor}: {family} models ship no tensor-parallel "
                         f"plan (base_model_tp_plan in transformers); train them with "
                         f"parallel.tensor=1 (FSDP2 shards them over the workers).")
    for pattern, style in plan.items():
        if not pattern.startswith("layers.*.") or style not in TP_STYLES:
            raise ValueError(
                f"parallel.tensor={tensor}: {family}'s tensor-parallel plan splits "
                f"{pattern!r} as {style!r}, which raylm does not apply (it applies "
                f"{', '.join(TP_STYLES)} inside the decoder layers); train it with "
                f"parallel.tensor=1 (FSDP2 shards it over the workers).")
    return plan


def check_tensor_parallel(config, *, tensor: int, seq_len: int) -> None:
    """Refuse a tensor-parallel degree the model or the sequence does not split into (before
    any worker starts): a model without a plan raylm can apply, and whole attention and
    key/value heads per rank and whole token shards for sequence parallelism."""
    if tensor == 1:
        return
    tp_plan(config, tensor=tensor)
    shape = Shape.of(config)
    heads, kv_heads = shape.heads, shape.kv_heads
    for what, n in (("attention heads", heads), ("key/value heads", kv_heads),
                    ("tokens per sequence (data.seq_len)", seq_len)):
        if n % tensor:
            raise ValueError(
                f"parallel.tensor={tensor} does not divide the model's {n} {what} "
                f"({n} = {n // tensor} x {tensor} + {n % tensor}); choose a degree that "
                f"divides {heads} attention heads, {kv_heads} key/value heads and "
                f"data.seq_len={seq_len}.")


def build_mesh(device_type: str, plan: ParallelPlan = DATA_PARALLEL):
    """The ``(pp, dp, tp)`` mesh over every rank (dimensions of size 1 included, so code
    can always name them); ``dp`` holds the context-parallel ranks too, as FSDP2 shards over
    both (each trains a shard of the same sequences, their gradients summed alike)."""
    from torch.distributed.device_mesh import init_device_mesh

    lay = layout_of(dist.get_rank(), dist.get_world_size(), plan)
    return init_device_mesh(device_type, (lay.pp_size, lay.dp_size * lay.cp_size, lay.tp_size),
                            mesh_dim_names=("pp", "dp", "tp"))


def parallelize(model: nn.Module, *, device_type: str, precision: str,
                plan: ParallelPlan = DATA_PARALLEL) -> nn.Module:
    """Split, checkpoint, compile and shard ``model`` in place as ``plan`` says (sharding only
    when torch.distributed is initialized with more than one data-parallel rank); returns
    it."""
    from raylm.compat import checkpoint_wrapper

    # An NF4 base arrives in bf16 already, and ``.to(dtype)`` would dequantize it.
    if precision == "bf16-true" and any(p.dtype != torch.bfloat16 for p in model.parameters()):
        model.to(torch.bfloat16)
    if plan.float8 != "off" and plan.tensor > 1:
        raise ValueError("model.float8 does not run under tensor parallelism; set "
                         "parallel.tensor=1 or model.float8=off")
    mesh = None
    if dist.is_initialized() and dist.get_world_size() > 1 and not plan.alone:
        mesh = build_mesh(device_type, plan)
    elif plan.tensor > 1 or plan.pipeline > 1:
        raise ValueError(f"parallel.tensor={plan.tensor} x parallel.pipeline={plan.pipeline} "
                         f"needs that many ranks; this process runs alone")
    if isinstance(model, Stage):
        model.pp_group = mesh["pp"].get_group()
    if plan.tensor > 1:
        tensor_parallel(model, mesh["tp"])
        # DTensor warns, at every step, that the gradient norm over (dp, tp) takes two small
        # all-reduces instead of one: a scalar per step, not worth a flattened mesh.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    blocks = decoder_layers(model)
    if plan.float8 != "off":
        to_float8(model, plan.float8, blocks=blocks, device_type=device_type)
    for i, block in owned_blocks(model):
        if plan.activation_checkpointing:
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if plan.compile:
            block.compile()
        blocks[i] = block
    if mesh is None or mesh["dp"].size() == 1:
        # One data-parallel rank has nothing to shard with; FSDP's gather/scatter copies would
        # cost ~5% of a step for nothing (measured on the tiny preset, CPU). DCP checkpoints of
        # the unsharded model still reshard onto any later layout.
        return model
    return shard(model, mesh=mesh["dp"], precision=precision,
                 # A stage runs each block once per micro-batch, forward and backward: gathering
                 # its weights anew each time would repeat the all-gathers m times per step. It
                 # holds 1/pp of the blocks, so keeping them gathered is what it can afford.
                 reshard_after_forward=plan.pipeline == 1, reduce_dtype=plan.reduce_dtype,
                 prefetch=plan.prefetch)


def tensor_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    """Split a Llama-style causal LM over ``tp_mesh`` (see the module docstring); in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    config = model.config
    plan = tp_plan(config, tensor=tp_mesh.size())
    first = owned_blocks(model)[0][1]
    blocks: dict[str, object] = {
        # The norms between attention and the MLP (two in Llama, four in Gemma 3) hand on
        # 1/tp of the tokens; attention and the MLP need all of them.
        **{name: SequenceParallel() for name, child in first.named_children()
           if "Norm" in type(child).__name__},
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    }
    styles = {"colwise": colwise_styles, "rowwise": rowwise_styles,
              "replicated_with_grad_allreduce": lambda name, adapted: {name: HeadNorm()}}
    for pattern, style in plan.items():
        name = pattern.removeprefix("layers.*.")
        blocks.update(styles[style](name, adapted=hasattr(first.get_submodule(name),
                                                          "base_layer")))
    # torch's styles make new parameters, all trainable: frozen ones (a LoRA base) must stay so.
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    inner = model.model
    for _, block in owned_blocks(model):
        parallelize_module(block, tp_mesh, blocks)
    ends = {
        # Vocabulary rows split; the output reduce-scattered to token shards.
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                        use_local_output=False),
        "norm": SequenceParallel(use_local_output=True),
    }
    # A pipeline stage holds the embedding only first, the final norm and head only last.
    held = {name: style for name, style in ends.items()
            if getattr(inner, name) is not None
            and not isinstance(getattr(inner, name), nn.Identity)}
    if held:
        parallelize_module(inner, tp_mesh, held)
    if model.lm_head is not None:
        parallelize_module(model, tp_mesh, {
            # Logits stay split over the vocabulary for the loss (loss_context).
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                       use_local_output=False),
        })
    if isinstance(model, Stage):
        model.tp_mesh = tp_mesh
    if getattr(config, "tie_word_embeddings", False):
        # Both halves split the same [vocab, hidden] matrix by rows: one parameter again.
        model.lm_head.weight = inner.embed_tokens.weight
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    return model


def colwise_styles(name: str, *, adapted: bool) -> dict[str, object]:
    """A column-wise projection (output features split); with a LoRA adapter, its B splits the
    same way and its A (rank x in) is replicated: B's column-wise input all-reduces A's
    gradient, as it does the base layer's."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    if not adapted:
        return {name: ColwiseParallel()}
    return {f"{name}.base_layer": ColwiseParallel(),
            f"{name}.lora_A.default": Replicated(),
            f"{name}.lora_B.default": ColwiseParallel()}


def rowwise_styles(name: str, *, adapted: bool) -> dict[str, object]:
    """A row-wise projection (input features split, partial sums reduce-scattered back to token
    shards: the residual stream stays split); with a LoRA adapter, its A splits the same way
    (A's partial sums reduce-scattered likewise) and its B is replicated, on token shards."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    def rowwise():
        return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)

    if not adapted:
        return {name: rowwise()}
    return {f"{name}.base_layer": rowwise(), f"{name}.lora_A.default": rowwise(),
            f"{name}.lora_B.default": Replicated(output_layout=Shard(1))}


class Replicated(ParallelStyle):
    """A module whose parameters every rank of the mesh holds whole (a LoRA factor next to a
    split projection); torch's parallel styles all split something.

    Its input is gathered whole and its output's gradient made whole (all-reduced where it
    arrives as partial sums) before its backward, so the parameters' gradients are complete on
    every rank: a gradient left as per-rank partial sums would be taken for the whole one by
    FSDP2 and the optimizer. The output is handed on as ``output_layout`` (its token shard
    where the residual stream is split). On LoRA's rank-r activations that is a few KB."""

    def __init__(self, *, output_layout=None) -> None:
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import DTensor, Replicate, distribute_module

        whole = (Replicate(),)

        def gather_input(mod, inputs, mesh):
            return tuple(x.redistribute(mesh, whole) if isinstance(x, DTensor) else x
                         for x in inputs)

        def hand_on(mod, out, mesh):
            if out.requires_grad:  # not under no_grad (evaluation)
                out.register_hook(lambda grad: grad.redistribute(mesh, whole))
            if self.output_layout is not None:
                out = out.redistribute(mesh, (self.output_layout,))
            return out

        return distribute_module(module, device_mesh, input_fn=gather_input, output_fn=hand_on)


class HeadNorm(ParallelStyle):
    """A norm over each attention head's features (Qwen3's and Gemma 3's ``q_norm`` and
    ``k_norm``), applied to the heads this rank holds: its weight is held whole on every rank,
    and its gradient, a sum over all heads, is all-reduced over the mesh (each rank's share
    covers its own heads only). The input arrives as this rank's heads (dimension 2 of
    batch x tokens x heads x head size) and leaves as they came."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import DTensor, Shard, distribute_module

        def split_heads(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, (Shard(2),), run_check=False)
                         for x in inputs)

        def local(mod, out, mesh):
            return out.to_local()

        return distribute_module(module, device_mesh, input_fn=split_heads, output_fn=local)


def loss_context(plan: ParallelPlan):
    """Where the loss and its backward must run: under tensor parallelism the logits are split
    over the vocabulary, and loss parallel computes cross-entropy from per-rank partial sums."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if plan.tensor > 1 else contextlib.nullcontext()


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def shard(model: nn.Module, *, mesh, precision: str, reshard_after_forward: bool = True,
          reduce_dtype: str = "auto", prefetch: int = 0) -> nn.Module:
    """FSDP2 ``fully_shard`` per decoder block and at the root over ``mesh``, with the mixed
    precision policy of ``precision``, gradients reduced in ``reduce_dtype`` (see
    :class:`ParallelPlan`) and each block's all-gather issued ``prefetch`` blocks ahead."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param = torch.bfloat16 if precision == "bf16-mixed" else None
    reduce = REDUCE_DTYPES.get(reduce_dtype)
    if reduce_dtype == "auto" and precision == "bf16-mixed":
        reduce = torch.float32  # bf16 compute, fp32 gradient sums
    mp = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
    blocks = owned_blocks(model)
    for i, block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp,
                    reshard_after_forward=reshard_after_forward and _regathers(i, blocks))
    # None: FSDP2's default, which keeps the root's parameters gathered after forward.
    fully_shard(model, mesh=mesh, mp_policy=mp,
                reshard_after_forward=None if reshard_after_forward else False)
    if prefetch:
        # Explicit prefetching: block i issues the all-gathers of the next ``prefetch`` blocks
        # in forward and of the previous ones in backward, so each gather has that many blocks'
        # compute to hide behind, at the cost of that many blocks' gathered weights held.
        order = [b for _, b in blocks]
        for i, block in enumerate(order):
            block.set_modules_to_forward_prefetch(order[i + 1:i + 1 + prefetch])
            block.set_modules_to_backward_prefetch(order[max(0, i - prefetch):i][::-1])
    return model


def _regathers(i: int, blocks: list[tuple[int, nn.Module]]) -> bool:
    """Whether block ``i`` of ``blocks`` gives its gathered parameters back after forward: all
    but the last, whose parameters backward needs again at once."""
    return i < blocks[-1][0]


@contextlib.contextmanager
def gathered(model: nn.Module):
    """The whole of a data-parallel FSDP2 ``model`` on this rank for the block, in eval mode:
    each unit's parameters all-gathered once on entering (every rank enters together) and kept
    through any number of forward passes, so a generation's forward per token issues no
    collective and ranks may run different numbers of them; given back on leaving, the units'
    resharding and the training mode as they were. A model that is not sharded is only put in
    eval mode."""
    from torch.distributed.fsdp import FSDPModule

    was_training = model.training
    model.eval()
    blocks = [(i, b) for i, b in owned_blocks(model) if isinstance(b, FSDPModule)]
    root = [model] if isinstance(model, FSDPModule) else []
    try:
        for unit in root + [b for _, b in blocks]:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        yield model
    finally:
        # The root keeps its parameters after forward (FSDP2's default for it, and shard's).
        for i, block in blocks:
            block.set_reshard_after_forward(_regathers(i, blocks), recurse=False)
        for unit in root + [b for _, b in blocks]:
            unit.reshard()
        model.train(was_training)
