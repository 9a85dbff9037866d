"""What the driver knows of each ``train.objective``, one object each (:func:`objective_of`), so
that nothing else in :mod:`raylm.run` compares the objective's name: the figure a sweep ranks
trials by and its direction, the longest row a block must hold, the objective's own preflight,
what the run places beside its trainers (GRPO's generators), whether it needs a stored reference
pass, and the settings a sweep of it varies. The workers' side of each is
:class:`raylm.workers.step.Objective`'s (``NextToken``, ``Preference``, ``Reinforce``).
"""

from __future__ import annotations

from typing import Any

from raylm.config import Config
from raylm.contracts.report import Report
from raylm.contracts.summary import Summary
from raylm.data.corpus import first_row
from raylm.rollout import rewards
from raylm.run.trial import METRIC


class RunObjective:
    """Next-token training (``train.objective=sft``, pretraining included)."""

    metric, mode = METRIC, "min"
    """The figure a sweep ranks trials by (tune.metric unset), and whether lower is better."""

    def longest_row(self, cfg: Config) -> int:
        """The most tokens a row of the run holds (the model's positions must cover them)."""
        return cfg.data.seq_len

    def check(self, cfg: Config) -> None:
        """The objective's own preflight (before Ray starts)."""

    def beside_trainers(self, cfg: Config, *, most: bool = False
                        ) -> tuple[dict[str, float], str]:
        """What the run places beside its training workers, at its fewest (``most``: at its
        largest), and the settings that ask for it."""
        return {}, ""

    def needs_stored_reference(self, cfg: Config) -> bool:
        """Whether the run needs the reference pass stored before it trains
        (:mod:`raylm.run.reference`)."""
        return False

    def keeper(self, cfg: Config) -> Any:
        """An actor of the driver's owning what outlives the group's restarts, or None."""
        return None

    def sweep_choices(self, cfg: Config) -> dict[str, list[Any]]:
        """The objective's own settings a sweep varies, by key, with their values."""
        return {}

    def described(self, cfg: Config) -> list[str]:
        """What a dry run says of the objective's own parts, a line each."""
        return []

    def progress(self, r: Report) -> str:
        """What a step's progress line says of the report's figures (the objective's own, by
        name, and the validation's)."""
        return f"  val {r.val_loss:.4f}" if r.val_loss is not None else ""

    def outcome(self, summary: Summary) -> str:
        """What the run's last line says of its final evaluation: the figure it is ranked by,
        then its validation loss, where it has them."""
        ranked = summary.figures.get(self.metric)
        said = [f"{self.metric.replace('_', ' ')} {ranked:.3f}"] if ranked is not None else []
        if summary.val_loss is not None:
            said.append(f"val loss {summary.val_loss:.4f}")
        return ", ".join(said) or "no validation loss"


class PreferenceObjective(RunObjective):
    """``train.objective=dpo``: ranked by the held-out preference accuracy (the share of pairs
    whose chosen answer has the higher reward), since the DPO loss moves with dpo.beta, which a
    sweep may vary, and the accuracy does not."""

    metric, mode = "val_accuracy", "max"

    def needs_stored_reference(self, cfg: Config) -> bool:
        # A reference model without adapters to switch off is scored once, before training.
        return cfg.dpo.needs_reference and not cfg.lora.rank

    def sweep_choices(self, cfg: Config) -> dict[str, list[Any]]:
        return {"dpo.beta": cfg.tune.dpo_betas or [cfg.dpo.beta]}

    def progress(self, r: Report) -> str:
        f, line = r.figures, ""
        if "dpo_accuracy" in f:
            line += f"  margin {f['dpo_margin']:.3f}  acc {f['dpo_accuracy']:.2f}"
        line += super().progress(r)
        if "val_accuracy" in f:
            line += f" (acc {f['val_accuracy']:.3f})"
        return line


class ReinforceObjective(RunObjective):
    """``train.objective=grpo``: ranked by the held-out reward (a GRPO run has no validation
    loss); a row is its prompt and its completion; the generators stand beside the trainers."""

    metric, mode = "val_reward", "max"

    def longest_row(self, cfg: Config) -> int:
        return cfg.data.seq_len + cfg.rl.max_completion_tokens

    def check(self, cfg: Config) -> None:
        """rl.reward imported, and called once on the data's first row where it is a local
        file (:func:`raylm.rollout.rewards.check_reward`)."""
        fn = rewards.load_reward(cfg.rl.reward)
        row = first_row(cfg.data.source, hf_split=cfg.data.hf_split)
        if row is not None and cfg.data.prompt_field in row:
            rewards.check_reward(fn, row, prompt_field=cfg.data.prompt_field,
                                 spec=cfg.rl.reward)

    def beside_trainers(self, cfg: Config, *, most: bool = False
                        ) -> tuple[dict[str, float], str]:
        rl = cfg.rl
        count = rl.generator_range[1 if most else 0]
        return ({name: count * amount for name, amount in rl.generator_resources.items()},
                f"rl.generators={rl.generators} of rl.generator_resources="
                f"{rl.generator_resources}")

    def keeper(self, cfg: Config) -> Any:
        from raylm.rollout.keeper import start_keeper  # the generators' (not colocated)

        return None if cfg.rl.colocated else start_keeper()

    def described(self, cfg: Config) -> list[str]:
        """Where the run samples, and what its copies of the weights cost: a colocated
        trainer gathers its own model whole while it samples (and holds a full fine-tune's
        KL reference beside it); actors get each version of the trainable weights through
        the object store, which keeps ``rl.max_staleness + 1``."""
        from raylm.model.spec import ModelSpec

        rl = cfg.rl
        # A pretrained model's own vocabulary (one token fits any), else the tokenizer's.
        vocab = 1 if cfg.model.path else cfg.tokenizer.vocab_size
        params = list(ModelSpec.from_config(cfg, vocab_size=vocab, eos_id=0).meta_model()
                      .parameters())
        width = 2 if cfg.train.precision == "bf16-true" else 4

        def size(n: float) -> str:
            return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
        whole = size(sum(p.numel() for p in params) * width)
        if rl.colocated:
            reference = (f", beside a frozen copy for the KL reference ({whole})"
                         if rl.kl_coef and not cfg.lora.rank else "")
            return [f"generation: colocated (rl.generators=0): each trainer samples its own "
                    f"share with its own model, gathered whole while it samples "
                    f"({whole}){reference}"]
        kept = (rl.max_staleness + 1) * sum(p.numel() for p in params if p.requires_grad)
        fewest, most = rl.generator_range
        count = f"{fewest}" if fewest == most else f"{fewest} to {most}"
        return [f"generation: {count} generator actor(s) of {rl.generator_resources}, each "
                f"holding the model ({whole}); the object store keeps up to "
                f"{rl.max_staleness + 1} version(s) of the trainable weights, "
                f"{size(kept * width)}"]

    def progress(self, r: Report) -> str:
        f, line = r.figures, ""
        if "rl_reward" in f:
            line += (f"  reward {f['rl_reward']:.3f} (sd {f['rl_reward_std']:.3f}, no signal "
                     f"{100 * f['rl_no_signal']:.0f}%)  len {f['rl_completion_len']:.1f}")
        if "val_reward" in f:
            line += f"  val reward {f['val_reward']:.3f}"
        return line


OBJECTIVES: dict[str, RunObjective] = {"sft": RunObjective(), "dpo": PreferenceObjective(),
                                       "grpo": ReinforceObjective()}


def objective_of(cfg: Config) -> RunObjective:
    return OBJECTIVES[cfg.train.objective]
