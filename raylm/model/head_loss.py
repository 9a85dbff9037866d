"""Next-token cross-entropy from the last hidden states, a chunk of tokens at a time, so that a
batch's logits never exist whole.

At a 150k-token vocabulary the logits of 4 x 2048 tokens are 2.5 GB in bf16 and 5 GB per fp32
copy, and the plain path keeps several (the bf16 logits, their fp32 upcast, the log-softmax
saved for backward, its gradient): the largest item of a 1-2 B model's fine-tuning memory.
Here the output head's projection and the loss run over chunks of about
:data:`CHUNK_BYTES` of fp32 logits; each chunk's gradients (with respect to the hidden states
and, when the head trains, its weight) are computed at once in the forward pass, where the
chunk's logits are at hand, and handed to autograd for the backward: the same arithmetic as
the plain path, none of it done twice, and one chunk's logits alive at a time. The preference
losses need each answer target's log-probability rather than a summed loss: there the head
projects the answers' positions only (:func:`head_rows`), not the prompts' and padding's.

The head stays the model's own ``nn.Linear`` (:class:`LossHead` only changes its forward inside
:func:`head_loss`), so parameter names, FSDP2's units, tied embeddings, checkpoints and
exports are unchanged; the family's post-processing of the logits (Gemma 2's soft cap,
Granite's and Cohere's scales: :func:`raylm.model.pipeline.head_output`) is applied to each
chunk and differentiated by autograd there. Under tensor parallelism each rank holds a slice
of the vocabulary (the head is split by rows): a chunk's logsumexp and target logits are summed
over the tensor-parallel group from each rank's slice, as torch's loss parallel does for whole
logits, and each rank keeps its slice's gradient. Under pipeline parallelism the plain head
runs on the last stage.

Written by hand: Liger-Kernel's fused linear cross-entropy and Apple's Cut Cross-Entropy do
this with Triton kernels, on CUDA only, and as their own loss modules rather than inside a
transformers model's head; this one is torch operations that run on the CPU as on a GPU and
under autocast, FSDP2 and frozen (LoRA) heads.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from raylm.model.pipeline import head_output

# fp32 logits per chunk; the loss's own autograd holds about three such buffers at a time.
CHUNK_BYTES = 256 * 2**20
# Targets that carry no loss (cross_entropy's ignore_index).
IGNORE = -100


@dataclass
class _Pending:
    config: object
    targets: torch.Tensor | None = None
    """head_loss: the targets whose summed loss the head computes (into ``loss``)."""
    rows: torch.Tensor | None = None
    """head_rows: the flat positions whose logits the head computes (into ``logits``)."""
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


_PENDING: ContextVar[_Pending | None] = ContextVar("raylm_head_loss", default=None)


class LossHead(nn.Linear):
    """A causal LM's output head that, inside :func:`head_loss`, computes the summed loss of
    the targets given there instead of the logits, and inside :func:`head_rows` the logits of
    the positions given there only (the model then returns logits of width 0); anywhere else
    it is the plain linear layer."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        pending = _PENDING.get()
        if pending is None:
            return super().forward(hidden)
        flat = hidden.reshape(-1, hidden.size(-1))
        if pending.rows is not None:
            pending.logits = head_output(pending.config,
                                         super().forward(flat.index_select(0, pending.rows)))
            return hidden.new_empty((*hidden.shape[:-1], 0))
        weight, group, offset = self.weight, None, 0
        if isinstance(weight, DTensor):
            # Tensor parallelism: this rank's rows of the head (a slice of the vocabulary),
            # the tokens replicated (see raylm.model.parallelize.tensor_parallel).
            mesh = weight.device_mesh
            # torch splits the rows as torch.chunk does: ceil(V / tp) each, the last fewer.
            offset = mesh.get_local_rank() * -(-weight.size(0) // mesh.size())
            group, weight, flat = mesh.get_group(), weight.to_local(), flat.to_local()
        pending.loss = chunked_loss(flat, weight, pending.targets.reshape(-1),
                                    config=pending.config, group=group, offset=offset)
        empty = flat.new_empty((*hidden.shape[:-1], 0))
        if group is not None:  # the head's output hook takes a split DTensor
            return DTensor.from_local(empty, mesh, [Shard(-1)], run_check=False)
        return empty


def fusable(model: nn.Module) -> bool:
    """Whether ``model``'s head can compute the loss in chunks: a bias-free linear layer."""
    head = getattr(model, "lm_head", None)
    return isinstance(head, nn.Linear) and head.bias is None


def use_loss_head(model: nn.Module) -> None:
    """Give ``model`` (see :func:`fusable`) a :class:`LossHead`, in place."""
    model.lm_head.__class__ = LossHead


@contextlib.contextmanager
def head_loss(targets: torch.Tensor, config):
    """Inside the block, the model's :class:`LossHead` computes the summed cross-entropy of
    ``targets`` (the batch's, ``IGNORE`` where untrained), read from the yielded record's
    ``loss`` once the forward has run."""
    with _pending(_Pending(config, targets=targets)) as pending:
        yield pending


@contextlib.contextmanager
def head_rows(rows: torch.Tensor, config):
    """Inside the block, the model's :class:`LossHead` computes the logits of the flat
    positions ``rows`` of the batch only, post-processed as ``config``'s family does (the
    preference losses score the answers' targets alone), read from the yielded record's
    ``logits`` once the forward has run."""
    with _pending(_Pending(config, rows=rows)) as pending:
        yield pending


@contextlib.contextmanager
def _pending(pending: _Pending):
    token = _PENDING.set(pending)
    try:
        yield pending
    finally:
        _PENDING.reset(token)


def chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                 config, group=None, offset: int = 0) -> torch.Tensor:
    """The summed fp32 cross-entropy of ``targets`` (N,) under the logits ``hidden @ weight.T``
    (N, H) x (V, H), post-processed as ``config``'s family does, a chunk of rows at a time.
    With ``group`` (tensor parallelism), ``weight`` is this rank's rows of the head, the
    vocabulary's ids from ``offset`` on, and the loss is the whole vocabulary's."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLoss.apply(hidden, weight, targets, config, group, offset)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    step = chunk_rows(weight.size(0))
    for rows in range(0, hidden.size(0), step):
        logits = head_output(config, hidden[rows:rows + step] @ weight.t()).float()
        total = total + _chunk_loss(logits, targets[rows:rows + step], group, offset)[0]
    return total


def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor, group, offset: int, *,
                grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk's summed cross-entropy from its fp32 ``logits`` (with ``group``: this rank's
    slice of the vocabulary), and with ``grad`` its gradient with respect to them."""
    if group is None:
        if not grad:
            return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum"), None
        with torch.enable_grad():
            logits = logits.detach().requires_grad_()
            loss = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
            (dlogits,) = torch.autograd.grad(loss, logits)
        return loss.detach(), dlogits
    valid = targets != IGNORE
    top = logits.amax(dim=-1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    exp = torch.exp(logits - top.unsqueeze(-1))
    total = exp.sum(dim=-1)
    dist.all_reduce(total, group=group)
    local = targets - offset
    here = valid & (local >= 0) & (local < logits.size(-1))
    at = local.clamp(0, logits.size(-1) - 1).unsqueeze(-1)
    picked = torch.where(here, logits.gather(-1, at).squeeze(-1), 0.0)
    dist.all_reduce(picked, group=group)
    loss = torch.where(valid, top + total.log() - picked, 0.0).sum()
    if not grad:
        return loss, None
    dlogits = exp / total.unsqueeze(-1)
    dlogits.scatter_add_(-1, at, -here.to(dlogits.dtype).unsqueeze(-1))
    return loss, dlogits * valid.unsqueeze(-1)


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, config, group, offset):
        grad_hidden = torch.empty_like(hidden)
        # The head's gradient is summed over the chunks in fp32, as autograd would sum it.
        grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if ctx.needs_input_grad[1] else None)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        step = chunk_rows(weight.size(0))
        for rows in range(0, hidden.size(0), step):
            h = hidden[rows:rows + step]
            projected = h @ weight.t()
            with torch.enable_grad():
                z = projected.detach().requires_grad_()
                logits = head_output(config, z).float()
            loss, dlogits = _chunk_loss(logits.detach(), targets[rows:rows + step], group,
                                        offset, grad=True)
            (dz,) = torch.autograd.grad(logits, z, dlogits)
            total += loss
            grad_hidden[rows:rows + step] = dz @ weight
            if grad_weight is not None:
                grad_weight += dz.t() @ h
        if group is not None:
            # The tokens are every rank's: their gradient sums each slice's part.
            dist.all_reduce(grad_hidden, group=group)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (grad_hidden * grad_total,
                None if grad_weight is None else grad_weight * grad_total, None, None, None,
                None)
