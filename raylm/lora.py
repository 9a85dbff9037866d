"""LoRA adapters through peft, applied to a model that knows nothing of them.

peft's ``inject_adapter_in_model`` replaces each targeted ``nn.Linear`` in place by a LoRA layer
holding the frozen original (``base_layer``) and the trainable ``lora_A``/``lora_B``; the model
keeps its own structure (``model.layers``), so :mod:`raylm.parallelize` shards it unchanged and
each block's adapters live in that block's FSDP2 unit. Adapters are injected on the meta model,
before sharding, and filled after materializing like every other parameter: by a generator
seeded with (seed, name), so any world size gets the same adapters. ``lora_A`` is drawn
uniformly in +-1/sqrt(fan_in) (peft's default Kaiming bound) and ``lora_B`` is zero, so the
adapted model starts as the base model.

Only the trainable parameters (and their optimizer state) go into checkpoints: the base comes
from ``model.path`` on every start, so a checkpoint of a 1B model's rank-16 adapters is tens of
megabytes, not gigabytes.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

ADAPTER_MARK = ".lora_"


def add_adapters(model: nn.Module, *, rank: int, alpha: float, dropout: float,
                 target_modules: list[str]) -> nn.Module:
    """Inject LoRA adapters (on whatever device the model is, meta included) and freeze the
    rest; returns the same model."""
    from peft import LoraConfig, inject_adapter_in_model

    found = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
             if isinstance(m, nn.Linear)}
    missing = sorted(set(target_modules) - found)
    if missing:
        raise ValueError(f"lora.target_modules: {', '.join(missing)} is not a linear layer of "
                         f"this model; it has {', '.join(sorted(found))}.")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=list(target_modules), bias="none")
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
    from raylm.model import canonical_name, copy_full

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
    return {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
            "target_modules": list(lora.target_modules)}


def settings(lora) -> dict:
    """What a checkpoint records of its adapters (a resume must use the same); empty for full
    fine-tuning. Dropout is left out: it may change between invocations."""
    if not lora.rank:
        return {}
    return {"rank": lora.rank, "alpha": lora.alpha,
            "target_modules": sorted(lora.target_modules)}


@torch.no_grad()
def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put the plain linear layer back: the model
    a Hugging Face client loads without peft. Returns the same model."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.base_layer)
    return model
