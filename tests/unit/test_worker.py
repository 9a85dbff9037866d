"""The worker loop's pure parts, no Ray cluster: what happens at each step boundary, and the
step meter's arithmetic."""

from __future__ import annotations

import time

import pytest
import torch

from raylm.config import load_config
from raylm.worker import Boundary, StepMeter, at_boundary

CFG = load_config(None, ["--train.steps=30", "--train.log_every=5", "--train.eval_every=10",
                         "--checkpoint.every=15"])


@pytest.mark.parametrize(("step", "asked", "want"), [
    (3, False, Boundary(report=False, evaluate=False, save=False, preempted=False)),
    (5, False, Boundary(report=True, evaluate=False, save=False, preempted=False)),
    (10, False, Boundary(report=True, evaluate=True, save=False, preempted=False)),
    (15, False, Boundary(report=True, evaluate=False, save=True, preempted=False)),
    # A SIGTERM: save now, at an odd step, and skip the evaluation.
    (7, True, Boundary(report=True, evaluate=False, save=True, preempted=True)),
    (20, True, Boundary(report=True, evaluate=False, save=True, preempted=True)),
    # At the last step the final save and evaluation happen anyway; nothing to preempt.
    (30, True, Boundary(report=True, evaluate=True, save=True, preempted=False)),
    (30, False, Boundary(report=True, evaluate=True, save=True, preempted=False)),
])
def test_at_boundary(step, asked, want):
    assert at_boundary(step, cfg=CFG, preempt_requested=asked) == want


def test_step_meter_counts_tokens_and_data_wait_per_window():
    meter = StepMeter(flops_per_token=6e6, peak_flops=1e9, world_size=2,
                      device=torch.device("cpu"))

    def slow_batches():
        while True:
            time.sleep(0.05)
            yield {"input_ids": torch.zeros(1)}

    batches = slow_batches()
    for _ in range(2):
        meter.step_begins()
        assert len(meter.fetch(batches, 2)) == 2
        time.sleep(0.05)  # the step's compute
        meter.step_ends(tokens=1000)
    w = meter.window()
    # 4 waits of 50 ms and 2 steps of 50 ms: two thirds of the window waited for data.
    assert w["data_wait_fraction"] == pytest.approx(2 / 3, abs=0.1)
    assert w["tokens_per_s"] == pytest.approx(2000 / 0.3, rel=0.2)
    assert w["mfu"] == pytest.approx(w["tokens_per_s"] * 6e6 / 2e9)
    meter.window_reset()
    assert meter.window()["tokens_per_s"] == 0
    assert meter.window()["data_wait_fraction_run"] == pytest.approx(2 / 3, abs=0.1)
