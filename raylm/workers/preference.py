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

Every function returns per-pair values: :func:`preference_step` sums them and divides by the
number of pairs in the *global* batch, so that accumulation and worker counts give the same
update.

Pairs arrive packed (:mod:`raylm.data.packing`): each pair is two consecutive documents of a
block, the prompt and chosen answer then the prompt and rejected answer, with the chosen
answer's trained targets marked 1 in the loss mask and the rejected answer's 2. Documents do
not attend to each other, so one forward scores both answers of every pair in the block.

The reference model is never a second copy in memory. With LoRA it is the policy with its
adapters switched off (:func:`raylm.model.lora.adapters_off`); a full fine-tune reads the
starting weights' log-probabilities of every trained target, computed once before training
by the reference pass (:mod:`raylm.run.reference`, :func:`reference_logps`) and streamed
beside the blocks. SimPO needs none.

Written by hand (a few lines each): TRL computes these inside its trainers' loss methods, which
need its whole trainer and a second model; tests check these against TRL's on the same
figures.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F

from raylm.config import DpoConfig, PreferenceLoss
from raylm.contracts import REFERENCE_COLUMN
from raylm.model.assemble import Built, answer_rows, global_count, row_logps
from raylm.model.lora import adapters_off
from raylm.workers.metrics import flops_per_token
from raylm.workers.step import Objective, apply_update, clip_grad_norm

if TYPE_CHECKING:
    from raylm.workers.health import Health

LOSSES = get_args(PreferenceLoss)


@dataclass(frozen=True)
class Answers:
    """Per-pair figures of the chosen and rejected answers: summed log-probabilities and
    answer lengths (trained targets)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_len: torch.Tensor
    rejected_len: torch.Tensor


def pair_losses(policy: Answers, reference: Answers | None, objective: DpoConfig
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses, and per-pair figures for reports: ``chosen_reward``,
    ``rejected_reward`` (the implicit rewards; for SimPO, ``beta`` x mean log-probability),
    ``margin`` (chosen less rejected reward), ``accuracy`` (1.0 where the chosen answer's
    reward is higher). ``objective``: the loss and its settings (the config's dpo
    section)."""
    loss, beta = objective.loss, objective.beta
    label_smoothing, simpo_gamma = objective.label_smoothing, objective.simpo_gamma
    if loss not in LOSSES:
        raise ValueError(f"dpo.loss: unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
    if objective.needs_reference and reference is None:
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


def trained(segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat positions of a batch's trained targets, and the answer each belongs to."""
    flat = segments.reshape(-1)
    at = torch.nonzero(flat >= 0).squeeze(1)
    return at, flat[at]


def segment_sums(values: torch.Tensor, index: torch.Tensor, *, num_segments: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per answer: the sum of its targets' ``values`` and their count."""
    index = index.to(values.device, non_blocking=True)
    zeros = torch.zeros(num_segments, dtype=torch.float32, device=values.device)
    return zeros.index_add(0, index, values), zeros.index_add(0, index, torch.ones_like(values))


# Per-pair figures reported, as global means over the step's pairs.
FIGURES = ("chosen_reward", "rejected_reward", "margin", "accuracy", "chosen_logp",
           "rejected_logp")


def answer_segments(position_ids: torch.Tensor, loss_mask: torch.Tensor
                    ) -> tuple[torch.Tensor, int]:
    """For each target of a batch of packed pairs (``[:, 1:]`` of the blocks), the index of
    the answer it belongs to (``2 p`` for pair ``p``'s chosen answer, ``2 p + 1`` for its
    rejected one, pairs numbered across the batch) or -1; and the number of pairs. The blocks'
    documents are pairs' halves, chosen then rejected (the padding closing a block is a
    document of its own with no trained target)."""
    starts = (position_ids == 0).to(torch.int64)
    doc = starts.cumsum(dim=1) - 1
    pair_in_row = doc // 2
    rows = int(position_ids.size(0))
    mask = loss_mask.to(torch.int64)
    pairs_per_row = torch.where(mask > 0, pair_in_row + 1, 0).amax(dim=1)
    offset = torch.cumsum(pairs_per_row, 0) - pairs_per_row
    segment = 2 * (pair_in_row + offset.view(rows, 1)) + (mask - 1)
    segment = torch.where(mask > 0, segment, -1)
    return segment[:, 1:], int(pairs_per_row.sum())


def numbered(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """:func:`answer_segments` of a batch of packed pairs."""
    return answer_segments(batch["position_ids"], batch["loss_mask"])


def scored(built: Built, batch: dict[str, torch.Tensor], segments: torch.Tensor,
           pairs: int) -> Answers:
    """The model's summed log-probabilities of each pair's answers in ``batch``. Which
    positions are trained is worked out where ``segments`` is (the host, in training):
    selecting by a mask on the GPU would wait for it to count the mask."""
    at, index = trained(segments)
    rows, at = answer_rows(built, batch, at)
    if rows.device.type == "cuda" and index.device.type == "cpu":
        index = index.pin_memory()
    sums, counts = segment_sums(row_logps(rows, batch["input_ids"][:, 1:], at), index,
                                num_segments=2 * pairs)
    return Answers(sums[0::2], sums[1::2], counts[0::2], counts[1::2])


def reference_sums(ref_logp: torch.Tensor, segments: torch.Tensor, pairs: int, *,
                   device: torch.device) -> Answers:
    """The reference's summed log-probabilities of each pair's answers, from the per-target
    figures the reference pass stored beside the blocks (``ref_logp``, (B, T) on the host,
    beside ``segments``): summed as :func:`scored` sums the policy's."""
    at, index = trained(segments)
    sums, counts = segment_sums(ref_logp.reshape(-1).index_select(0, at).float(), index,
                                num_segments=2 * pairs)
    sums, counts = sums.to(device, non_blocking=True), counts.to(device, non_blocking=True)
    return Answers(sums[0::2], sums[1::2], counts[0::2], counts[1::2])


@torch.no_grad()
def reference_logps(built: Built, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the reference pass stores for a batch of packed pairs: (B, T) fp32 on the host,
    each trained target's log-probability under ``built`` (0 for the others)."""
    segments = batch["loss_mask"][:, 1:].to(torch.int64) - 1
    at, _ = trained(segments)
    rows, on = answer_rows(built, batch, at)
    values = row_logps(rows, batch["input_ids"][:, 1:], on).cpu()
    out = torch.zeros(segments.numel(), dtype=torch.float32)
    out[at] = values
    return out.view(segments.shape)


def pair_terms(built: Built, batch: dict[str, torch.Tensor], objective: DpoConfig, *,
               segments: tuple[torch.Tensor, int] | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The summed loss of ``batch``'s pairs (with its graph) and the sums of their figures;
    ``segments``: the batch's :func:`numbered`, where the caller has it already. The reference
    is the stored one where the batch carries it (``ref_logp``: full fine-tuning), else the
    model with its adapters switched off."""
    segments, pairs = segments if segments is not None else numbered(batch)
    reference = None
    if objective.needs_reference:
        if REFERENCE_COLUMN in batch:
            reference = reference_sums(batch[REFERENCE_COLUMN], segments, pairs,
                                       device=built.device)
        else:
            with torch.no_grad(), adapters_off(built.model):
                reference = scored(built, batch, segments, pairs)
    policy = scored(built, batch, segments, pairs)
    losses, figures = pair_losses(policy, reference, objective)
    figures = figures | {"chosen_logp": policy.chosen.detach(),
                         "rejected_logp": policy.rejected.detach()}
    return losses.sum(), {k: v.sum() for k, v in figures.items()}


def preference_step(built: Built, optimizer: torch.optim.Optimizer,
                    micro_batches: Iterable[dict[str, torch.Tensor]], *, accumulation: int,
                    objective: DpoConfig, grad_clip: float, health: Health | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One optimizer step over ``accumulation`` micro-batches of packed pairs; returns (the
    loss averaged over the global batch's pairs, the gradient norm before clipping, each of
    :data:`FIGURES` averaged over those pairs) as 0-d device tensors, nothing read back.

    Each micro-batch's summed pair losses are scaled by world / (the global batch's pairs)
    before its backward: FSDP2 averages gradients over the ranks, so the update is the mean
    over every pair of the step whatever the accumulation and worker count."""
    micro_batches = list(micro_batches)
    if len(micro_batches) != accumulation:
        raise RuntimeError(f"expected {accumulation} micro-batches, got {len(micro_batches)}")
    if built.pipeline is not None:
        raise ValueError("train.objective=dpo does not run under pipeline parallelism")
    world = dist.get_world_size() if dist.is_initialized() else 1
    each = [numbered(batch) for batch in micro_batches]
    count = global_count(sum(pairs for _, pairs in each), built.device).float()
    total = torch.zeros(1 + len(FIGURES), device=built.device)
    for batch, segments in zip(micro_batches, each, strict=True):
        loss_sum, figures = pair_terms(built, batch, objective, segments=segments)
        with built.attention.context():  # activation checkpointing recomputes here
            (loss_sum * world / count).backward()
        total += torch.stack([loss_sum.detach(), *(figures[k] for k in FIGURES)])
    if dist.is_initialized():
        dist.all_reduce(total)
    means = total / count
    norm = clip_grad_norm(built.model, grad_clip)
    apply_update(optimizer, health.check(means[0], norm) if health is not None else None)
    return means[0].detach(), norm.detach(), dict(zip(FIGURES, means[1:], strict=True))


@torch.no_grad()
def preference_evaluate(built: Built, batches: Iterable[dict[str, torch.Tensor]],
                        objective: DpoConfig) -> dict[str, float]:
    """The loss and :data:`FIGURES` averaged over every pair of ``batches`` on every rank
    (all call it): ``val_loss``, ``val_accuracy`` (the share of pairs whose chosen answer has
    the higher reward) ... ; NaN where the validation split holds no pair."""
    built.model.eval()
    total = torch.zeros(2 + len(FIGURES), device=built.device)
    for batch in batches:
        segments = numbered(batch)
        loss_sum, figures = pair_terms(built, batch, objective, segments=segments)
        pairs = segments[1]
        total += torch.stack([loss_sum, *(figures[k] for k in FIGURES),
                              torch.full((), float(pairs), device=built.device)])
    built.model.train()
    if dist.is_initialized():
        dist.all_reduce(total)
    n = float(total[-1])
    values = (total[:-1] / n).tolist() if n else [float("nan")] * (1 + len(FIGURES))
    return {f"val_{k}": v for k, v in zip(("loss", *FIGURES), values, strict=True)}


class Preference(Objective):
    """A preference loss over packed pairs (``train.objective=dpo``): the loop's objective, as
    :class:`raylm.workers.step.NextToken` is for next-token training."""

    checks_first_prediction = False  # pairs, not text to predict

    def __init__(self, dpo: DpoConfig, *, adapters: bool) -> None:
        self.dpo = dpo
        # With adapters the reference is the policy with them off, scored in the step: 2 of
        # the 6 FLOPs per parameter again (a full fine-tune's was scored before training).
        self.flops_factor = 4 / 3 if dpo.needs_reference and adapters else 1

    def step(self, built, optimizer, micro, *, accumulation, grad_clip, health=None):
        loss, norm, figures = preference_step(built, optimizer, micro, accumulation=accumulation,
                                              objective=self.dpo, grad_clip=grad_clip,
                                              health=health)
        return loss, norm, {f"dpo_{k}": v for k, v in figures.items()}

    def evaluate(self, built, batches) -> dict[str, float]:
        return preference_evaluate(built, batches, self.dpo)

    def flops(self, config, seq_len: int) -> float:
        return flops_per_token(config, seq_len) * self.flops_factor
