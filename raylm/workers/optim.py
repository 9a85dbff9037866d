"""AdamW with the usual parameter groups, built for the device (fused on CUDA); the rate of
each step comes from :mod:`raylm.schedule`."""

from __future__ import annotations

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; never norms, biases or embeddings (a tied output head is the embedding,
    and ``named_parameters`` lists it once under that name)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or "embed" in name or "norm" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    device_type: str) -> torch.optim.AdamW:
    # The fused kernel is one launch for all parameters on CUDA; on CPU the foreach path is
    # the fast one.
    fused = device_type == "cuda"
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=1e-8,
                             fused=fused, foreach=None if fused else True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
