"""Preference losses: DPO (sigmoid), IPO and SimPO over the log-probabilities of chosen and
rejected answers, as pure functions of per-sequence figures.

Each pair is a prompt with a chosen and a rejected answer; what the model is scored on is the
sum of its log-probabilities of the answer's tokens (``logp``) and, for the length-normalized
losses, their mean (``logp / n``). With a reference model's figures (``ref_*``) the *implicit
reward* of an answer is ``beta * (logp - ref_logp)``, and

==========  ======================================================================================
``sigmoid`` ``-(1 - e) log s(b d) - e log s(-b d)``, ``d = (logp_c - ref_c) - (logp_r - ref_r)``
            (DPO; ``e``: label smoothing, the conservative DPO of Mitchell 2023)
``ipo``     ``(d / n - 1 / (2 b))^2`` with each log-ratio divided by its answer's length
            (IPO's squared loss; the per-token form its authors use, as TRL does)
``simpo``   ``-(1 - e) log s(b (m_c - m_r) - g) - e log s(-(b (m_c - m_r) - g))``, ``m``: mean
            log-probability of the answer, ``g``: the margin ``simpo_gamma`` (no reference)
==========  ======================================================================================

Every function returns per-pair values: the caller sums them and divides by the number of pairs
in the *global* batch, so that accumulation and worker counts give the same update.

Written by hand (a few lines each): TRL computes these inside its trainers' loss methods, which
need its whole trainer; tests check these against TRL's on the same figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSSES = ("sigmoid", "ipo", "simpo")
NEEDS_REFERENCE = {"sigmoid": True, "ipo": True, "simpo": False}


@dataclass(frozen=True)
class Answers:
    """Per-pair figures of the chosen and rejected answers: summed log-probabilities and
    answer lengths (trained targets)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_len: torch.Tensor
    rejected_len: torch.Tensor


def pair_losses(policy: Answers, reference: Answers | None, *, loss: str, beta: float,
                label_smoothing: float = 0.0, simpo_gamma: float = 0.0
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses, and per-pair figures for reports: ``chosen_reward``,
    ``rejected_reward`` (the implicit rewards; for SimPO, ``beta`` x mean log-probability),
    ``margin`` (chosen less rejected reward), ``accuracy`` (1.0 where the chosen answer's
    reward is higher)."""
    if loss not in LOSSES:
        raise ValueError(f"dpo.loss: unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
    if NEEDS_REFERENCE[loss] and reference is None:
        raise ValueError(f"the {loss} loss needs the reference model's log-probabilities")
    if loss == "simpo":
        chosen = beta * policy.chosen / policy.chosen_len.clamp(min=1)
        rejected = beta * policy.rejected / policy.rejected_len.clamp(min=1)
        z = chosen - rejected - simpo_gamma
        losses = smoothed(z, label_smoothing)
    else:
        chosen_ratio = policy.chosen - reference.chosen
        rejected_ratio = policy.rejected - reference.rejected
        chosen, rejected = beta * chosen_ratio, beta * rejected_ratio
        if loss == "sigmoid":
            losses = smoothed(chosen - rejected, label_smoothing)
        else:  # ipo
            d = (chosen_ratio / policy.chosen_len.clamp(min=1)
                 - rejected_ratio / policy.rejected_len.clamp(min=1))
            losses = (d - 1 / (2 * beta)) ** 2
    chosen, rejected = chosen.detach(), rejected.detach()
    return losses, {"chosen_reward": chosen, "rejected_reward": rejected,
                    "margin": chosen - rejected, "accuracy": (chosen > rejected).float()}


def smoothed(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """``-log s(z)``, with ``label_smoothing`` of the pairs taken to be the other way round."""
    out = -F.logsigmoid(z)
    if label_smoothing:
        out = (1 - label_smoothing) * out - label_smoothing * F.logsigmoid(-z)
    return out


def answer_logps(logits: torch.Tensor, targets: torch.Tensor, segments: torch.Tensor, *,
                 num_segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed log-probability of each answer's trained targets, and their count.
    ``segments`` (B, T): for each target, the index of the answer it belongs to across the
    batch, or -1 for a target that is not trained (prompt, padding). fp32 log-softmax."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    token = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    trained = segments >= 0
    index, values = segments[trained], token[trained]
    zeros = torch.zeros(num_segments, dtype=torch.float32, device=logits.device)
    return zeros.index_add(0, index, values), zeros.index_add(0, index, torch.ones_like(values))
