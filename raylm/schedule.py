"""The learning-rate schedules: the rate of every step, and how changed settings move a resumed
run's rate. Pure arithmetic on the config (no torch): the workers set each step's rate from it,
and the driver decides from it, before any worker starts, whether a resume changes the rate.

``lr_at(step)`` is the learning rate for optimizer step ``step`` (0-based) of ``total``:
linear warmup from ``peak / warmup`` to ``peak`` over steps ``[0, warmup)``, then the schedule
over ``progress = (step - warmup) / (total - warmup)`` in ``[0, 1]``, ending at
``min_lr = peak * min_ratio``:

    cosine     min + (peak - min) * (1 + cos(pi * progress)) / 2
    linear     peak - (peak - min) * progress
    constant   peak
    wsd        peak until progress = 1 - decay_fraction, then linear to min (warmup-stable-decay)
    cyclical   triangular between peak and min, period cycle_steps, starting at peak
"""

from __future__ import annotations

import math
from typing import Any

from raylm.config import OptimConfig
from raylm.contracts.events import ScheduleMoved


def lr_at(step: int, optim: OptimConfig, *, total: int) -> float:
    """The rate of 0-based step ``step`` of ``total`` under ``optim``'s schedule (the config
    checked its settings)."""
    schedule, peak, warmup = optim.schedule, optim.lr, optim.warmup_steps
    min_ratio, decay_fraction = optim.min_lr_ratio, optim.decay_fraction
    if step < warmup:
        return peak * (step + 1) / warmup
    low = peak * min_ratio
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return low + (peak - low) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return peak - (peak - low) * progress
    if schedule == "constant":
        return peak
    if schedule == "wsd":
        start = 1.0 - decay_fraction
        if progress <= start:
            return peak
        return peak - (peak - low) * (progress - start) / decay_fraction
    # cyclical (triangular)
    pos = (step - warmup) % optim.cycle_steps / optim.cycle_steps
    return low + (peak - low) * abs(1.0 - 2.0 * pos)


# Schedules whose value at a step does not depend on train.steps (wsd's only until its decay).
EXTEND_CLEANLY = ("constant", "wsd")


def schedule_change(state: dict[str, Any], optim: OptimConfig, *, total: int
                    ) -> ScheduleMoved | None:
    """How the current settings move the learning rate of a run resumed from a checkpoint's
    train ``state``, or None when they give its last step the rate it trained at. Extending
    ``train.steps`` moves every schedule shaped by it (cosine, linear, cyclical, wsd once it
    decays); a changed peak or warmup moves any."""
    trained = state.get("lr")
    step = int(state["step"])
    if trained is None or step == 0:
        return None
    now = lr_at(step - 1, optim, total=total)
    if math.isclose(now, trained, rel_tol=1e-6, abs_tol=1e-12):
        return None
    return ScheduleMoved(step=step, lr_trained=trained, lr_now=now,
                         lr_next=lr_at(step, optim, total=total) if step < total else None)
