from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from raylm.config import SCHEDULES, OptimConfig
from raylm.schedule import lr_at
from raylm.workers.optim import param_groups


def at(step: int, schedule: str, *, total: int = 110, **settings) -> float:
    """``lr_at`` with peak 1, 10 warmup steps and a floor of 0.1 unless ``settings`` say."""
    optim = OptimConfig(**{"lr": 1.0, "warmup_steps": 10, "min_lr_ratio": 0.1,
                           "schedule": schedule, **settings})
    return lr_at(step, optim, total=total)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_warmup_is_linear_and_reaches_peak(schedule):
    assert at(0, schedule) == pytest.approx(0.1)
    assert at(4, schedule) == pytest.approx(0.5)
    assert at(9, schedule) == pytest.approx(1.0)
    assert at(10, schedule) == pytest.approx(1.0)  # progress 0


def test_cosine_boundaries():
    assert at(60, "cosine") == pytest.approx(0.55)  # halfway: mean
    assert at(110, "cosine") == pytest.approx(0.1)
    assert at(500, "cosine") == pytest.approx(0.1)  # clamped past the end
    assert at(109, "cosine") == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.99)))


def test_linear_constant_wsd_cyclical_boundaries():
    assert at(60, "linear") == pytest.approx(0.55)
    assert at(110, "linear") == pytest.approx(0.1)
    assert at(110, "constant") == 1.0
    # wsd with 20% decay: stable through progress 0.8 (step 90), then linear to min.
    assert at(90, "wsd") == pytest.approx(1.0)
    assert at(100, "wsd") == pytest.approx(0.55)
    assert at(110, "wsd") == pytest.approx(0.1)
    assert at(10, "cyclical", cycle_steps=20) == pytest.approx(1.0)
    assert at(20, "cyclical", cycle_steps=20) == pytest.approx(0.1)
    assert at(25, "cyclical", cycle_steps=20) == pytest.approx(0.55)
    assert at(30, "cyclical", cycle_steps=20) == pytest.approx(1.0)


def test_no_warmup():
    assert at(0, "cosine", lr=2.0, warmup_steps=0, total=10) == pytest.approx(2.0)


def test_no_weight_decay_on_norms_biases_embeddings():
    model = torch.nn.ModuleDict({
        "embed_tokens": torch.nn.Embedding(10, 4),
        "proj": torch.nn.Linear(4, 4),
        "norm": torch.nn.LayerNorm(4),
    })
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert len(no_decay["params"]) == 4  # embedding, bias, norm weight and bias


def test_schedule_change_on_resume():
    from raylm.schedule import schedule_change
    from raylm.workers.step import TrainState

    def run(schedule, total, steps=30):
        optim = OptimConfig(schedule=schedule, lr=1e-3, warmup_steps=5, min_lr_ratio=0.1,
                            decay_fraction=0.2, cycle_steps=10)
        state = TrainState()
        for step in range(steps):
            state.advance(samples=8, tokens=8 * 64, lr=lr_at(step, optim, total=total))
        return state.state_dict(), optim

    # A 30-step cosine run extended to 40: its last step trained near the minimum (1.04e-4),
    # where the 40-step schedule is still at 3.0e-4.
    state, optim = run("cosine", 30)
    moved = schedule_change(state, optim, total=40)
    assert moved.step == 30 and moved.lr_trained == pytest.approx(1.0355e-4, rel=1e-4)
    assert moved.lr_now == pytest.approx(lr_at(29, optim, total=40))
    assert moved.lr_next == pytest.approx(lr_at(30, optim, total=40))
    assert schedule_change(state, optim, total=30) is None  # resumed as it was
    # constant and wsd before its decay extend cleanly; wsd inside its decay does not.
    for schedule in ("constant", "wsd"):
        state, optim = run(schedule, 100)
        assert schedule_change(state, optim, total=200) is None
    state, optim = run("wsd", 30)
    assert schedule_change(state, optim, total=60) is not None
    # A new peak moves any schedule; a checkpoint without a rate (older) says nothing.
    state, optim = run("constant", 30)
    assert schedule_change(state, dataclasses.replace(optim, lr=2e-3), total=30).lr_now == 2e-3
    assert schedule_change({"step": 30, "tokens_seen": 0, "data_position": 0}, optim,
                           total=30) is None
    restored = TrainState()
    restored.load_state_dict(state)
    assert restored.lr == 1e-3
