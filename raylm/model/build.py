"""Causal language models from transformers: named Llama presets or a local pretrained directory.

Models are built on the meta device (no memory), so the caller can shard them before any weight
exists; :func:`init_weights` then fills whatever tensors the parameters have become (full or
FSDP shards) with values that depend only on the seed and the parameter's name, never on the
number of workers. This module knows nothing of parallelism.

Preset sizes (vocabulary 32,000 for the count; the real vocabulary comes from the tokenizer):

    tiny     2 layers,  d=64,   4 heads               4.2M params (4.1M of them embeddings)
    125m    12 layers,  d=768,  12 heads              134M
    350m    24 layers,  d=1024, 16 heads              374M
    1b      16 layers,  d=2048, 32 heads, 8 KV heads  1.04B (Llama 3.2 1B shape, tied embeddings)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from raylm.console import quiet_torchao


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_positions: int
    tie_embeddings: bool = False


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 2, 4, 4, 256, 1024),
    "125m": Preset(768, 12, 12, 12, 2048, 2048),
    "350m": Preset(1024, 24, 16, 16, 2816, 2048),
    "1b": Preset(2048, 16, 32, 8, 8192, 4096, tie_embeddings=True),
    "3b": Preset(3072, 28, 24, 8, 8192, 4096, tie_embeddings=True),
}
INIT_STD = 0.02


class WeightsError(ValueError):
    """Weight files that do not hold what the model needs: missing, truncated, or another
    model's."""


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Embedding rows rounded up so the output matmul has tensor-core friendly shapes."""
    return (vocab_size + multiple - 1) // multiple * multiple


def build_config(*, preset: str | None, path: str | None, vocab_size: int, eos_id: int,
                 attn_implementation: str):
    """A transformers config for a preset or a pretrained directory."""
    from transformers import AutoConfig, LlamaConfig

    if path:
        p = Path(path).expanduser()
        if not (p / "config.json").is_file():
            raise ValueError(f"model.path: {p} holds no config.json; point it at a Hugging "
                             f"Face model directory (for example one written by raylm export).")
        try:
            cfg = AutoConfig.from_pretrained(str(p), trust_remote_code=False)
        except ValueError as e:
            if "trust_remote_code" not in str(e):
                raise
            raise ValueError(
                f"model.path: {p} is a model whose own Python code (its config.json's "
                f"auto_map) must run to load it, which raylm never does; use a model of a "
                f"family transformers has built in (or one converted to such a family).") from None
        if getattr(cfg, "vocab_size", vocab_size) < vocab_size:
            raise ValueError(f"model.path: the model at {p} has {cfg.vocab_size} embeddings but "
                             f"the tokenizer has {vocab_size} tokens; use the model's own "
                             f"tokenizer (tokenizer.path={p}).")
    else:
        if preset not in PRESETS:
            raise ValueError(f"model.preset: unknown preset {preset!r}; choose one of "
                             f"{', '.join(PRESETS)} or set model.path.")
        s = PRESETS[preset]
        cfg = LlamaConfig(
            vocab_size=padded_vocab(vocab_size),
            hidden_size=s.hidden_size,
            intermediate_size=s.intermediate_size,
            num_hidden_layers=s.num_layers,
            num_attention_heads=s.num_heads,
            num_key_value_heads=s.num_kv_heads,
            max_position_embeddings=s.max_positions,
            tie_word_embeddings=s.tie_embeddings,
            initializer_range=INIT_STD,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
            rms_norm_eps=1e-5,
        )
    cfg._attn_implementation = attn_implementation
    cfg.use_cache = False
    return cfg


@dataclass(frozen=True)
class Shape:
    """A model's dimensions, read from any family's transformers config: the names Llama uses
    where the family has them (transformers maps GPT-2's ``n_head``, ``n_embd`` and ``n_layer``
    onto them), else what the family computes without them. A family whose config class
    declares no key/value head count (GPT-2) has one key/value head per attention head,
    whatever a hand-edited config carries under that name (transformers ignores it too)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config) -> Shape:
        import inspect

        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        declared = "num_key_value_heads" in inspect.signature(type(config).__init__).parameters
        kv = (getattr(config, "num_key_value_heads", None) if declared else None) or heads
        # GPT-2's MLP is n_inner wide, 4 x hidden where n_inner is None.
        mlp = (getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
               or 4 * hidden)
        return cls(layers=int(config.num_hidden_layers), hidden=hidden, heads=heads,
                   kv_heads=int(kv), head_dim=int(getattr(config, "head_dim", None)
                                                  or hidden // heads),
                   intermediate=int(mlp), vocab=int(config.vocab_size))


def max_positions(config) -> int:
    return int(getattr(config, "max_position_embeddings", 0) or 0)


def check_seq_len(seq_len: int, config, *, preset: str | None, path: str | None) -> None:
    """Refuse a ``data.seq_len`` beyond the positions of ``config`` (the model's)."""
    positions = max_positions(config)
    if seq_len > positions:
        raise ValueError(f"data.seq_len={seq_len} is above the {positions} positions of "
                         f"{path or 'model.preset=' + str(preset)}; lower data.seq_len or choose "
                         f"a model with more positions.")


def build_meta_model(config) -> nn.Module:
    """The model with every parameter on the meta device: no memory until materialized.

    Buffers are built for real, on the CPU, as the model's own constructor computes them:
    some are not in any checkpoint and not recomputed by anything else (Gemma's embedding
    scale, the rotary frequencies of each layer type); ``materialize`` carries them over."""

    quiet_torchao()
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, trust_remote_code=False, attn_implementation=config._attn_implementation)
    # The context gives every parameter it registers a new meta tensor, the one the model
    # ties its output head to as well: tie again outside it (a no-op for untied models).
    model.tie_weights()
    return model


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """``model.to_empty(device=device)``, keeping tied weights one tensor and the buffers
    ``build_meta_model`` computed.

    Plain ``to_empty`` gives each module a new Parameter, so a weight two modules share (the
    input embeddings and the output head under ``tie_word_embeddings``) became two, and loading
    a checkpoint that stores the shared weight once filled only one: a pretrained tied model
    then predicted every token alike (a loss of ln(vocab)). Swapping the new storage into the
    existing Parameter objects keeps one tensor where the model has one (FSDP2's DTensor
    parameters are always swapped so)."""
    built = {name: buf for name, buf in model.named_buffers() if buf.device.type != "meta"}
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in built:
                buf.copy_(built[name])
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated decoder layers of a transformers causal LM: ``model.layers`` (Llama, Qwen,
    Gemma, Phi-3, Mistral, OLMo ...), else the layer list whose class the model names as its
    unit that must not be split (``_no_split_modules``: GPT-2's ``transformer.h``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    units = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if (isinstance(module, nn.ModuleList) and len(module)
                and type(module[0]).__name__ in units):
            return module
    raise ValueError(f"{type(model).__name__} has no list of decoder layers that raylm "
                     f"recognizes (model.layers, or layers of its _no_split_modules "
                     f"{sorted(units)}).")


def canonical_name(name: str) -> str:
    """A parameter's name without the wrappers parallelism adds (activation checkpointing,
    torch.compile) or a LoRA layer puts around a base weight (``base_layer``), so
    initialization sees the model's own names."""
    return (name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
            .replace(".base_layer.", "."))


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(),
                          "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_weights(model: nn.Module, *, seed: int, num_layers: int) -> None:
    """Initialize materialized parameters (full tensors or FSDP DTensor shards).

    Each parameter's full value is drawn on the CPU from a generator seeded by (seed, name),
    then the local part is copied in, so any world size gets the same model. Linear and
    embedding weights ~ N(0, 0.02); the projections that write into the residual stream
    (o_proj, down_proj) are scaled by 1/sqrt(2 * layers) (GPT-2's rule, keeps the residual
    variance flat with depth); norms = 1; biases = 0.
    """
    residual_std = INIT_STD / (2 * num_layers) ** 0.5
    for wrapped_name, param in model.named_parameters():
        name = canonical_name(wrapped_name)
        if ".lora_" in name:
            continue  # adapters have their own rule (raylm.model.lora.init_adapters)
        shape = param.shape
        if name.endswith("norm.weight") or param.ndim == 1 and "norm" in name:
            full = torch.ones(shape)
        elif name.endswith(".bias"):
            full = torch.zeros(shape)
        else:
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
            gen = torch.Generator().manual_seed(_name_seed(seed, name))
            full = torch.empty(shape).normal_(0.0, std, generator=gen)
        copy_full(param, full)
    reset_buffers(model)


@torch.no_grad()
def copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Set ``param`` (a full tensor or this rank's FSDP DTensor shard) from the parameter's
    full value, computed alike on every rank."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements,
                                  src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full.to(param.dtype))


@torch.no_grad()
def reset_buffers(model: nn.Module) -> None:
    """Recompute non-persistent buffers (rotary frequencies) that meta materialization left
    uninitialized."""
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for bname, buf in fresh.named_buffers(recurse=False):
                getattr(module, bname).copy_(buf.to(getattr(module, bname).device))
