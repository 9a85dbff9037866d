"""What the driver hands every worker of a run, once: TorchTrainer's ``train_loop_config``.

A module of its own, without torch: Ray Train's controller unpickles the train loop's config
with the run's context, and a :class:`Handoff` defined beside the loop made the controller
import the loop, torch and transformers' model code with it (about 1.5 CPU-seconds, sampled
with py-spy, spent while the workers' own imports wait for the same 2 cores).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raylm.config import Config

# The key of TorchTrainer's train_loop_config (a dict to Ray Train) that holds the Handoff.
HANDOFF = "handoff"


@dataclass(frozen=True)
class Handoff:
    """What the driver gives every worker of a run, once (TorchTrainer's
    ``train_loop_config[HANDOFF]``); the rest a worker works out from the config."""

    cfg: Config
    """The run's resolved config (choices the driver made, like the device, included)."""
    run_dir: str
    prepared: str
    """The prepared data's directory (raylm.data.preparation)."""
    vocab_size: int
    eos_id: int
    tracking: tuple[str, str] | None
    """The run's MLflow tracking URI and run id, for its node monitors; None: not tracked."""
    reader_resources: dict[str, float]
    """What each worker's Ray Data reader reserves (the run's resource plan)."""
    identity: dict[str, str]
    """What the run trains with, written into every checkpoint (data, tokenizer, base)."""
    reference: str | None = None
    """The stored reference of a DPO full fine-tune (raylm.run.reference)."""
    lease: str | None = None
    """The token of the run directory's lease its driver holds (raylm.run.lease)."""
    keeper: Any = None
    """The actor that owns a GRPO run's generators (raylm.rollout.keeper), the driver's: they
    outlive the training group's restarts. None: the run has no generator actors."""
