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

import collections
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from raylm import storage
from raylm.config import Config
from raylm.contracts import CHECKPOINT_ROLLOUTS, PROMPT_ROW, Malformed
from raylm.contracts.rollouts import Group, Prompt, Sampling, SavedRollouts, unfit
from raylm.data.corpus import PREPARED_MANIFEST
from raylm.data.streams import PackedSplit
from raylm.data.tokenizer import load_backend
from raylm.faults import Mistake
from raylm.model.assemble import Built, answer_rows, global_count, row_logps
from raylm.rollout.buffer import Buffer
from raylm.rollout.generator import Generator
from raylm.rollout.pool import GeneratorPool
from raylm.rollout.rewards import check_step, split_row
from raylm.workers.metrics import flops_per_token
from raylm.workers.step import Objective, apply_update, clip_grad_norm

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


# ---- The step: prompts in, completions generated beside the trainers, one update ----------

def prompt_tokens(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    """Each block's prompt (a block holds one prompt, then padding: the second document)."""
    out = []
    for tokens, positions in zip(batch["input_ids"], batch["position_ids"], strict=True):
        starts = torch.nonzero(positions[1:] == 0)
        n = int(starts[0]) + 1 if len(starts) else len(positions)
        out.append(tokens[:n].tolist())
    return out


@dataclass(frozen=True)
class Rollouts:
    """A micro-batch of completions, each after its prompt in a row of its own (padding after
    it a document of its own): the flat target positions of the completions' tokens
    (``at``), each one's completion (``index``), their sampling log-probabilities, each
    completion's advantage and length, and the tokens' reference log-probabilities (with a KL
    penalty)."""

    batch: dict[str, torch.Tensor]
    at: torch.Tensor
    index: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    lengths: torch.Tensor
    ref_logp: torch.Tensor | None = None


def rollout_batch(groups: list[Group], advantages: torch.Tensor, *, pad_id: int) -> Rollouts:
    """The rows of ``groups``' completions (``advantages``: one per completion, in order)."""
    seqs, prompt_lens, old, ref, lengths = [], [], [], [], []
    for g in groups:
        for k, (completion, logps) in enumerate(zip(g.completions, g.logps, strict=True)):
            seqs.append(g.prompt_ids + completion)
            prompt_lens.append(len(g.prompt_ids))
            old.extend(logps)
            if g.ref_logps is not None:
                ref.extend(g.ref_logps[k])
            lengths.append(len(completion))
    width = max(len(s) for s in seqs) + 1  # a padding token closes every row
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(seqs), width), dtype=torch.long)
    at, index = [], []
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = torch.tensor(s)
        positions[i, :len(s)] = torch.arange(len(s))
        positions[i, len(s):] = torch.arange(width - len(s))
        # Targets are tokens[1:]: completion token j of row i is target prompt_len - 1 + j.
        first = i * (width - 1) + prompt_lens[i] - 1
        at.extend(range(first, first + lengths[i]))
        index.extend([i] * lengths[i])
    # Reference log-probabilities only where every completion has them: a micro-batch mixing
    # completions kept from before rl.kl_coef was set has none (the step says so).
    return Rollouts({"input_ids": tokens, "position_ids": positions}, torch.tensor(at),
                    torch.tensor(index), torch.tensor(old), advantages, torch.tensor(lengths),
                    torch.tensor(ref) if ref and len(ref) == len(old) else None)


class PromptRows:
    """The data rows behind prompt blocks (rank 0), as preparation stored them beside each
    prompt's tokens (:data:`raylm.contracts.PROMPT_ROW`): nothing outside the prepared
    directory is read. A row group's rows are read when one of its prompts is first asked for,
    and the last :attr:`GROUPS` row groups read are kept (a step's prompts come from a few
    row groups of the sample order's window)."""

    GROUPS = 8

    def __init__(self, prepared: str, split: str, *, prompt_field: str) -> None:
        self.split = PackedSplit.load(prepared, split)
        self.prompt_field = prompt_field
        self.groups: dict[int, list[str]] = {}

    def prompt(self, row: int, position: int, ids: list[int]) -> Prompt:
        group, index = self.split.row_group_of(row)
        if group not in self.groups:
            if len(self.groups) >= self.GROUPS:
                del self.groups[next(iter(self.groups))]
            self.groups[group] = self.split.column_of_group(group, PROMPT_ROW)
        prompt, columns = split_row(json.loads(self.groups[group][index]),
                                    prompt_field=self.prompt_field)
        return Prompt(position, ids, prompt, columns)


def to_rank0(items: list) -> list | None:
    """Every rank's ``items``, concatenated in rank order, on rank 0 (None elsewhere)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(items)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(items, gathered, dst=0)
    return [x for part in gathered for x in part] if gathered is not None else None


def from_rank0(shares: list[list] | None) -> list:
    """Rank ``r``'s share of what rank 0 holds (``shares``: one list per rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return shares[0]
    out = [None]
    dist.scatter_object_list(out, shares, src=0)
    return out[0]


def trainable_weights(model: torch.nn.Module, *, host: bool = True
                      ) -> dict[str, torch.Tensor]:
    """The trainable parameters whole, on the host where ``host`` (the rank that hands them
    over), else none. Every rank calls it: FSDP2's shards are gathered one parameter at a
    time, and a rank that does not send them frees each as soon as it is gathered."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            if host:
                out[name] = whole.detach().cpu()
    return out


def group_figures(groups: list[Group], alike: torch.Tensor) -> dict[str, float]:
    """The step's figures of its completions (rank 0 holds every group): means over them,
    the longest, sums of failures and of the seconds spent scoring, the weight versions."""
    rewards = torch.tensor([r for g in groups for r in g.rewards])
    lengths = torch.tensor([len(c) for g in groups for c in g.completions], dtype=torch.float)
    parts = sorted({name for g in groups for name in g.parts})
    figures = {
        "reward": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
        "no_signal": float(alike.float().mean()),
        "completion_len": float(lengths.mean()), "completion_len_max": float(lengths.max()),
        "truncated": sum(t for g in groups for t in g.truncated) / len(lengths),
        "reward_failures": float(sum(g.failed for g in groups)),
        "reward_s": sum(g.seconds.get("reward_s", 0.0) for g in groups),
        "sampling_s": sum(g.seconds.get("generate_s", 0.0) for g in groups),
        "weight_version_min": float(min(g.version for g in groups)),
        "weight_version_max": float(max(g.version for g in groups))}
    for name in parts if parts != ["reward"] else []:
        figures[f"reward_{name}"] = float(torch.tensor(
            [v for g in groups for v in g.parts.get(name, [0.0] * len(g.rewards))]).mean())
    return figures


# Distinct reward errors said on the console in a worker group's life; the count of failures
# is in every report (rl_reward_failures) whatever their number.
ERRORS_SAID = 5


def reward_warning(groups: list[Group], *, step: int, said: set[str]) -> str | None:
    """A line for the console when the step's reward function failed on some completions
    with an error not said before (at most :data:`ERRORS_SAID`), else None."""
    failed = [g for g in groups if g.failed]
    first = failed[0].first_error if failed else None
    if first is None or first in said or len(said) >= ERRORS_SAID:
        return None
    said.add(first)
    last = "; later errors are counted, not said" if len(said) == ERRORS_SAID else ""
    return (f"raylm: warning: rl.reward failed on {sum(g.failed for g in failed)} "
            f"completion(s) of step {step}, each scored 0 (rl_reward_failures counts them): "
            f"{first}{last}")


class Upcoming:
    """The training stream with the micro-batches of the steps ahead in view: an off-policy
    run asks for its prompts' groups steps before it trains on them. Iterating it gives the
    stream's micro-batches in their order, the ones looked at included."""

    def __init__(self, batches: Iterator[dict[str, torch.Tensor]], *, per_step: int) -> None:
        self.batches, self.per_step = batches, per_step
        self.held: collections.deque = collections.deque()

    def __iter__(self) -> Upcoming:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.held.popleft() if self.held else next(self.batches)

    def ahead(self, k: int) -> list[dict[str, torch.Tensor]]:
        """The micro-batches of the ``k``-th step after the one being trained (k >= 1)."""
        while len(self.held) < k * self.per_step:
            self.held.append(next(self.batches))
        return list(itertools.islice(self.held, (k - 1) * self.per_step, k * self.per_step))


def prompt_items(micro: list[dict[str, torch.Tensor]]) -> list[tuple[int, int, list[int]]]:
    """(stored row, sample position, prompt tokens) of each block of ``micro``."""
    return [(int(r), int(p), ids) for b in micro
            for r, p, ids in zip(b["row"], b["sample_position"], prompt_tokens(b), strict=True)]


class Reinforce(Objective):
    """GRPO over completions sampled beside the trainers (``train.objective=grpo``): the loop's
    objective, as :class:`raylm.workers.preference.Preference` is for DPO. Off-policy
    (``rl.max_staleness`` K > 0), each step asks for the groups of the step K ahead before it
    trains, so that they are generated while it does (:class:`raylm.rollout.buffer.Buffer`).

    Colocated (``rl.generators=0``), each rank samples its own share of the step's groups
    with a :class:`raylm.rollout.generator.Generator` of its own, in its process and on its
    device, loaded with the weights it trains after each update: the code, seeds and weights
    of an actor's, so its groups are the ones an actor would sample, token for token. That
    generator holds a plain copy of the model (the weights gathered whole, as an actor's
    are), besides the trainer's shards: the model's size again in memory."""

    checks_first_prediction = False  # prompts, not text to predict

    def __init__(self, cfg: Config, *, prepared: str, eos_id: int, vocab_size: int,
                 rank: int, keeper=None) -> None:
        rl = self.rl = cfg.rl
        self.sampling = Sampling(rl.group_size, rl.temperature, rl.top_p,
                                 rl.max_completion_tokens)
        self.clip, self.eos_id, self.rank = Clip(rl.clip_low, rl.clip_high), eos_id, rank
        self.init = dict(config=cfg.to_dict(), vocab_size=vocab_size, eos_id=eos_id,
                         reward=rl.reward, prepared=prepared)
        self.rows = ({s: PromptRows(prepared, s, prompt_field=cfg.data.prompt_field)
                      for s in ("train", "val")} if rank == 0 else {})
        self.steps = cfg.train.steps
        self.start_timeout_s = cfg.data.first_batch_timeout_s
        self.wait_for_nodes = cfg.scaling.wait_for_nodes
        self.pool: GeneratorPool | None = None
        self.keeper = keeper  # the owner of the generators (raylm.rollout.keeper), the driver's
        self.local: Generator | None = None  # colocated: this rank's own
        self.buffer: Buffer | None = None
        self.upcoming: Upcoming | None = None
        self.version = self.at = 0
        self.asked = -1  # the last step whose prompts' groups were asked for
        self.tokens = 0  # the last step's rows' tokens, every rank's (the loop counts them)
        self.errors_said: set[str] = set()
        self.seconds: dict[str, float] = {}
        # Since the group started (rank 0's): the goodput account's own causes for the time
        # steps wait for completions and hand weights over (raylm.workers.loop.StepMeter).
        self.spent = {"generate_s": 0.0, "transfer_s": 0.0}

    def begin(self, built: Built, *, step: int, batches: Iterator[dict[str, torch.Tensor]],
              accumulation: int, resumed: str | None) -> Iterator[dict[str, torch.Tensor]]:
        """At the group's start (every rank): the generators, holding the weights the group
        starts from, and the rollouts the checkpoint ``resumed`` kept; returns the training
        stream to draw from."""
        weights = None if self.rl.colocated else self.weights(built)
        self.version = self.at = step
        self.asked = step - 1
        init = dict(self.init)
        tokenizer = [None]
        if self.rank == 0:
            manifest = json.loads((Path(init.pop("prepared")) / PREPARED_MANIFEST).read_text())
            tokenizer[0] = load_backend(manifest["tokenizer_path"], self.init["config"]["model"]
                                        ["path"])[0].to_str()
        if self.rl.colocated:
            if dist.is_initialized():  # the prepared directory may be rank 0's alone
                dist.broadcast_object_list(tokenizer, src=0)
            init.pop("prepared", None)
            self.local = Generator(**init, tokenizer_json=tokenizer[0], threads=None,
                                   device=built.device, built=built)
            self.local.load(step, None)
            return batches
        if self.rank == 0:
            self.pool = GeneratorPool(
                count=self.rl.generator_range, resources=self.rl.generator_resources,
                init={**init, "tokenizer_json": tokenizer[0],
                      "threads": int(self.rl.generator_resources.get("CPU", 1) or 1)},
                keep=self.rl.max_staleness + 1, timeout_s=self.start_timeout_s,
                keep_waiting=self.wait_for_nodes, keeper=self.keeper)
            self.pool.load(step, weights)
            self.pool.started()  # before the group reports its start
            kept = storage.join(resumed, CHECKPOINT_ROLLOUTS) if resumed else None
            self.buffer = Buffer(self.pool, ready=self.kept_groups(
                kept, step=step, vocab_size=built.config.vocab_size))
        if dist.is_initialized():  # every rank looks as far ahead as rank 0 has asked
            agreed = [self.asked]
            dist.broadcast_object_list(agreed, src=0)
            self.asked = agreed[0]
        if not self.rl.max_staleness:
            return batches
        self.upcoming = Upcoming(batches, per_step=accumulation)
        return self.upcoming

    def weights(self, built: Built) -> dict[str, torch.Tensor]:
        """The trainable weights whole on rank 0, which hands them to the generators (every
        rank joins the gathering)."""
        return trainable_weights(built.model, host=self.rank == 0)

    def kept_groups(self, path: str | None, *, step: int, vocab_size: int
                    ) -> dict[int, Group]:
        """The groups a checkpoint's ``rollouts.json`` at ``path`` kept, by position (rank 0;
        none where there is no such file), and the last step they were asked for; ``step``:
        the checkpoint's, ``vocab_size``: the model's embeddings (which sampling draws from,
        and a tokenizer may use fewer of). Groups
        sampled otherwise than this run samples (a changed ``rl.group_size``, temperature,
        top_p or completion length) are not trained as if they were: they are sampled again,
        and the console says so."""
        if not path or not storage.is_file(path):
            return {}
        try:
            saved = SavedRollouts.from_json(storage.read_bytes(path))
        except Malformed as e:
            raise Mistake(f"{path}: {e}") from None
        if saved.sampling is not None and saved.sampling != self.sampling:
            changed = ", ".join(saved.sampling.differences(self.sampling))
            print(f"raylm: warning: the {len(saved.groups)} groups {path} kept were sampled "
                  f"otherwise than this run samples ({changed}): they are sampled again")
            return {}
        wrong = unfit(saved.groups, vocab_size=vocab_size,
                      group_size=self.sampling.group_size, step=step)
        if wrong:
            raise Mistake(f"{path}: {wrong}: not rollouts this run kept, or damaged; resume "
                          f"from another checkpoint")
        self.asked = saved.through_step
        return {g.position: g for g in saved.groups}

    def saved(self) -> dict[str, bytes]:
        """What a checkpoint keeps of the rollouts: those asked for and not trained on
        (off-policy runs; rank 0)."""
        if self.buffer is None or not self.rl.max_staleness:
            return {}
        return {CHECKPOINT_ROLLOUTS: self.buffer.saved(through_step=self.asked,
                                                       sampling=self.sampling)}

    def groups(self, micro: list[dict[str, torch.Tensor]], sampling: Sampling, split: str,
               ahead: list[list[dict[str, torch.Tensor]]] = ()
               ) -> tuple[list[Group], list[Group] | None]:
        """This rank's prompts' groups, from the buffer (training) or generated now
        (validation); and on rank 0, every rank's. ``ahead``: the micro-batches of the steps
        whose groups are asked for now, to be trained later."""
        if self.local is not None:
            return self.own_groups(micro, sampling, split)
        every = to_rank0([(prompt_items(micro), [x for m in ahead for x in prompt_items(m)])])
        shares, groups = None, None
        if every is not None:
            prompts = [[self.rows[split].prompt(*item) for item in now] for now, _ in every]
            flat = [p for share in prompts for p in share]
            t0 = time.perf_counter()
            if split == "train":
                groups = self.buffer.take(flat, sampling)
                self.buffer.ask([self.rows[split].prompt(*item)
                                 for _, later in every for item in later], sampling)
                self.spent["generate_s"] += time.perf_counter() - t0
            else:
                groups = self.pool.generate(flat, sampling)
            self.seconds["generate_s"] = time.perf_counter() - t0
            starts = np.cumsum([0, *map(len, prompts)])
            # With each share, the tokens of every row the step trains (prompt and
            # completion), which every rank counts its throughput and tokens_seen by.
            rows = sum(len(g.prompt_ids) + len(c) for g in groups for c in g.completions)
            shares = [(rows, groups[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True)]
        rows, mine = from_rank0(shares)
        if split == "train":
            self.tokens = rows
        return mine, groups

    def own_groups(self, micro: list[dict[str, torch.Tensor]], sampling: Sampling, split: str
                   ) -> tuple[list[Group], list[Group] | None]:
        """:meth:`groups`, colocated: rank 0 reads every rank's prompts' rows and hands each
        rank its prompts; each samples and scores its own with its generator (its RNG state
        kept: sampling seeds its own generator by prompt position), and rank 0 gathers the
        groups for the step's figures."""
        every = to_rank0([prompt_items(micro)])
        prompts = None
        if every is not None:
            prompts = [[self.rows[split].prompt(*item) for item in share] for share in every]
        t0 = time.perf_counter()
        device = self.local.built.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            mine = self.local.generate(from_rank0(prompts), sampling,
                                       version=self.local.version)
        groups = to_rank0(mine)
        if split == "train":
            self.tokens = int(global_count(sum(len(g.prompt_ids) + len(c) for g in mine
                                               for c in g.completions), device))
            self.spent["generate_s"] += time.perf_counter() - t0
        self.seconds["generate_s"] = time.perf_counter() - t0
        return mine, groups

    def steps_ahead(self) -> list[list[dict[str, torch.Tensor]]]:
        """The micro-batches of the steps to ask for now: those up to ``rl.max_staleness``
        after this one that were not asked for yet (every rank alike)."""
        last = min(self.at + self.rl.max_staleness, self.steps - 1)
        out = [self.upcoming.ahead(j - self.at) for j in range(max(self.asked, self.at) + 1,
                                                                last + 1)]
        self.asked = max(self.asked, last)
        return out

    def update(self, built: Built, groups: list[Group], advantages: torch.Tensor, *,
               accumulation: int) -> torch.Tensor:
        """One update's gradients over ``groups`` (this rank's share), in ``accumulation``
        micro-batches; returns, summed over every rank: the loss's sum, tokens clipped low
        and high, the KL's sum, the tokens, and the loss's denominator."""
        rl = self.rl
        world = dist.get_world_size() if dist.is_initialized() else 1
        per_micro = max(1, len(groups) // accumulation)
        batches, k = [], 0
        for i in range(0, len(groups), per_micro):
            part = groups[i:i + per_micro]
            n = sum(len(g.completions) for g in part)
            batches.append(rollout_batch(part, advantages[k:k + n], pad_id=self.eos_id))
            k += n
        local, weights = 0.0, []
        for b in batches:
            w, d = token_weights(b.index, b.lengths, aggregation=rl.aggregation,
                                 max_tokens=rl.max_completion_tokens)
            weights.append(w)
            local += d
        denominator = global_count(local, built.device).float()  # type: ignore[arg-type]
        total = torch.zeros(5, device=built.device)
        for b, w in zip(batches, weights, strict=True):
            rows, at = answer_rows(built, b.batch, b.at)
            logp = row_logps(rows / rl.temperature, b.batch["input_ids"][:, 1:], at)
            dev = logp.device
            if rl.kl_coef and b.ref_logp is None:  # kept by a checkpoint of a run without KL
                raise Mistake("rl.kl_coef > 0, but completions kept from before it was set "
                                 "have no reference log-probabilities")
            ref = b.ref_logp.to(dev) if rl.kl_coef else None
            per, fig = token_losses(logp, b.old_logp.to(dev), b.advantages.to(dev)
                                    .index_select(0, b.index.to(dev)), clip=self.clip,
                                    ref_logp=ref, kl_coef=rl.kl_coef)
            loss_sum = (per * w.to(dev)).sum()
            with built.attention.context():
                (loss_sum * world / denominator).backward()
            total += torch.stack([loss_sum.detach(), fig["clipped_low"].sum(),
                                  fig["clipped_high"].sum(), fig["kl"].sum(),
                                  torch.tensor(float(len(at)), device=dev)])
        if dist.is_initialized():
            dist.all_reduce(total)
        return torch.cat([total, denominator.reshape(1)])

    def step(self, built, optimizer, micro, *, accumulation, grad_clip, health=None):
        if built.pipeline is not None:
            raise ValueError("train.objective=grpo does not run under pipeline parallelism")
        rl = self.rl
        ahead = self.steps_ahead() if self.upcoming is not None else []
        mine, every = self.groups(micro, self.sampling, "train", ahead)
        if every is not None:
            check_step(every, spec=rl.reward)
        rewards = torch.tensor([r for g in mine for r in g.rewards])
        advantages, _ = group_advantages(rewards, group_size=rl.group_size,
                                         normalize=rl.normalize_advantages)
        # rl.updates_per_step mini-batches of whole groups, one optimizer update each, in order:
        # update u trains the groups at the step's slots u, u + N, u + 2N, ... A rank holds a
        # contiguous run of the step's slots (raylm.data.packing.rank_positions) whose length
        # N divides (the config checks it at every worker count of the range), so every rank
        # holds as many groups of each update, and an update trains the same groups whatever
        # the worker count (a rank's groups cut into contiguous runs would not: a resize
        # would change what each update trains).
        n = rl.updates_per_step
        per_group = advantages.reshape(len(mine), -1)
        total, losses = torch.zeros(5, device=built.device), []
        for u in range(n):
            stats = self.update(built, mine[u::n], per_group[u::n].reshape(-1),
                                accumulation=accumulation)
            losses.append(stats[0] / stats[5])
            norm = clip_grad_norm(built.model, grad_clip)
            # The numerical check (train.on_spike) judges each step by its last update; an
            # earlier update that is not finite is skipped on its own.
            fault = (health.check(losses[-1], norm) if health is not None and u == n - 1 else
                     (~(torch.isfinite(losses[-1]) & torch.isfinite(norm))).float())
            apply_update(optimizer, fault)
            total += stats[:5]
        loss = torch.stack(losses).mean()
        self.version += 1
        self.at += 1
        t0 = time.perf_counter()
        # Colocated, the trainer's generator samples with the model itself: nothing to hand.
        weights_now = None if self.local is not None else self.weights(built)
        figures = {"clip_low": total[1] / total[4], "clip_high": total[2] / total[4],
                   "kl": total[3] / total[4]}
        if self.local is not None:
            self.local.load(self.version, None)
        if every is not None:
            if self.pool is not None:
                self.pool.load(self.version, weights_now)
            alike_all = group_advantages(torch.tensor([r for g in every for r in g.rewards]),
                                         group_size=rl.group_size)[1]
            figures |= {k: torch.tensor(v) for k, v in group_figures(every, alike_all).items()}
            figures["transfer_s"] = torch.tensor(time.perf_counter() - t0)
            self.spent["transfer_s"] += float(figures["transfer_s"])
            pool = self.pool
            figures["generators_replaced"] = torch.tensor(float(pool.replaced if pool else 0))
            figures["generators"] = torch.tensor(float(len(pool.actors) if pool else 0))
            figures["generate_s"] = torch.tensor(self.seconds.get("generate_s", 0.0))
            figures["staleness_max"] = torch.tensor(float(self.version - 1 - min(
                g.version for g in every)))
            warning = reward_warning(every, step=self.version, said=self.errors_said)
            if warning:
                print(warning)
        return loss.detach(), norm.detach(), {f"rl_{k}": v for k, v in figures.items()}

    @torch.no_grad()
    def evaluate(self, built, batches) -> dict[str, float]:
        """``val_reward``: the mean reward of the most likely completion of each held-out
        prompt, under the weights the generators hold now (every rank calls it)."""
        greedy = Sampling(1, 0.0, 1.0, self.rl.max_completion_tokens)
        _, every = self.groups(list(batches), greedy, "val")
        value = (float(np.mean([r for g in every for r in g.rewards])) if every else 0.0)
        out = torch.tensor([value])
        if dist.is_initialized():
            dist.broadcast(out, src=0)
        return {"val_reward": float(out[0])}

    def flops(self, config, seq_len: int) -> float:
        # The step's forward and backward over prompt and completion tokens; generation is
        # the generators' (its time is reported on its own, rl_generate_s).
        return flops_per_token(config, seq_len + self.rl.max_completion_tokens)
