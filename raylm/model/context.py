"""Context parallelism: one sequence spread over ``parallel.context`` ranks, each holding a
contiguous shard of every sequence of the micro-batch, so a rank's activations are 1/N of the
sequence's. Everything but attention (embeddings, norms, MLPs, the head and its loss) runs on
the shard; attention needs every earlier token, so around it an all-to-all hands each rank
the whole sequence for 1/N of the heads, and another hands the shards back (the scheme of
DeepSpeed-Ulysses). Two all-to-alls of q, k, v and the output per block, forward, and as many
backward; no rank ever holds more than 1/N of a sequence's activations outside attention.

The shards' rotary positions are their true positions in the block (or in its documents, with
per-document attention); inside attention each rank sees the whole sequence's positions
(gathered from the shards), so the documents of a packed block attend within themselves
exactly as they do on one rank. Grouped-query models whose key/value heads do not split over
N ranks repeat them to one per attention head first.

Written by hand: torch's ``context_parallel`` intercepts CUDA attention kernels only (ring
attention) and fails on CPU with gloo; this works on any backend with ``all_to_all_single``
and is the one attention implementation transformers' models call through its registry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

ATTENTION = "raylm_context"
"""The name the model's config gives its attention (transformers' AttentionInterface)."""


@dataclass(frozen=True)
class Context:
    """This rank's place in its context-parallel group of ``size`` consecutive ranks."""

    group: dist.ProcessGroup
    size: int
    rank: int

    @classmethod
    def start(cls, size: int) -> Context:
        """The groups of ``size`` consecutive ranks (every rank calls it)."""
        group, _ = dist.new_subgroups(group_size=size)
        return cls(group, size, dist.get_rank(group))

    def shard(self, batch: dict[str, torch.Tensor], *, cross_document: bool
              ) -> dict[str, torch.Tensor]:
        """This rank's shard of a micro-batch of blocks: its 1/N of each block's targets, and
        the tokens before them (the block's tensors of L + 1 tokens become L/N + 1 each, the
        last one shared with the next shard); ``position_ids`` are the shard's true positions
        (restarting at each document unless attention crosses them)."""
        tokens = batch["input_ids"]
        length = tokens.size(1) - 1
        if length % self.size:
            raise ValueError(f"parallel.context={self.size} does not divide the blocks' "
                             f"{length} tokens (data.seq_len)")
        n = length // self.size
        at = slice(self.rank * n, self.rank * n + n + 1)
        positions = (torch.arange(length + 1).expand_as(tokens) if cross_document
                     else batch["position_ids"])
        out = {k: v[:, at] if v.dim() == 2 and v.size(1) == length + 1 else v
               for k, v in batch.items()}
        out["position_ids"] = positions[:, at]
        return out


_GROUP: list[Context] = []  # the attention's group (one per process: set by use())


def use(model: torch.nn.Module, context: Context) -> None:
    """Route ``model``'s attention through :func:`attention` over ``context``'s group."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, attention)
    # The attention builds its documents' structure itself, from the whole sequence's
    # positions: the mask transformers would build is of the shard, and is not needed.
    AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)
    _GROUP[:] = [context]
    model.config._attn_implementation = ATTENTION


def check(config, *, context: int) -> None:
    """Refuse a degree the model's attention does not split into (before Ray starts)."""
    if context == 1:
        return
    from raylm.model.build import Shape

    heads = Shape.of(config).heads
    if heads % context:
        raise ValueError(f"parallel.context={context} does not divide the model's {heads} "
                         f"attention heads; choose a degree that divides them")
    types = getattr(config, "layer_types", None)  # a family without them: every layer alike
    windows = bool(getattr(config, "sliding_window", None)) and (
        types is None or "sliding_attention" in types)
    if windows or getattr(config, "attn_logit_softcapping", None):
        raise ValueError(f"parallel.context={context}: {type(config).__name__}'s attention "
                         f"(sliding windows or soft-capped logits) is not split over ranks; "
                         f"use parallel.context=1")


class _AllToAll(torch.autograd.Function):
    """Split ``x`` along ``scatter`` over the group's ranks and join what each sends along
    ``gather``; its gradient is the same exchange the other way round."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
        ctx.args = (group, scatter, gather)
        return _exchange(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, scatter, gather = ctx.args
        return _exchange(grad, group, gather, scatter), None, None, None


EXCHANGED = {"bytes": 0, "seconds": 0.0}
"""What this process's all-to-alls sent and how long they took (``python -m raylm.bench
context`` resets and reads it)."""


def _exchange(x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
    n = dist.get_world_size(group)
    sent = torch.stack(x.chunk(n, dim=scatter)).contiguous()
    received = torch.empty_like(sent)
    t0 = time.perf_counter()
    dist.all_to_all_single(received, sent, group=group)
    EXCHANGED["seconds"] += time.perf_counter() - t0
    EXCHANGED["bytes"] += sent.numel() * sent.element_size() * (n - 1) // n
    return torch.cat(received.unbind(0), dim=gather)


_SEEN: list = []  # the last positions gathered: (the shard's tensor, the documents)


def _documents(position_ids: torch.Tensor, group) -> list[list[tuple[int, int]]]:
    """Each row's documents, (start, end) over the whole sequence, from the shards'
    positions (a document starts where its position is 0); gathered once per forward pass
    (every block receives the same tensor)."""
    if _SEEN and _SEEN[0][0] is position_ids:
        return _SEEN[0][1]
    parts = [torch.empty_like(position_ids) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, position_ids.contiguous(), group=group)
    whole = torch.cat(parts, dim=1).cpu()
    rows = []
    for row in whole:
        starts = (row == 0).nonzero().flatten().tolist()
        starts = [0, *[s for s in starts if s]]
        rows.append(list(zip(starts, [*starts[1:], len(row)], strict=True)))
    _SEEN[:] = [(position_ids, rows)]
    return rows


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, attention_mask, *, dropout: float = 0.0,
              scaling: float | None = None, position_ids: torch.Tensor | None = None,
              **_) -> tuple[torch.Tensor, None]:
    """Causal attention of this rank's shard (``query`` (B, H, S/N, D); ``key``, ``value``
    (B, H_kv, S/N, D)) against the whole sequence, each document attending within itself;
    returns (B, S/N, H, D) as transformers' attention functions do."""
    context = _GROUP[0]
    group, n = context.group, context.size
    heads, kv_heads = query.size(1), key.size(1)
    if kv_heads % n:  # too few key/value heads to split: one per attention head
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
        kv_heads = heads
    q, k, v = (_AllToAll.apply(t, group, 1, 2) for t in (query, key, value))
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    rows = []
    for b, documents in enumerate(_documents(position_ids, group)):
        rows.append(torch.cat([
            F.scaled_dot_product_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e],
                                           v[b:b + 1, :, s:e], dropout_p=dropout,
                                           is_causal=True, scale=scaling)
            for s, e in documents], dim=2))
    out = _AllToAll.apply(torch.cat(rows), group, 2, 1)
    return out.transpose(1, 2).contiguous(), None
