"""What a run's model is, said once: :class:`ModelSpec`, made from the run's config by
:meth:`ModelSpec.from_config`, is what every process that builds the run's model builds from:
the trainers, the generators, the reference scorer, the exporter, the preflight's meta model,
the resume check and the examples. A setting added to the model (a quantized base, a kernel,
the per-document attention) reaches all of them or none; before the spec, each caller unpacked
the config into 8 to 14 arguments of its own, and the generators of a QLoRA run sampled from a
bf16 base while the trainers scored an NF4 one.

A caller that needs the model otherwise says so with :func:`dataclasses.replace` beside its
reason (the generators: a whole head and one document per row; the reference scorer: the base
without adapters).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from raylm.model.assemble import Built, build_for_checkpoint, build_training_model
from raylm.model.build import build_config, build_meta_model
from raylm.model.lora import adapter_args, add_adapters
from raylm.model.parallelize import DATA_PARALLEL, ParallelPlan

if TYPE_CHECKING:
    from raylm.config import Config


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The model as a run builds it (every field as :func:`raylm.model.assemble.
    build_training_model` takes it)."""

    vocab_size: int
    """The tokenizer's tokens (a preset's embeddings are this, padded)."""
    eos_id: int
    preset: str | None = "tiny"
    path: str | None = None
    """A pretrained model directory (wins over ``preset``)."""
    precision: str = "auto"
    attention: str = "auto"
    cross_document: bool = True
    """Whether a block's documents see each other (False: per-document attention)."""
    lora: dict[str, Any] | None = None
    """``add_adapters``' arguments (None: full fine-tuning)."""
    base_quantization: str = "none"
    fused_loss: bool = True
    seed: int = 0
    pipeline_schedule: str = "1f1b"

    @classmethod
    def from_config(cls, cfg: Config, *, vocab_size: int, eos_id: int) -> ModelSpec:
        """The model ``cfg`` trains, for a tokenizer of ``vocab_size`` tokens."""
        return cls(vocab_size=vocab_size, eos_id=eos_id, preset=cfg.model.preset,
                   path=cfg.model.path, precision=cfg.train.precision,
                   attention=cfg.model.attention, cross_document=cfg.data.across_documents,
                   lora=adapter_args(cfg.lora), base_quantization=cfg.lora.base_quantization,
                   fused_loss=cfg.train.fused_loss, seed=cfg.train.seed,
                   pipeline_schedule=cfg.parallel.pipeline_schedule)

    def replace(self, **changes: Any) -> ModelSpec:
        return dataclasses.replace(self, **changes)

    def transformers_config(self, attn_implementation: str = "sdpa"):
        """The model's transformers config (the preset's, or the pretrained directory's)."""
        return build_config(preset=self.preset, path=self.path, vocab_size=self.vocab_size,
                            eos_id=self.eos_id, attn_implementation=attn_implementation)

    def meta_model(self, config=None) -> nn.Module:
        """The model on the meta device, with its adapters: its parameters' names and shapes,
        no memory (``config``: its transformers config, when the caller has it)."""
        model = build_meta_model(config or self.transformers_config("eager"))
        return add_adapters(model, **self.lora) if self.lora else model

    def build(self, device: torch.device, plan: ParallelPlan = DATA_PARALLEL) -> Built:
        """The model laid out by ``plan`` on ``device``, with its weights
        (:func:`raylm.model.assemble.build_training_model`)."""
        return build_training_model(
            preset=self.preset, path=self.path, vocab_size=self.vocab_size,
            eos_id=self.eos_id, device=device, precision=self.precision,
            attention=self.attention, cross_document=self.cross_document,
            plan=plan, seed=self.seed, lora=self.lora,
            base_quantization=self.base_quantization,
            pipeline_schedule=self.pipeline_schedule, fused_loss=self.fused_loss)

    def for_checkpoint(self) -> Built:
        """The model a checkpoint is read into, on this process's CPU in fp32
        (:func:`raylm.model.assemble.build_for_checkpoint`)."""
        return build_for_checkpoint(preset=self.preset, path=self.path,
                                    vocab_size=self.vocab_size, eos_id=self.eos_id,
                                    lora=self.lora)
