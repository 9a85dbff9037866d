"""raylm.bench startup's figures, from scripted records of a run whose worker was killed."""

from __future__ import annotations

import pytest

from raylm.bench.startup import figures
from raylm.contracts.events import event_from_dict


def record(event, t, **fields):
    return event_from_dict({"invocation": "1", "event": event, "time": t, **fields})


def clock(t, compute):
    return {"t": t, "compute_s": compute, "data_wait_s": 0.0, "eval_s": 0.0,
            "checkpoint_s": 0.0, "energy_j": None}


PHASES = {"process_s": 2.0, "ray_train_s": 0.5, "stream_s": 0.1, "build_s": 1.0,
          "restore_s": 0.0, "validation_s": 0.1, "first_batch_s": 0.2}

# The command at 100; the driver's record from 104; the group ready at 112 (setup 1.5 s);
# steps of 0.1 s; a kill at 114.0, seen at 115; the new group ready at 121.5.
RECORDS = [
    record("invocation", 104.0),
    record("placing", 106.0),
    record("placed", 110.4, resources_s=0.0),
    record("group_start", 110.5, workers=2, from_step=0, setup_s=1.5, phases=PHASES),
    *[record("progress", 112.0 + 0.1 * s + 0.4, step=s, step_time=0.1,
             clock=clock(112.0 + 0.1 * s + 0.4, 0.1 * s + 0.4)) for s in range(1, 16)],
    record("failure", 115.0, error="ActorDiedError: worker lost"),
    record("placing", 116.0),
    record("placed", 119.0, resources_s=0.0),
    record("group_start", 119.0, workers=2, from_step=10,
           setup_s=2.5, phases={**PHASES, "restore_s": 1.0}),
    *[record("progress", 121.5 + 0.1 * (s - 10) + 0.5, step=s, step_time=0.1,
             clock=clock(121.5 + 0.1 * (s - 10) + 0.5, 0.1 * (s - 10) + 0.5))
      for s in range(11, 21)],
    record("end", 125.0, status="finished"),
]


def test_first_step_recovery_and_report_cost_come_from_the_records():
    f = figures(RECORDS, started=100.0, kill={"killed_at": 114.0, "killed_pids": [1]},
                exited=126.5)
    assert f["first_step_s"] == 12.5  # step 1 reported at 112.5
    assert f["exit_s"] == 1.5  # the end record at 125.0, the command gone at 126.5
    p = f["phases"]
    assert p["cli"] == 4.0 and p["controller"] == 2.0 and p["first_step"] == 0.5
    assert (p["imports"], p["ray_train"], p["build"]) == (2.0, 0.5, 1.0)
    assert p["workers"] == pytest.approx(2.0)  # placing at 106 -> the loop at 110.5, less 2.5
    assert f["recovery_s"] == 8.1  # the kill at 114 -> step 11 at 122.1
    r = f["recovery_phases"]
    assert r["detect"] == 1.0 and r["controller"] == 1.0 and r["restore"] == 1.0
    assert r["first_step"] == pytest.approx(0.6)
    assert f["reports"] == 25 and f["report_cost_s"] == 0.0
