"""Pruning: which weights of a model to zero, and keeping them zero while it trains.

What is pruned: every linear projection inside the decoder layers (the ones ``lora.target_modules:
auto`` adapts, a mixture-of-experts router excepted), so the embedding table, the norms and the
output head stay dense, as in the setups of the methods below. Each layer is pruned to the same
sparsity, the lowest-scoring weights of every output row (one row: one output feature), so no
output loses more of its inputs than another:

- ``magnitude``: the score is |W_ij|.
- ``wanda`` (Sun et al., 2023, "A Simple and Effective Pruning Approach for Large Language
  Models"): the score is |W_ij| * ||X_j||, where ||X_j|| is the L2 norm of the layer's j-th input
  feature over a few calibration batches. A weight on an input that carries large activations
  matters more than its magnitude says; no weight is updated and nothing is retrained.
  Layers are calibrated block by block, each block's inputs coming from the already pruned
  blocks before it, so a block is pruned for the inputs it will see.
- ``2:4`` (semi-structured) with either score: in every group of four consecutive inputs of
  a row, the two lowest go. That is the pattern the sparse tensor cores of NVIDIA GPUs since
  Ampere multiply at up to twice the dense rate (torch's ``to_sparse_semi_structured``, torchao's
  ``SemiSparseWeightConfig`` turn such a weight into the compressed layout they read).

Written here rather than taken from torchao: torchao 0.18's ``WandaSparsifier`` ranks scores
across a whole layer, not per output row as the paper does, weighs by the squared activation
norm rather than the norm, and works through the eager quantization flow's observers, which
see the dense model's activations in one pass; the score and the per-row choice are a few
lines of tensor code.

A pruned model keeps its zeros through fine-tuning (:func:`zero_masks`, :func:`reapply`):
full fine-tuning zeroes them again after every optimizer step, and a LoRA fine-tune, whose
base stays frozen, has them applied to the merged weight (:func:`raylm.model.lora.merge_adapters`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from raylm.contracts import ExportInfo, Malformed
from raylm.model.build import decoder_layers
from raylm.model.lora import block_projections

METHODS = ("magnitude", "wanda")
PRUNED_KIND = "model-pruned"
"""The ``kind`` in a pruned model directory's export record: what marks a model whose zeros
fine-tuning keeps."""


@dataclass(frozen=True)
class Target:
    """What to prune to: ``fraction`` of each row's weights, or ``n`` of every ``m``
    consecutive ones (semi-structured)."""

    fraction: float
    m: int = 0

    @property
    def label(self) -> str:
        return f"{self.m - round(self.fraction * self.m)}:{self.m}" if self.m else \
            f"{self.fraction:.0%}"


def parse_target(text: str) -> Target:
    """``--sparsity``: a fraction in (0, 1) (``0.5``), or ``2:4``."""
    if ":" in text:
        kept, _, group = text.partition(":")
        if (kept, group) != ("2", "4"):
            raise ValueError(f"--sparsity {text}: the semi-structured pattern raylm writes is "
                             f"2:4 (two of every four weights kept, what sparse tensor cores "
                             f"run); give 2:4 or a fraction such as 0.5.")
        return Target(0.5, 4)
    try:
        fraction = float(text)
    except ValueError:
        fraction = -1.0
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"--sparsity {text}: give the fraction of weights to remove, between 0 "
                         f"and 1 (0.5 removes half), or 2:4.")
    return Target(fraction)


def prunable(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every linear projection the decoder layers hold, router excepted."""
    return block_projections(model)


def rows_by_inputs(module: nn.Module) -> torch.Tensor:
    """The layer's weight as (outputs, inputs): ``nn.Linear`` stores it so, GPT-2's ``Conv1D``
    transposed. A view: writing to it writes the weight."""
    w = module.weight.data
    return w.t() if type(module).__name__ == "Conv1D" else w


def prune_mask(score: torch.Tensor, target: Target) -> torch.Tensor:
    """True where a weight stays: per row of ``score`` (outputs, inputs), the highest
    ``1 - fraction``, or the two highest of every four consecutive inputs."""
    rows, cols = score.shape
    if target.m:
        if cols % target.m:
            raise ValueError(f"2:4 needs each layer's inputs in whole groups of four; a layer "
                             f"has {cols}")
        groups = score.reshape(rows, cols // target.m, target.m)
        drop = groups.argsort(dim=-1)[..., :target.m // 2]
        keep = torch.ones_like(groups, dtype=torch.bool).scatter_(-1, drop, False)
        return keep.reshape(rows, cols)
    n_drop = int(cols * target.fraction)
    keep = torch.ones_like(score, dtype=torch.bool)
    if n_drop:
        keep.scatter_(1, score.argsort(dim=1)[:, :n_drop], False)
    return keep


class _Stop(Exception):
    """Ends a calibration forward once the block being calibrated has seen its inputs."""


@torch.no_grad()
def prune(model: nn.Module, target: Target, *, method: str,
          calibrate: Callable[[], None] | None = None) -> list[dict]:
    """Zero the lowest-scoring weights of every :func:`prunable` layer of ``model`` in place;
    returns a record per layer (name, shape, sparsity). ``wanda`` needs ``calibrate``, which
    runs the model forward over the calibration batches (:func:`calibration_runner`)."""
    if method not in METHODS:
        raise ValueError(f"--method {method}: not one of {', '.join(METHODS)}")
    layers = prunable(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no linear layers inside its decoder "
                         f"layers to prune.")
    if method == "wanda" and calibrate is None:
        raise ValueError("wanda needs calibration data")
    by_block: dict[nn.Module, list[tuple[str, nn.Module]]] = {}
    blocks = decoder_layers(model)
    for block in blocks:
        ids = {id(m) for m in block.modules()}
        by_block[block] = [(n, m) for n, m in layers if id(m) in ids]
    report = []
    for block, members in by_block.items():
        norms = _input_norms(block, [m for _, m in members], calibrate) \
            if method == "wanda" else None
        for name, module in members:
            w = rows_by_inputs(module)
            score = w.abs().float()
            if norms is not None:
                score = score * norms[module].to(score.device)
            keep = prune_mask(score, target)
            w.mul_(keep.to(w.dtype))
            report.append({"layer": name, "shape": list(w.shape),
                           "sparsity": round(1.0 - keep.float().mean().item(), 6)})
    return report


def _input_norms(block: nn.Module, modules: list[nn.Module],
                 calibrate: Callable[[], None]) -> dict[nn.Module, torch.Tensor]:
    """||X_j|| per input feature of each of ``modules`` (the layers of ``block``), over the
    calibration tokens, as the model with its earlier blocks already pruned computes them.
    The forward stops after ``block``: the later blocks are not needed yet."""
    sums: dict[nn.Module, torch.Tensor] = {}

    def record(module: nn.Module, args: tuple) -> None:
        x = args[0].detach().float().reshape(-1, args[0].shape[-1])
        s = (x * x).sum(dim=0)
        sums[module] = sums[module] + s if module in sums else s

    def stop(*_) -> None:
        raise _Stop

    handles = [m.register_forward_pre_hook(record) for m in modules]
    handles.append(block.register_forward_hook(stop))
    try:
        calibrate()
    finally:
        for h in handles:
            h.remove()
    return {m: s.sqrt() for m, s in sums.items()}


def calibration_runner(model: nn.Module, batches: list[dict[str, torch.Tensor]],
                       forward: Callable[[nn.Module, dict[str, torch.Tensor]], object]
                       ) -> Callable[[], None]:
    """A ``calibrate`` for :func:`prune`: ``forward(model, batch)`` over every batch, each
    stopped by the calibrated block's hook."""

    def run() -> None:
        for batch in batches:
            try:
                forward(model, batch)
            except _Stop:
                continue

    return run


def is_pruned(model_dir: str | Path | None) -> bool:
    """Whether ``model_dir`` is a model ``raylm prune`` wrote (its zeros are kept when it is
    fine-tuned)."""
    if not model_dir:
        return False
    try:
        info = ExportInfo.read(model_dir)
    except (OSError, Malformed):
        return False
    return info is not None and info.kind == PRUNED_KIND


def zero_masks(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight, mask) for every :func:`prunable` layer's weight: mask is False where the weight
    is zero now. Taken on the tensors this process holds (an FSDP2 shard is its local part),
    so it costs one byte per local weight."""
    out = []
    for _, module in prunable(model):
        w = module.weight
        local = w.to_local() if hasattr(w, "to_local") else w
        out.append((local, local != 0))
    return out


@torch.no_grad()
def reapply(masks: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Zero again what :func:`zero_masks` found zero (after an optimizer step moved it)."""
    for weight, mask in masks:
        weight.mul_(mask)
