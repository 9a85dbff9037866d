"""The worker loop's pure parts, no Ray cluster: what happens at each step boundary, and the
step meter's arithmetic."""

from __future__ import annotations

import threading

import pytest
import torch

from raylm.config import load_config
from raylm.worker import Boundary, DataStall, StepMeter, at_boundary, first_batch

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


def test_step_meter_counts_tokens_and_data_wait_per_window(monkeypatch):
    clock = [100.0]  # the meter's perf_counter, advanced by hand: no timing noise
    monkeypatch.setattr("raylm.worker.time.perf_counter", lambda: clock[0])
    meter = StepMeter(flops_per_token=6e6, peak_flops=1e9, world_size=2,
                      device=torch.device("cpu"))

    def slow_batches():
        while True:
            clock[0] += 0.05  # each micro-batch keeps the step waiting 50 ms
            yield {"input_ids": torch.zeros(1)}

    batches = slow_batches()
    for _ in range(2):
        meter.step_begins()
        assert len(meter.fetch(batches, 2)) == 2
        clock[0] += 0.05  # the step's compute
        meter.step_ends(tokens=1000)
    w = meter.window()
    # 4 waits of 50 ms and 2 steps of 50 ms: two thirds of the 0.3 s window waited for data.
    assert w["data_wait_fraction"] == pytest.approx(2 / 3)
    assert w["tokens_per_s"] == pytest.approx(2000 / 0.3)
    assert w["mfu"] == pytest.approx(w["tokens_per_s"] * 6e6 / 2e9)
    assert w["elapsed_s"] == pytest.approx(0.3)
    clock[0] += 1.0  # evaluation and a checkpoint: outside every window
    meter.window_reset()
    clock[0] += 0.1
    after = meter.window()
    assert after["tokens_per_s"] == 0 and after["data_wait_fraction"] == 0
    assert after["data_wait_fraction_run"] == pytest.approx(2 / 3)


def _stream(release: threading.Event, *, fail: bool = False):
    release.wait()
    if fail:
        raise OSError("row group 3 is unreadable")
    yield {"input_ids": torch.zeros(1)}


def test_first_batch_names_what_a_stalled_stream_waits_for():
    release = threading.Event()
    with pytest.raises(DataStall, match=r"^no training batch after 0 s: rank 1's reader lacks "
                                        r"CPU 0.1; raise data.first_batch_timeout_s"):
        first_batch(_stream(release), timeout_s=0.2, keep_waiting=False,
                    waiting_for=lambda: "rank 1's reader lacks CPU 0.1", log=print)
    release.set()


def test_first_batch_keeps_waiting_on_an_autoscaling_cluster_and_says_so():
    release, said = threading.Event(), []

    def log(message):
        said.append(message)
        if len(said) == 2:
            release.set()  # the autoscaler added a node

    batch = first_batch(_stream(release), timeout_s=0.1, keep_waiting=True,
                        waiting_for=lambda: "a node", log=log)
    assert batch["input_ids"].shape == (1,)
    assert len(said) == 2 and all(
        m.startswith("raylm: warning: no training batch after ") and
        m.endswith(": a node; waiting on, as scaling.wait_for_nodes asks") for m in said)


def test_first_batch_passes_on_the_streams_own_error():
    release = threading.Event()
    release.set()
    with pytest.raises(OSError, match="row group 3 is unreadable"):
        first_batch(_stream(release, fail=True), timeout_s=5, keep_waiting=False,
                    waiting_for=lambda: "", log=print)
