"""LoRA adapters through peft, applied to a model that knows nothing of them.

peft's ``inject_adapter_in_model`` replaces each targeted ``nn.Linear`` in place by a LoRA layer
holding the frozen original (``base_layer``) and the trainable ``lora_A``/``lora_B``; the model
keeps its own structure (``model.layers``), so :mod:`raylm.model.parallelize` shards it unchanged
and each block's adapters live in that block's FSDP2 unit. Adapters are injected on the meta model,
before sharding, and filled after materializing like every other parameter: by a generator seeded
with (seed, name), so any world size gets the same adapters. ``lora_A`` is drawn uniformly in
+-1/sqrt(fan_in) (peft's default Kaiming bound) and ``lora_B`` is zero, so the adapted model starts
as the base model.

Only the trainable parameters (and their optimizer state) go into checkpoints: the base comes
from ``model.path`` on every start, so a checkpoint of a 1B model's rank-16 adapters is tens of
megabytes, not gigabytes.

QLoRA (``lora.base_quantization: nf4``): the frozen weight of every adapted layer is held as
torchao's ``NF4Tensor`` (4-bit NormalFloat in blocks of 64 values, their scales quantized again
in blocks of 256), which knows how FSDP2 splits and all-gathers it, and dequantizes in the
linear's forward. Its quantization constants come from the whole tensor, so it must be
quantized before sharding and alike on every rank: :func:`load_quantized_base` materializes
the meta model one tensor at a time (read on rank 0, broadcast, NF4-quantized on each rank),
and FSDP2 then shards what it built. No rank holds more than one adapted weight unquantized
at a time; the unadapted ones (embeddings, norms, output head) are whole on each rank until
FSDP2 shards them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable

import torch
from torch import nn

from raylm.console import quiet_torchao
from raylm.model.build import WeightsError, canonical_name, copy_full, decoder_layers, reset_buffers

ADAPTER_MARK = ".lora_"


def _projection(module: nn.Module) -> bool:
    """A layer peft adapts as a linear map (``nn.Linear``, GPT-2's ``Conv1D``), or one it
    already wraps (``base_layer``)."""
    return (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
            or hasattr(module, "base_layer"))


def projections(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of the projections in ``module``, not looking inside LoRA wrappers (their
    ``base_layer`` and adapters are the wrapper's own)."""
    out = []
    for name, m in module.named_modules():
        if ".base_layer" in f".{name}" or ADAPTER_MARK in f".{name}":
            continue
        if _projection(m):
            out.append((name, m))
    return out


def block_projections(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name in the model, layer) of every linear projection inside the decoder layers,
    whatever the family calls them (Llama's q/k/v/o and gate/up/down, Phi-3's fused qkv_proj
    and gate_up_proj, GPT-2's Conv1D c_attn, c_proj, c_fc). A mixture-of-experts router (the
    ``gate`` beside ``experts``) is left out: it picks experts, it is neither adapted nor
    pruned; experts held as fused 3-D weights (Qwen3-MoE in transformers 5) are no linear
    layers."""

    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    out = []
    for i, layer in enumerate(layers):
        for name, module in projections(layer):
            parent, _, leaf = name.rpartition(".")
            router = hasattr(layer.get_submodule(parent) if parent else layer, "experts")
            if not (router and leaf == "gate"):
                out.append((f"{prefix}.{i}.{name}", module))
    return out


def linear_projections(model: nn.Module) -> list[str]:
    """What ``lora.target_modules: auto`` adapts: the leaf names of
    :func:`block_projections`."""
    return sorted({name.rsplit(".", 1)[-1] for name, _ in block_projections(model)})


def resolve_targets(model: nn.Module, target_modules: list[str] | str) -> list[str]:
    """``lora.target_modules`` for ``model``: ``auto`` as :func:`linear_projections`, or the
    names given, each of which must be a linear layer of the model."""
    if target_modules == "auto":
        targets = linear_projections(model)
        if not targets:
            raise ValueError(f"lora.target_modules=auto: {type(model).__name__} has no linear "
                             f"layers inside its decoder layers; name the layers to adapt.")
        return targets
    found = {name.rsplit(".", 1)[-1] for name, _ in projections(model)}
    missing = sorted(set(target_modules) - found)
    if missing:
        raise ValueError(f"lora.target_modules: {', '.join(missing)} is not a linear layer of "
                         f"this model; it has {', '.join(sorted(found))} (or use auto: "
                         f"every linear projection of its decoder layers).")
    return list(target_modules)


def add_adapters(model: nn.Module, *, rank: int, alpha: float, dropout: float,
                 target_modules: list[str] | str) -> nn.Module:
    """Inject LoRA adapters (on whatever device the model is, meta included) and freeze the
    rest; returns the same model."""
    quiet_torchao()
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=resolve_targets(model, target_modules), bias="none")
    model = inject_adapter_in_model(config, model, low_cpu_mem_usage=True)
    for name, p in model.named_parameters():
        p.requires_grad_(ADAPTER_MARK in name)
    return model


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"lora:{seed}:{name}".encode(), digest_size=8)
                          .digest(), "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_adapters(model: nn.Module, *, seed: int) -> None:
    """Fill the materialized adapters (full tensors or FSDP shards): A uniform in
    +-1/sqrt(fan_in) by (seed, name), B zero."""

    for wrapped, param in model.named_parameters():
        name = canonical_name(wrapped)
        if ".lora_B." in name:
            full = torch.zeros(param.shape)
        elif ".lora_A." in name:
            bound = 1.0 / param.shape[1] ** 0.5
            gen = torch.Generator().manual_seed(_name_seed(seed, name))
            full = torch.empty(param.shape).uniform_(-bound, bound, generator=gen)
        else:
            continue
        copy_full(param, full)


def adapter_args(lora) -> dict | None:
    """``add_adapters``' arguments from the ``lora`` config section; None for full
    fine-tuning (rank 0)."""
    if not lora.rank:
        return None
    targets = lora.target_modules
    return {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
            "target_modules": targets if targets == "auto" else list(targets)}


def settings(lora) -> dict:
    """What a checkpoint records of its adapters (a resume must use the same); empty for full
    fine-tuning. Dropout is left out: it may change between invocations."""
    if not lora.rank:
        return {}
    targets = lora.target_modules
    return {"rank": lora.rank, "alpha": lora.alpha,
            "target_modules": targets if targets == "auto" else sorted(targets)}


@torch.no_grad()
def merge_adapters(model: nn.Module, *, keep_zeros: bool = False) -> nn.Module:
    """Fold every adapter into its base weight and put the plain linear layer back: the model
    a Hugging Face client loads without peft. With ``keep_zeros`` (a pruned base:
    :mod:`raylm.model.sparsity`) the base's zeros stay zero in the merged weight, where the
    adapters' dense product would fill them. Returns the same model."""
    quiet_torchao()
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            kept = module.base_layer.weight != 0 if keep_zeros else None
            module.merge()
            if kept is not None:
                module.base_layer.weight.mul_(kept)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.base_layer)
    return model


NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256


def check_nf4_shapes(model: nn.Module, target_modules: list[str] | str,
                     world_size: int) -> None:
    """Each quantized weight must split into whole quantization blocks per rank (FSDP2 shards
    it by rows, and an NF4 shard is whole blocks of whole scale blocks)."""
    targets = set(resolve_targets(model, target_modules))
    unit = NF4_BLOCK * NF4_SCALER_BLOCK * world_size
    for name, m in projections(model):
        if name.rsplit(".", 1)[-1] in targets:
            # The adapted layer's frozen weight is what is quantized.
            rows, cols = getattr(m, "base_layer", m).weight.shape
            if rows % world_size or (rows * cols) % unit:
                raise ValueError(
                    f"lora.base_quantization=nf4: {name}.weight ({rows}x{cols}) does not split "
                    f"into {world_size} shards of whole NF4 blocks ({NF4_BLOCK} values x "
                    f"{NF4_SCALER_BLOCK} per scale block per rank); leave that layer out of "
                    f"lora.target_modules or use fewer workers.")


@torch.no_grad()
def load_quantized_base(model: nn.Module, path: str, device: torch.device, *,
                        own_stage: bool = False) -> int:
    """Materialize the meta ``model`` (with adapters injected) on ``device`` from the pretrained
    weights in ``path``: the base weight of every adapted layer as a frozen NF4 tensor, every
    other pretrained weight as it is, adapters empty (for :func:`init_adapters`), non-persistent
    buffers recomputed. Rank 0 reads each tensor and broadcasts it (with ``own_stage``, a
    pipeline stage, every rank reads its own stage's); returns how many weights were
    quantized."""
    import torch.distributed as dist
    from safetensors import safe_open

    quiet_torchao()
    from torchao.quantization import to_nf4

    distributed = dist.is_initialized() and not own_stage
    rank0 = not distributed or dist.get_rank() == 0
    where: dict[str, object] = {}
    if rank0:
        from pathlib import Path

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise WeightsError(f"model.path: {path} holds no .safetensors weights.")
        for f in files:
            handle = safe_open(str(f), "pt", device="cpu")
            where.update({k: handle for k in handle.keys()})
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    quantized = 0
    for name, param in list(model.named_parameters()):
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        value = torch.empty(param.shape, dtype=param.dtype, device=device)
        if ADAPTER_MARK not in name:
            if rank0:
                stored = name.replace(".base_layer.", ".")
                if stored not in where:
                    raise WeightsError(f"model.path: {path} lacks {stored}")
                value.copy_(where[stored].get_tensor(stored))
            if distributed:
                dist.broadcast(value, src=0)
        if name.endswith(".base_layer.weight"):
            value = to_nf4(value, NF4_BLOCK, NF4_SCALER_BLOCK)
            quantized += 1
            if type(module) is nn.Linear:
                module.__class__ = NF4Linear
        module._parameters[leaf] = nn.Parameter(value, requires_grad=param.requires_grad)
    if tied:
        model.tie_weights()
    for name, buf in list(model.named_buffers()):
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        # build_meta_model computed the buffers on the CPU (Gemma's embedding scale is in no
        # checkpoint); a meta one is recomputed by reset_buffers below.
        module._buffers[leaf] = (torch.empty_like(buf, device=device) if buf.is_meta
                                 else buf.to(device))
    reset_buffers(model)
    return quantized


class NF4Linear(nn.Linear):
    """A frozen linear layer whose weight is an ``NF4Tensor``: its forward and backward are one
    opaque operator each (:func:`nf4_linear`), which dequantize the weight inside and keep
    nothing but the 4-bit weight for backward.

    torchao's own NF4 linear does the same in eager mode, but under ``torch.compile`` its
    dequantization is traced into the block's graph, where the forward's and the backward's
    dequantization of a weight become one node that backward uses, and the partitioner saves
    such a node rather than recompute it: every dequantized weight was kept for backward, a
    16-bit copy of the whole base, as much memory as LoRA on a bf16 base."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_linear(x, self.weight, self.bias)


def nf4_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for an NF4 ``weight``, computed in the autocast dtype
    where autocast is on (as ``F.linear`` would be) and else in ``x``'s."""
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    rows, cols = weight.shape
    out = torch.ops.raylm.nf4_linear(x, *_nf4_parts(weight), rows, cols, weight.block_size,
                                     weight.n_blocks, weight.scaler_block_size, weight.dtype)
    return out if bias is None else out + bias.to(out.dtype)


def _nf4_parts(weight) -> list[torch.Tensor]:
    return [getattr(weight, k) for k in _NF4_INNER]


# NF4Tensor's inner tensors, in the order the operators take them.
_NF4_INNER = ("quantized_data", "scaler_mean", "quantization_factor", "quantized_scalers", "nf4")


def _dequantized(parts: list[torch.Tensor], rows: int, cols: int, block: int, n_blocks: int,
                 scaler_block: int, dtype: torch.dtype) -> torch.Tensor:
    """The 16-bit weight that ``parts`` hold: torchao's dequantization (``NF4Tensor.
    get_original_weight``), step for step, on the inner tensors. Written out so that on CUDA
    it compiles into one fused kernel: torchao's runs eagerly as a dozen kernels with int64
    index tensors, and made QLoRA 2.3x slower than LoRA (H200, Qwen3 1.7B's shape)."""
    data, mean, factor, scalers, table = parts
    first = table[(data >> 4).to(torch.long)]
    second = table[(data & 0b1111).to(torch.long)]
    scales = (scalers.view(-1, scaler_block) / factor.unsqueeze(-1)).flatten().to(dtype) + mean
    repeated = scales.unsqueeze(-1).expand(scales.size(0), block // 2).flatten()
    return torch.stack([first * repeated, second * repeated], dim=-1).reshape(rows, cols)


@functools.cache
def _fused_dequantized() -> Callable[..., torch.Tensor]:
    # Compiled at the first use on CUDA, not at import: ``torch.compile`` pulls dynamo and
    # inductor in (2.3 to 3.1 CPU-s here), which every process importing this module paid.
    return torch.compile(_dequantized, dynamic=False)


def _weight(parts: list[torch.Tensor], *meta) -> torch.Tensor:
    return (_fused_dequantized() if parts[0].is_cuda else _dequantized)(parts, *meta)


@torch.library.custom_op("raylm::nf4_linear", mutates_args=())
def _nf4_forward(x: torch.Tensor, data: torch.Tensor, mean: torch.Tensor,
                 factor: torch.Tensor, scalers: torch.Tensor, table: torch.Tensor, rows: int,
                 cols: int, block: int, n_blocks: int, scaler_block: int, dtype: torch.dtype
                 ) -> torch.Tensor:
    w = _weight([data, mean, factor, scalers, table], rows, cols, block, n_blocks,
                scaler_block, dtype)
    return torch.nn.functional.linear(x, w.to(x.dtype))


@_nf4_forward.register_fake
def _(x, data, mean, factor, scalers, table, rows, cols, block, n_blocks, scaler_block, dtype):
    return x.new_empty((*x.shape[:-1], rows))


@torch.library.custom_op("raylm::nf4_linear_input_grad", mutates_args=())
def _nf4_input_grad(grad: torch.Tensor, data: torch.Tensor, mean: torch.Tensor,
                    factor: torch.Tensor, scalers: torch.Tensor, table: torch.Tensor,
                    rows: int, cols: int, block: int, n_blocks: int, scaler_block: int,
                    dtype: torch.dtype) -> torch.Tensor:
    return grad @ _weight([data, mean, factor, scalers, table], rows, cols, block, n_blocks,
                          scaler_block, dtype).to(grad.dtype)


@_nf4_input_grad.register_fake
def _(grad, data, mean, factor, scalers, table, rows, cols, block, n_blocks, scaler_block,
      dtype):
    return grad.new_empty((*grad.shape[:-1], cols))


def _nf4_save(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[1:6])
    ctx.meta = inputs[6:]


def _nf4_backward(ctx, grad):
    return (_nf4_input_grad(grad, *ctx.saved_tensors, *ctx.meta),) + (None,) * 11


_nf4_forward.register_autograd(_nf4_backward, setup_context=_nf4_save)


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """Run ``model`` as its base inside the block: every LoRA layer skips its adapters (the
    reference model of preference tuning, without a second copy of the weights).

    Sets the flag the LoRA layers' forward reads, which peft's ``enable_adapters`` also sets,
    but not through that method: it also switches the adapters' ``requires_grad`` off and back
    on (for whichever parameter objects the modules hold at that moment, FSDP2's sharded or
    unsharded ones), twice a step, where the reference pass, run under ``no_grad``, needs only
    the flag."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ValueError("adapters_off: the model holds no LoRA adapters")
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False
