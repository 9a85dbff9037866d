from __future__ import annotations

import math

import pytest
import torch

from raylm.optim import SCHEDULES, lr_at, param_groups

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
