"""The live metrics' arithmetic without Ray: what a report's figures become (the scrape of a
real endpoint is in tests/integration/test_train.py), and the communication benchmark's trace
reading on a trace of known intervals."""

from __future__ import annotations

import pytest

from raylm.bench.comm import trace_figures
from raylm.live import RUN_FIGURES, WORKER_FIGURES, LiveMetrics


class Gauge:
    def __init__(self) -> None:
        self.values: list[tuple[float, dict]] = []

    def set(self, value: float, *, tags: dict) -> None:
        self.values.append((value, tags))


def test_outside_ray_nothing_is_recorded(monkeypatch):
    import ray

    # The suite's process may hold a Ray connection of the integration tests' by now.
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    live = LiveMetrics("run-a", rank=0)
    assert live.gauges == {}
    live.record({"step": 5, "loss": 1.0})  # no error, nothing to record to


def test_a_report_sets_what_it_measured_in_the_series_units():
    live = LiveMetrics("run-a", rank=1)
    live.gauges = {key: Gauge() for _, _, key, _ in WORKER_FIGURES}
    live.factors = {key: factor for _, _, key, factor in WORKER_FIGURES}
    live.record({"step": 10, "loss": 2.5, "peak_memory_gb": 1.5, "energy_kwh": 0.002,
                 "mfu": None, "preempted": False, "val_loss": None})
    set_ = {k: g.values for k, g in live.gauges.items() if g.values}
    assert set_ == {"step": [(10.0, {"run": "run-a", "rank": "1"})],
                    "loss": [(2.5, {"run": "run-a", "rank": "1"})],
                    "peak_memory_gb": [(1.5 * 2**30, {"run": "run-a", "rank": "1"})],
                    "energy_kwh": [(pytest.approx(7200.0), {"run": "run-a", "rank": "1"})]}


def test_series_names_are_prometheus_names():
    import re

    for name, *_ in (*WORKER_FIGURES, *RUN_FIGURES):
        assert re.fullmatch(r"raylm_[a-z_]+", name), name


def event(name: str, ts: float, dur: float, *, tid: int = 1, **args) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_trace_figures_count_bytes_and_the_overlap_of_collectives_with_compute():
    events = [
        # The training thread: two operators, 0-100 and 150-200 us, and the collectives it
        # hands to gloo (their dims: output first for a gather, input second for a scatter).
        event("aten::mm", 0, 100),
        event("aten::add", 150, 50),
        event("c10d::_allgather_base_", 10, 1, **{"Input Dims": [[64, 2], [32, 2]],
                                                  "Input type": ["float", "float"]}),
        event("c10d::_reduce_scatter_base_", 160, 1, **{"Input Dims": [[32], [64]],
                                                        "Input type": ["c10::BFloat16",
                                                                       "c10::BFloat16"]}),
        event("c10d::allreduce_", 199, 1, **{"Input Dims": [[[1]]],
                                             "Input type": ["TensorList"]}),
        # gloo's thread: 50-120 (half under the first operator) and 180-220.
        event("gloo:all_gather", 50, 70, tid=2),
        event("gloo:all_reduce", 180, 40, tid=2),
    ]
    figures = trace_figures(events, steps=2)
    assert figures["all_gather_bytes"] == 64 * 2 * 4 / 2
    assert figures["reduce_scatter_bytes"] == 64 * 2 / 2
    assert figures["all_reduces"] == 0.5
    # 110 us in collectives, of which 50 (50-100) + 20 (180-200) ran beside compute.
    assert figures["collective_s"] == pytest.approx(110e-6 / 2)
    assert figures["overlapped_share"] == pytest.approx(70 / 110)
    assert figures["exposed_s"] == pytest.approx(40e-6 / 2)
