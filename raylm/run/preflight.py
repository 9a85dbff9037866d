"""One preflight on the driver: everything that can be refused without data or the cluster,
checked once per entry path (``raylm train``, ``raylm tune``, ``raylm submit`` and the Python
API) before Ray starts, so that a mistake costs seconds and one line, never a worker group.

It resolves hub ids to their snapshot directories, builds the model's configuration once, and
checks against it: the sequence length, the tensor-parallel and pipeline layouts, the weight
files (on a meta-device model, adapters included), QLoRA's block sizes at every worker count
the run may have, the sweep's own settings, the benchmarks (:mod:`raylm.run.benchmarks`), and
that the MLflow store can exist. What it
returns (:class:`Checked`) is what the later steps take instead of checking again: a sweep's
trials reuse it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raylm.config import Config, for_sweep
from raylm.hub import with_hub_snapshots
from raylm.model import lora
from raylm.model.build import check_seq_len
from raylm.model.context import check as check_context
from raylm.model.parallelize import check_tensor_parallel
from raylm.model.pipeline import check_pipeline
from raylm.model.spec import ModelSpec
from raylm.model.weights import check_weights
from raylm.run import benchmarks, tracking
from raylm.run.objectives import objective_of


@dataclass(frozen=True)
class Checked:
    """A config that passed the preflight."""

    cfg: Config

    def for_trial(self, cfg: Config) -> Checked:
        """The same checks standing for a sweep's trial, whose config differs only in the
        swept optimizer and adapter settings (the preflight checked adapters already)."""
        return dataclasses.replace(self, cfg=cfg)


def preflight(cfg: Config, *, sweep: bool = False, tracked: bool = True) -> Checked:
    """``cfg`` checked as above (``sweep``: as a sweep's base config; ``tracked``: the run
    owns its MLflow store, as a sweep's trial does not)."""
    if sweep:
        check_sweep(cfg)
        cfg = for_sweep(cfg)  # before a hub id becomes a snapshot path
    cfg = with_hub_snapshots(cfg)
    m = cfg.model
    # The tokenizer is not known yet: one token fits any model's embeddings.
    spec = ModelSpec.from_config(adapted(cfg, sweep=sweep), vocab_size=1, eos_id=0)
    model_config = spec.transformers_config("eager")
    objective = objective_of(cfg)
    check_seq_len(objective.longest_row(cfg), model_config, preset=m.preset, path=m.path)
    objective.check(cfg)
    check_tensor_parallel(model_config, tensor=cfg.parallel.tensor, seq_len=cfg.data.seq_len)
    check_context(model_config, context=cfg.parallel.context)
    check_pipeline(model_config, pipeline=cfg.parallel.pipeline)
    if m.path:
        # The weight files against the model the config makes (on meta, no memory).
        check_weights(spec.meta_model(model_config), m.path)
    if cfg.lora.base_quantization == "nf4":
        model = spec.meta_model(model_config)
        fewest, most = cfg.scaling.worker_range
        for workers in range(fewest, most + 1):
            lora.check_nf4_shapes(model, cfg.lora.target_modules, workers)
    # The eval extra installed, every benchmark known to lm-eval, and tune.metric's direction
    # stated: before an hour of training, not after it.
    benchmarks.check_settings(cfg.eval)
    if sweep and cfg.tune.metric is not None:
        benchmarks.higher_is_better(cfg.eval, cfg.tune.metric)
    if cfg.tracking.enabled and tracked:
        # A store that cannot exist, or a server that refuses this client, fails now, not
        # after the data is prepared.
        tracking.check_access(cfg)
    return Checked(cfg=cfg)


def adapted(cfg: Config, *, sweep: bool) -> Config:
    """The config whose adapters the weights are checked with: a sweep over LoRA ranks
    adapts the model even where ``lora.rank`` is 0."""
    if sweep and cfg.tune.lora_ranks and not cfg.lora.rank:
        return dataclasses.replace(
            cfg, lora=dataclasses.replace(cfg.lora, rank=cfg.tune.lora_ranks[0]))
    return cfg


def check_sweep(cfg: Config) -> None:
    """What can be wrong with the sweep itself (ranges and schedules are checked by the
    config loader)."""
    if cfg.train.steps < cfg.train.eval_every:
        raise ValueError(f"train.steps={cfg.train.steps} is below train.eval_every="
                         f"{cfg.train.eval_every}: trials would report once, at the end, and "
                         f"early stopping could not act; lower train.eval_every.")
