"""The worker loop's pure parts, no Ray cluster: what happens at each step boundary, and the
step meter's arithmetic."""

from __future__ import annotations

import threading

import pytest
import torch

from raylm.config import load_config
from raylm.data.streams import DataStall, FirstBatch
from raylm.workers.energy import run_figures
from raylm.workers.loop import Boundary, StepMeter, at_boundary, compile_blocks
from raylm.workers.step import TrainState

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
    monkeypatch.setattr("raylm.workers.loop.time.perf_counter", lambda: clock[0])
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
        FirstBatch(_stream(release)).wait(timeout_s=0.2, keep_waiting=False,
                    waiting_for=lambda: "rank 1's reader lacks CPU 0.1", log=print)
    release.set()


def test_first_batch_keeps_waiting_on_an_autoscaling_cluster_and_says_so():
    release, said = threading.Event(), []

    def log(message):
        said.append(message)
        if len(said) == 2:
            release.set()  # the autoscaler added a node

    batch = FirstBatch(_stream(release)).wait(timeout_s=0.1, keep_waiting=True,
                        waiting_for=lambda: "a node", log=log)
    assert batch["input_ids"].shape == (1,)
    assert len(said) == 2 and all(
        m.startswith("raylm: warning: no training batch after ") and
        m.endswith(": a node; waiting on, as scaling.wait_for_nodes asks") for m in said)


def test_first_batch_passes_on_the_streams_own_error():
    release = threading.Event()
    release.set()
    with pytest.raises(OSError, match="row group 3 is unreadable"):
        FirstBatch(_stream(release, fail=True)).wait(timeout_s=5, keep_waiting=False,
                    waiting_for=lambda: "", log=print)


class Counter:
    """A GPU energy counter whose readings the test sets (the real one reads NVML; the GPU
    tests read it on a real GPU)."""

    def __init__(self, joules: list[float]) -> None:
        self.joules = joules

    def read(self) -> float:
        return self.joules.pop(0)


def test_energy_windows_follow_each_other_and_totals_survive_a_restart(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("raylm.workers.loop.time.perf_counter", lambda: clock[0])
    monkeypatch.setattr("raylm.workers.loop.peak_memory_bytes", lambda device: 0)
    # The window waits for the GPU to finish its queue; there is none here.
    monkeypatch.setattr("raylm.workers.loop.torch.cuda.synchronize", lambda device=None: None)
    # One GPU: 1,000 J at setup, 1,300 J after 10 steps (2 s, setup included), 1,700 J after
    # the next 10 (evaluation and a checkpoint between the windows count too), then a window
    # too short for the counter to move.
    meter = StepMeter(flops_per_token=1.0, peak_flops=None, world_size=1,
                      device=torch.device("cuda"),
                      energy=Counter([1000.0, 1300.0, 1700.0, 1700.0]), energy_since=None)
    state = TrainState()
    windows = []
    for _ in range(3):
        for _ in range(10):
            meter.step_begins()
            meter.step_ends(tokens=100)
        clock[0] += 2.0
        w = meter.window()
        state.add_usage(joules=w.pop("energy_j"), gpu_seconds=w.pop("gpu_s"))
        windows.append(w)
        meter.window_reset()
    assert windows[0]["joules_per_step"] == pytest.approx(30.0)
    assert windows[0]["joules_per_token"] == pytest.approx(0.3)
    assert windows[0]["watts_per_gpu"] == pytest.approx(150.0)
    assert windows[1]["joules_per_step"] == pytest.approx(40.0)
    # Not measured is not free: no per-step, per-token or power figure.
    assert [windows[2][k] for k in ("joules_per_step", "joules_per_token",
                                    "watts_per_gpu")] == [None] * 3
    # The run's totals go into the checkpoint and continue in the next worker group.
    resumed = TrainState()
    resumed.load_state_dict(state.state_dict())
    resumed.add_usage(joules=360.0, gpu_seconds=1.0)
    figures = run_figures(joules=resumed.energy_j, gpu_seconds=resumed.gpu_s,
                          gpu_hour_price=2.5)
    assert figures["energy_kwh"] == pytest.approx(1060.0 / 3.6e6)
    assert figures["gpu_hours"] == pytest.approx(7.0 / 3600)
    assert figures["cost"] == pytest.approx(2.5 * 7.0 / 3600)


def test_cpu_runs_report_no_energy():
    meter = StepMeter(flops_per_token=1.0, peak_flops=None, world_size=2,
                      device=torch.device("cpu"))
    meter.step_begins()
    meter.step_ends(tokens=10)
    w = meter.window()
    assert [w[k] for k in ("energy_j", "gpu_s", "joules_per_step", "watts_per_gpu",
                           "joules_per_token")] == [None] * 5
    state = TrainState()
    state.add_usage(joules=None, gpu_seconds=None)
    assert run_figures(joules=state.energy_j, gpu_seconds=state.gpu_s,
                       gpu_hour_price=2.0) == {"energy_kwh": None, "gpu_hours": None,
                                               "cost": None}


@pytest.mark.parametrize("setting, device, want", [
    ("auto", "cuda", True), ("auto", "cpu", False), (True, "cpu", True), (False, "cuda", False)])
def test_model_compile_auto_compiles_on_cuda_workers_only(setting, device, want):
    assert compile_blocks(setting, torch.device(device)) is want
