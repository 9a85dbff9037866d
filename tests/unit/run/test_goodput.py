"""The goodput ledger's arithmetic over scripted records (raylm.run.goodput)."""

from __future__ import annotations

import pytest

from raylm.contracts.events import event_from_dict
from raylm.run.goodput import CAUSES, describe, goodput, table


def clock(t, compute, wait=0.0, evaluation=0.0, checkpoint=0.0, energy=None):
    return {"t": t, "compute_s": compute, "data_wait_s": wait, "eval_s": evaluation,
            "checkpoint_s": checkpoint, "energy_j": energy}


def script(invocation, *events):
    return [event_from_dict({"invocation": invocation, "event": e, "time": t, **f})
            for e, t, f in events]


def progress(t, step, c, **fields):
    return ("progress", t, {"step": step, "step_time": 1.0, "clock": c, **fields})


# 5-step windows of 10 s (9 s computing, 1 s waiting for data); a checkpoint every 10 steps.
LOST_AND_RESTARTED = script(
    "1",
    ("invocation", 0.0, {}),
    ("placing", 0.5, {}),
    ("placed", 2.0, {"resources_s": 1.0}),
    ("group_start", 3.0, {"workers": 2, "from_step": 0, "setup_s": 2.0}),  # ready at 5
    progress(15.0, 5, clock(15.0, 9, 1, energy=100.0)),
    progress(26.0, 10, clock(26.0, 17.5, 2, evaluation=1.0, checkpoint=0.5, energy=110.0)),
    progress(36.0, 15, clock(36.0, 26.5, 3, evaluation=1.0, checkpoint=0.5, energy=100.0)),
    ("failure", 40.0, {"error": "ActorDiedError: worker lost"}),
    ("placing", 41.0, {}),
    ("placed", 43.0, {"resources_s": 0.5}),
    ("group_start", 44.0, {"workers": 2, "from_step": 10, "setup_s": 3.0}),  # ready at 47
    progress(57.0, 15, clock(57.0, 9, 1, energy=100.0)),
    progress(67.0, 20, clock(67.0, 18, 2, energy=100.0)),
    ("end", 70.0, {"status": "finished"}),
)


def test_a_lost_worker_splits_the_wall_time_by_cause():
    g = goodput(LOST_AND_RESTARTED)
    assert list(g.seconds) == list(CAUSES)
    assert g.total_s == 70.0
    assert g.seconds == {
        "productive": 35.5,  # the windows the final model holds: 9 + 8.5 + 9 + 9 s
        "recomputed": 14.0,  # steps 11-15 (9 + 1 s), then 4 s from their report to the loss
        "data_wait": 4.0, "checkpoint": 0.5, "evaluation": 1.0, "preemption": 0.0,
        "benchmarks": 0.0,
        "generation": 0.0, "weight_transfer": 0.0,  # not reinforcement learning
        "resources": 1.5,  # Ray's measure of both placements
        "startup": 4.0,  # 0 -> ready at 5, less 1 s waiting for resources
        "restart": 6.5,  # the loss at 40 -> ready at 47, less 0.5 s waiting for resources
        "reporting": 0.0,  # every window's wall time is its clock's
        "finish": 3.0,  # the last report at 67 -> the end at 70
        "other": 0.0}
    assert g.goodput == pytest.approx(35.5 / 70, abs=1e-4)
    assert g.recomputed_steps == 5
    assert g.energy_wasted_j == pytest.approx(100.0)
    assert sum(g.seconds.values()) == pytest.approx(g.total_s)
    line = describe(g)
    assert line.startswith("goodput 50.7% of 70.0s (productive 35.5s; recomputed 14.0s")
    assert "5 steps trained twice" in line
    t = table(g)
    assert t["cause"] == list(CAUSES) and sum(t["share"]) == pytest.approx(1.0, abs=1e-3)


def test_reinforcement_learning_waits_are_causes_of_their_own_and_lost_with_their_steps():
    """GRPO's clock counts waiting for completions and handing weights over apart from
    computing; a lost window's share of them is recomputed time, like its compute's."""
    def rl(t, compute, generate, transfer):
        return {**clock(t, compute), "generate_s": generate, "transfer_s": transfer}

    g = goodput(script(
        "1",
        ("invocation", 0.0, {}),
        ("group_start", 0.0, {"workers": 1, "from_step": 0, "setup_s": 2.0}),  # ready at 2
        progress(12.0, 10, rl(12.0, 6, 3, 1)),
        progress(22.0, 20, rl(22.0, 12, 6, 2)),
        ("failure", 22.0, {"error": "ActorDiedError: worker lost"}),
        ("group_start", 23.0, {"workers": 1, "from_step": 10, "setup_s": 1.0}),  # ready at 24
        progress(34.0, 20, rl(34.0, 6, 3, 1)),
        ("end", 34.0, {"status": "finished"}),
    ))
    s = g.seconds
    assert (s["productive"], s["generation"], s["weight_transfer"]) == (12.0, 6.0, 2.0)
    assert s["recomputed"] == 10.0 and s["reporting"] == 0.0  # steps 11-20 the first time
    assert sum(s.values()) == pytest.approx(g.total_s) and g.total_s == 34.0


def test_preemption_resize_and_a_later_invocation_that_goes_back():
    """A preempted group drains after its checkpoint (no step lost); a resize replaces a
    healthy group (its gap starts at the old group's last report); a second invocation
    resumes from a checkpoint before the first's last report, which makes those steps
    recomputed; the hours between invocations are no one's."""
    first = script(
        "1",
        ("invocation", 0.0, {}),
        ("group_start", 1.0, {"workers": 2, "from_step": 0, "setup_s": 1.0}),  # ready at 2
        progress(12.0, 5, clock(12.0, 10)),
        ("failure", 15.0, {"error": "Preempted: a worker was asked to stop (SIGTERM)"}),
        ("group_start", 17.0, {"workers": 2, "from_step": 5, "setup_s": 1.0}),  # ready at 18
        progress(28.0, 10, clock(28.0, 10)),
        ("group_start", 31.0, {"workers": 3, "from_step": 10, "setup_s": 1.0}),  # resize
        progress(42.0, 15, clock(42.0, 10)),
        ("end", 44.0, {"status": "failed"}),
    )
    second = script(
        "2",
        ("invocation", 1000.0, {}),
        ("group_start", 1001.0, {"workers": 1, "from_step": 12, "setup_s": 1.0}),
        progress(1010.0, 15, clock(1010.0, 6)),
        ("end", 1011.0, {"status": "finished"}),
    )
    g = goodput(first + second)
    s = g.seconds
    assert g.total_s == 44.0 + 11.0
    assert s["preemption"] == 3.0  # report at 12 -> the group's end at 15
    assert s["restart"] == (18 - 15) + (32 - 28)  # after the preemption; the resize
    assert s["startup"] == 2.0 + 2.0  # each invocation's first group
    # Steps 13-15 of the first invocation (3 of its last window's 5) were trained again.
    assert g.recomputed_steps == 3 and s["recomputed"] == pytest.approx(6.0)
    assert s["productive"] == pytest.approx(10 + 10 + 4 + 6)
    assert sum(s.values()) == pytest.approx(g.total_s)
    assert g.energy_wasted_j is None


def test_a_group_lost_before_it_reported_and_a_placement_that_timed_out():
    g = goodput(script(
        "1",
        ("invocation", 0.0, {}),
        ("placing", 0.0, {}),
        ("placing", 30.0, {}),  # the first attempt found no resources and timed out
        ("placed", 35.0, {"resources_s": 4.0}),
        ("failure", 40.0, {"error": "ActorDiedError"}),  # before its group reported
        ("group_start", 41.0, {"workers": 1, "from_step": 0, "setup_s": 1.0}),
        progress(52.0, 5, clock(52.0, 10)),
        ("end", 52.0, {"status": "failed"}),
    ))
    s = g.seconds
    assert s["resources"] == 34.0 and s["startup"] == 42.0 - 34.0
    assert s["recomputed"] == 0.0 and s["productive"] == 10.0
    assert sum(s.values()) == pytest.approx(52.0)


def test_energy_wasted_is_zero_when_measured_and_nothing_was_lost():
    g = goodput(script(
        "1",
        ("invocation", 0.0, {}),
        ("group_start", 1.0, {"workers": 1, "from_step": 0, "setup_s": 1.0}),
        progress(12.0, 5, clock(12.0, 10, energy=500.0)),
        ("end", 13.0, {"status": "failed"}),
    ))
    assert g.energy_wasted_j == 0.0 and g.recomputed_steps == 0


def test_a_checkpoint_saved_after_the_last_report_the_controller_took_counts():
    """The controller takes reports one per poll, so a group may be lost with reports it never
    took. The next group resumes from a checkpoint saved after the last one it did take: the
    checkpoint's clock says what the steps up to it cost, and only the time after it is lost."""
    g = goodput(script(
        "1",
        ("invocation", 0.0, {}),
        ("group_start", 1.0, {"workers": 2, "from_step": 0, "setup_s": 1.0}),  # ready at 2
        progress(12.0, 5, clock(12.0, 9, 1)),
        ("failure", 25.0, {"error": "ActorDiedError"}),
        ("group_start", 27.0, {"workers": 2, "from_step": 6, "setup_s": 1.0,
                               "resumed_clock": {**clock(15.0, 11, 1.5, checkpoint=0.5),
                                                 "group": 1.0}}),
        progress(35.0, 10, clock(35.0, 7, 1)),
        ("end", 36.0, {"status": "failed"}),
    ))
    s = g.seconds
    assert s["productive"] == 11 + 7 and s["data_wait"] == 1.5 + 1
    assert s["recomputed"] == 25 - 15 and g.recomputed_steps == 0
    assert s["checkpoint"] == 0.5 and s["restart"] == 28 - 25
    assert sum(s.values()) == pytest.approx(36.0)


def test_reports_the_end_and_each_part_of_a_start_are_placed():
    """The loop's time outside its clocks is ``reporting``, a finished run's tail after its last
    report is ``finish``, and a group's start splits into the parts its records name."""
    phases = {"process_s": 3.0, "ray_train_s": 1.0, "stream_s": 0.1, "build_s": 0.6,
              "restore_s": 0.2, "validation_s": 0.1, "first_batch_s": 0.5}
    g = goodput(script(
        "1",
        ("invocation", 0.0, {}),
        ("placing", 2.0, {}),
        ("placed", 7.0, {"resources_s": 0.5}),
        ("group_start", 7.5, {"workers": 2, "from_step": 0, "setup_s": 2.0,
                              "phases": phases}),  # ready at 9.5
        progress(19.5, 5, clock(19.5, 8, 0.5)),  # 1.5 s of the 10 s window outside its clock
        progress(28.5, 10, clock(28.5, 16, 1)),  # 0.5 s
        ("waited_for_benchmarks", 29.0, {"seconds": 0.5}),
        ("end", 31.5, {"status": "finished"}),
    ))
    s = g.seconds
    assert (s["reporting"], s["finish"], s["benchmarks"], s["other"]) == (2.0, 2.5, 0.5, 0.0)
    assert s["startup"] == 9.0 and s["resources"] == 0.5  # 0 -> ready at 9.5
    assert g.startup_phases == {
        "controller": 2.0, "resources": 0.5,
        "workers": 1.0,  # placing at 2 -> the loop at 7.5, less resources, imports, Ray Train
        "imports": 3.0, "ray_train": 1.0, "stream": 0.1, "build": 0.6, "restore": 0.2,
        "validation": 0.1, "first_batch": 0.5, "setup_other": 0.5}
    assert sum(g.startup_phases.values()) == pytest.approx(s["startup"] + s["resources"])
    assert sum(s.values()) == pytest.approx(g.total_s)
