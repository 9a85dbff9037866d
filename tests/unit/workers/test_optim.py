from __future__ import annotations

import math

import pytest
import torch

from raylm.workers.optim import SCHEDULES, lr_at, param_groups

KW = {"peak": 1.0, "warmup": 10, "total": 110, "min_ratio": 0.1}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_warmup_is_linear_and_reaches_peak(schedule):
    assert lr_at(0, schedule=schedule, **KW) == pytest.approx(0.1)
    assert lr_at(4, schedule=schedule, **KW) == pytest.approx(0.5)
    assert lr_at(9, schedule=schedule, **KW) == pytest.approx(1.0)
    assert lr_at(10, schedule=schedule, **KW) == pytest.approx(1.0)  # progress 0


def test_cosine_boundaries():
    assert lr_at(60, schedule="cosine", **KW) == pytest.approx(0.55)  # halfway: mean
    assert lr_at(110, schedule="cosine", **KW) == pytest.approx(0.1)
    assert lr_at(500, schedule="cosine", **KW) == pytest.approx(0.1)  # clamped past the end
    assert lr_at(109, schedule="cosine", **KW) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.99)))


def test_linear_constant_wsd_cyclical_boundaries():
    assert lr_at(60, schedule="linear", **KW) == pytest.approx(0.55)
    assert lr_at(110, schedule="linear", **KW) == pytest.approx(0.1)
    assert lr_at(110, schedule="constant", **KW) == 1.0
    # wsd with 20% decay: stable through progress 0.8 (step 90), then linear to min.
    assert lr_at(90, schedule="wsd", **KW) == pytest.approx(1.0)
    assert lr_at(100, schedule="wsd", **KW) == pytest.approx(0.55)
    assert lr_at(110, schedule="wsd", **KW) == pytest.approx(0.1)
    cyc = {**KW, "cycle_steps": 20}
    assert lr_at(10, schedule="cyclical", **cyc) == pytest.approx(1.0)
    assert lr_at(20, schedule="cyclical", **cyc) == pytest.approx(0.1)
    assert lr_at(25, schedule="cyclical", **cyc) == pytest.approx(0.55)
    assert lr_at(30, schedule="cyclical", **cyc) == pytest.approx(1.0)


def test_no_warmup_and_unknown_schedule():
    assert lr_at(0, schedule="cosine", peak=2.0, warmup=0, total=10) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="unknown schedule 'step'"):
        lr_at(0, schedule="step", **KW)


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
    from raylm.workers.optim import schedule_change
    from raylm.workers.step import TrainState

    def run(schedule, total, steps=30, **kw):
        args = dict(schedule=schedule, peak=1e-3, warmup=5, total=total, min_ratio=0.1,
                    decay_fraction=0.2, cycle_steps=10, **kw)
        state = TrainState()
        for step in range(steps):
            state.advance(samples=8, tokens=8 * 64, lr=lr_at(step, **args))
        return state.state_dict(), args

    # A 30-step cosine run extended to 40: its last step trained near the minimum (1.04e-4),
    # where the 40-step schedule is still at 3.0e-4.
    state, args = run("cosine", 30)
    moved = schedule_change(state, **{**args, "total": 40})
    assert moved["step"] == 30 and moved["lr_trained"] == pytest.approx(1.0355e-4, rel=1e-4)
    assert moved["lr_now"] == pytest.approx(lr_at(29, **{**args, "total": 40}))
    assert moved["lr_next"] == pytest.approx(lr_at(30, **{**args, "total": 40}))
    assert schedule_change(state, **args) is None  # resumed as it was
    # constant and wsd before its decay extend cleanly; wsd inside its decay does not.
    for schedule in ("constant", "wsd"):
        state, args = run(schedule, 100)
        assert schedule_change(state, **{**args, "total": 200}) is None
    state, args = run("wsd", 30)
    assert schedule_change(state, **{**args, "total": 60}) is not None
    # A new peak moves any schedule; a checkpoint without a rate (older) says nothing.
    state, args = run("constant", 30)
    assert schedule_change(state, **{**args, "peak": 2e-3})["lr_now"] == 2e-3
    assert schedule_change({"step": 30, "tokens_seen": 0, "data_position": 0}, **args) is None
    restored = TrainState()
    restored.load_state_dict(state)
    assert restored.lr == 1e-3
