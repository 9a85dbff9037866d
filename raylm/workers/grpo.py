"""Group-relative policy optimization (GRPO) and its variants, DAPO and Dr. GRPO: the
advantages of a batch of rollouts and the clipped policy loss of its completions' tokens, as
pure functions.

A prompt is answered ``group_size`` times; each completion's reward less its group's mean
(divided by the group's standard deviation unless ``normalize`` is off, as Dr. GRPO argues
it biases towards easy and hard prompts) is the advantage of every one of its tokens. Token
``t`` of a completion trains on ``-min(r A, clip(r, 1 - e_low, 1 + e_high) A)``, ``r =
exp(logp - old_logp)``: the policy's probability of the token over the one it had when the
completion was sampled (the generating weights' figure, so a completion a few versions old is
weighed by importance). DAPO's "clip higher" is ``e_high > e_low``. With a reference model,
``kl_coef`` times the k3 estimate of KL(policy || reference), ``exp(ref - logp) - (ref -
logp) - 1``, is added per token.

How tokens are averaged is the variants' other difference (``aggregation``):

============  ==============================================================================
``token``     every completion token of the step weighs alike (DAPO): sum / tokens
``sequence``  each completion's mean, then the mean over completions (GRPO as published):
              long completions' tokens weigh less
``constant``  sum / (completions x the longest completion allowed) (Dr. GRPO): no length
              bias, and the same scale at every step
============  ==============================================================================

Tokens come flat, each with the index of its completion, as the preference losses score
answers (:func:`raylm.workers.preference.trained`); the denominators are global, counted over
every rank's share of the step, so accumulation and worker counts give the same update.
Written by hand (a few lines each): TRL computes these inside its trainer's loss method;
tests check them against a dense, per-completion formulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token", "sequence", "constant"]
# Added to a group's standard deviation: a group whose rewards differ by a hair does not
# turn it into advantages of thousands.
STD_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, *, group_size: int, normalize: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage (``rewards``: (groups x group_size,), a group's
    completions consecutive), and per group whether its completions all scored alike (it
    teaches nothing: every advantage 0)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not make groups of {group_size}")
    groups = rewards.float().view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    alike = groups.amax(dim=1) == groups.amin(dim=1)
    if normalize and group_size > 1:
        centered = centered / (groups.std(dim=1, keepdim=True) + STD_EPS)
    return centered.reshape(-1), alike


@dataclass(frozen=True)
class Clip:
    """The ratio's clip range: ``[1 - low, 1 + high]``."""

    low: float = 0.2
    high: float = 0.2


def token_losses(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
                 clip: Clip, ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per token (flat tensors, ``advantages`` already each token's completion's): the loss
    with its graph, and detached 0/1 or value figures per token: ``clipped_low`` (a token
    whose ratio fell under the range where its advantage is negative: the clip held it),
    ``clipped_high`` (above, where positive), ``kl`` (0 without a reference)."""
    ratio = torch.exp(logp - old_logp)
    kept = torch.clamp(ratio, 1 - clip.low, 1 + clip.high)
    loss = -torch.minimum(ratio * advantages, kept * advantages)
    kl = torch.zeros_like(loss)
    if ref_logp is not None and kl_coef:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1
        loss = loss + kl_coef * kl
    with torch.no_grad():
        figures = {"clipped_low": ((ratio < 1 - clip.low) & (advantages < 0)).float(),
                   "clipped_high": ((ratio > 1 + clip.high) & (advantages > 0)).float(),
                   "kl": kl.detach()}
    return loss, figures


def token_weights(index: torch.Tensor, lengths: torch.Tensor, *, aggregation: Aggregation,
                  max_tokens: int) -> tuple[torch.Tensor, float]:
    """Each token's weight in its share of the loss's sum (``index``: each token's
    completion, ``lengths``: each completion's tokens), and what these completions add to the
    global denominator the sum is divided by."""
    completions = lengths.numel()
    if aggregation == "token":
        return torch.ones(index.numel(), device=index.device), float(lengths.sum())
    if aggregation == "sequence":
        return 1.0 / lengths.float().clamp(min=1).index_select(0, index), float(completions)
    if aggregation == "constant":
        return torch.ones(index.numel(), device=index.device), float(completions * max_tokens)
    raise ValueError(f"aggregation={aggregation!r}: token, sequence or constant")
