"""Pipeline parallelism: a model's decoder layers cut into consecutive stages, one per rank of
the ``pp`` mesh dimension, driven over micro-batches by a ``torch.distributed.pipelining``
schedule (GPipe or 1F1B).

torch.distributed.pipelining runs the schedule, sends activations and gradients between stages,
and holds FSDP's gradient reduction back to the last micro-batch. What it does not do is cut a
transformers model into stages whose parameters keep the full model's names, so raylm cuts by
removing, not rebuilding: a stage is the whole model built on the meta device with what it does
not own taken out (the embedding after the first stage, the final norm and the head before the
last, other stages' decoder layers replaced by a parameterless :class:`Skipped` that keeps the
layer list's indices). Every parameter keeps its name (``model.layers.7.mlp.up_proj.weight`` on
whichever stage holds layer 7), so DCP checkpoints saved under one layout load under any other,
and initialization by name gives the same weights however the layers are split.

Each stage runs the model's own forward (the embedding's output, or the hidden states received
from the stage before, go in as ``inputs_embeds``), so causal masks, rotary positions and
document boundaries are computed exactly as without pipelining. Every rank of a pipeline reads
its data-parallel slice of each global batch: the first stage feeds the inputs, the last the
targets (and the loss mask), the middle ones only the position ids of document boundaries; a
batch's tokens are a few KB against the activations that travel between stages.

Costs: a step of ``m`` micro-batches over ``pp`` stages takes ``m + pp - 1`` forward and as many
backward slots per stage, so each stage idles (pp - 1) / (m + pp - 1) of the step (the bubble:
1/5 at pp 2 with 4 micro-batches, hence at least ``pp`` micro-batches are required). GPipe
keeps all ``m`` micro-batches' activations until the backward passes begin; 1F1B starts backward
as soon as the last stage has a micro-batch's loss, so a stage holds at most ``pp`` of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from raylm.config import PIPELINE_SCHEDULES
from raylm.model.build import build_meta_model, decoder_layers


def stage_layers(num_layers: int, pipeline: int) -> list[range]:
    """The decoder layers of each stage: consecutive runs balanced by count; where they do not
    divide, the first stages take one more (the last stage also computes the output head and
    the loss)."""
    if num_layers < pipeline:
        raise ValueError(f"parallel.pipeline={pipeline} needs at least one decoder layer per "
                         f"stage; the model has {num_layers}")
    base, extra = divmod(num_layers, pipeline)
    out, start = [], 0
    for s in range(pipeline):
        n = base + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


def describe_split(num_layers: int, pipeline: int) -> str:
    """The split as a user reads it: ``layers 0-4 | 5-9 | 10-13 | 14-17``."""
    return "layers " + " | ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start)
                                  for r in stage_layers(num_layers, pipeline))


def check_pipeline(config, *, pipeline: int) -> None:
    """Refuse a pipeline the model cannot be cut into (before any worker starts); the batch
    side is checked with the config (``raylm.config``)."""
    if pipeline == 1:
        return
    stage_layers(config.num_hidden_layers, pipeline)
    inner = getattr(build_meta_model(config), "model", None)
    if not all(hasattr(inner, part) for part in ("embed_tokens", "layers", "norm")):
        raise ValueError(
            f"parallel.pipeline={pipeline}: {type(config).__name__.removesuffix('Config')} "
            f"models do not keep their embedding, decoder layers and final norm as "
            f"model.embed_tokens, model.layers and model.norm, where raylm cuts stages; train "
            f"it with parallel.pipeline=1 (FSDP2 shards it over the workers).")
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError(
            f"parallel.pipeline={pipeline}: this model ties its output head to its input "
            f"embedding, which would then live on two stages (the first and the last); "
            f"pipeline a model with untied embeddings, or use parallel.tensor instead")


class Skipped(nn.Module):
    """A decoder layer another stage holds: hands the hidden states on unchanged."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        # Some models pick a layer's mask by its attention type (sliding or full).
        if hasattr(layer, "attention_type"):
            self.attention_type = layer.attention_type

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


class Stage(nn.Module):
    """One pipeline stage of a transformers causal LM, with the full model's parameter names
    (``model.*``, ``lm_head.*``). Its forward takes token ids on the first stage, hidden states
    on the others, and returns hidden states, or the logits on the last stage."""

    def __init__(self, model: nn.Module, *, index: int, num_stages: int) -> None:
        super().__init__()
        self.config = model.config
        self.index, self.num_stages = index, num_stages
        inner = model.model
        mine = stage_layers(len(inner.layers), num_stages)[index]
        for i, layer in enumerate(inner.layers):
            if i not in mine:
                inner.layers[i] = Skipped(layer)
        if not self.is_first:
            inner.embed_tokens = None
            if hasattr(inner, "embedding_multiplier"):
                # Granite scales the embeddings in the model's forward, which every stage
                # runs: once, on the first.
                inner.embedding_multiplier = 1.0
        if not self.is_last:
            inner.norm = nn.Identity()
        self.model = inner
        self.lm_head = model.lm_head if self.is_last else None
        self.tp_mesh = None
        """Set by tensor parallelism: the hidden states cross stages as this rank's token
        shard, a DTensor again inside the stage."""
        self.pp_group = None
        """Set by :func:`raylm.model.parallelize.parallelize`: the ranks of this pipeline."""

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        if self.is_first:
            h = self.model(input_ids=x, position_ids=position_ids).last_hidden_state
        else:
            if self.tp_mesh is not None:
                from torch.distributed.tensor import DTensor, Shard

                x = DTensor.from_local(x, self.tp_mesh, (Shard(1),))
            h = self.model(inputs_embeds=x, position_ids=position_ids).last_hidden_state
        if self.is_last:
            return head_output(self.config, self.lm_head(h))
        # torch.distributed.pipelining sends plain tensors.
        return h.to_local() if hasattr(h, "to_local") else h


def head_output(config, logits: torch.Tensor) -> torch.Tensor:
    """What a family's own causal-LM head does after the projection, which the last stage runs
    in its place: Gemma 2 caps its logits, Granite divides and Cohere multiplies them."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    if getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    if getattr(config, "logit_scale", None) and config.model_type.startswith("cohere"):
        logits = logits * config.logit_scale
    return logits


def owned_blocks(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(index, layer) of the decoder layers this rank holds (all of them without a
    pipeline)."""
    return [(i, b) for i, b in enumerate(decoder_layers(model)) if not isinstance(b, Skipped)]


class Pipeline:
    """The schedules that drive one :class:`Stage` (built on first use for each micro-batch
    count, and apart for training and evaluation: torch sizes a schedule's receive buffers by
    the first micro-batch it runs)."""

    def __init__(self, stage: Stage, *, group, device: torch.device, schedule: str) -> None:
        if schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"parallel.pipeline_schedule={schedule!r}; allowed: "
                             f"{', '.join(PIPELINE_SCHEDULES)}")
        self.stage, self.group, self.device, self.kind = stage, group, device, schedule
        self._schedules: dict[tuple[int, bool], Any] = {}
        self._loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def _schedule(self, n: int, *, train: bool):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        key = (n, train)
        if key not in self._schedules:
            stage = PipelineStage(self.stage, self.stage.index, self.stage.num_stages,
                                  self.device, group=self.group)
            # Forward-only evaluation has no backward to interleave: GPipe order.
            kind = Schedule1F1B if train and self.kind == "1f1b" else ScheduleGPipe
            # Gradients are scaled by the loss function itself (raylm.workers.step), as without a
            # pipeline: torch's own division by the micro-batch count would be wrong for
            # losses summed over masked targets.
            self._schedules[key] = kind(stage, n, loss_fn=self._loss, scale_grads=False)
        return self._schedules[key]

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target)

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, *, microbatches: int,
            loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], train: bool,
            position_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Forward (and with ``train``, backward) over ``inputs`` split into ``microbatches``
        equal micro-batches; the last stage calls ``loss_fn(logits, targets)`` on each and
        returns what it gave (other stages return nothing). Only these are the losses: torch
        may call ``loss_fn`` on placeholder data as well, to learn the shapes of gradients."""
        schedule = self._schedule(microbatches, train=train)
        self._loss_fn = loss_fn
        kwargs = {} if position_ids is None else {"position_ids": position_ids}
        args = (inputs,) if self.stage.is_first else ()
        target = targets if self.stage.is_last else None
        losses: list[torch.Tensor] = []
        try:
            if train:
                schedule.step(*args, target=target, losses=losses, return_outputs=False,
                              **kwargs)
            else:
                schedule.eval(*args, target=target, losses=losses, return_outputs=False,
                              **kwargs)
        finally:
            self._loss_fn = None
        return losses
