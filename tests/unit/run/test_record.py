"""The run's record (raylm.run.record) fed reports as the Ray Train controller feeds it, no Ray:
restart and resize detection from the reports alone, what it writes where, and its storage
traffic in object storage."""

from __future__ import annotations

import json

import pytest

from raylm import storage
from raylm.contracts import EARLIER_REPORTS, Event
from raylm.contracts.events import Progress
from raylm.run import record
from raylm.run.tracking import Tracker


def report(step: int, *, group: float, workers: int = 2, resumed: int | None = None,
           val: float | None = None, elapsed: float | None = None) -> dict:
    """Rank 0's metrics as raylm's worker loop reports them after ``step``."""
    m = {"step": step, "loss": 5.0 - step / 100, "lr": 1e-3, "grad_norm": 1.0,
         "tokens_per_s": 1000.0, "tokens_seen": step * 256, "data_wait_fraction": 0.01,
         "data_wait_fraction_run": 0.02, "mfu": None, "elapsed_s":
         elapsed if elapsed is not None else float(step - (resumed or 0)),
         "peak_memory_gb": 0.1, "workers": workers, "accumulation": 1, "micro_batch": 4,
         "attention_backend": "sdpa-flash-cpu", "precision": "fp32",
         "resumed_from_step": resumed, "group_started": group, "data_startup_s": 0.5,
         "preempted": False}
    if val is not None:
        m["val_loss"] = val
    return m


def announce(*, group: float, workers: int = 2, resumed: int | None = None) -> dict:
    """A worker group's first report, before it trains."""
    return {**report(resumed or 0, group=group, workers=workers, resumed=resumed),
            "event": Event.GROUP_START}


class Boom(RuntimeError):
    pass


def test_restarts_and_resizes_come_from_the_reports(tmp_path, capsys):
    rd = str(tmp_path / "run")
    r = record.RunRecord(rd, total_steps=30, tracker=Tracker())
    r.report(announce(group=100.0), None)
    for step in (5, 10):
        r.report(report(step, group=100.0), "checkpoint_a" if step == 10 else None)
    r.failure({1: Boom("node lost\nmore")})
    # A group of 1 resumes from step 10; its announcement is how the record learns of it.
    r.report(announce(group=200.0, workers=1, resumed=10), None)
    r.report(report(15, group=200.0, workers=1, resumed=10), None)
    r.report(report(20, group=200.0, workers=1, resumed=10), "checkpoint_b")
    # Grown back without a failure (the announcement may also be missed: the first report
    # with a new group time starts the group as well).
    r.report(report(25, group=300.0, resumed=20), None)
    r.report(report(30, group=300.0, resumed=20, val=4.2), "checkpoint_c")
    out = capsys.readouterr().out
    assert "raylm: restart 2 -> 1 workers, resumed from step 10" in out
    assert "raylm: resize 1 -> 2 workers, resumed from step 20" in out
    assert "step 30/30  loss 4.7000" in out and f"checkpoint {rd}/checkpoint_c" in out

    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s == r.summary().to_dict() and s["status"] == "running"
    assert (s["final_step"], s["val_loss"], s["workers"]) == (30, 4.2, 2)
    assert s["checkpoint_path"] == f"{rd}/checkpoint_c" and s["resumed_from_step"] is None
    assert (s["restarts"], s["resizes"], s["failures"]) == (1, 2, 1)
    restart, resize = s["interruptions"]
    assert restart["cause"] == "Boom: node lost" and restart["at_step"] == 10
    assert resize["event"] == "resize" and resize["steps_redone"] == 0
    # Locally every record is appended as it happens, and read back in order.
    events = record.read(rd)
    assert [e.KIND for e in events] == [
        "invocation", "group_start", "progress", "progress", "failure", "group_start",
        "progress", "progress", "group_start", "progress", "progress"]
    assert events[5].time == 200.0 and events[5].from_step == 10


def test_a_group_the_controller_never_heard_of_still_makes_a_restart(tmp_path):
    r = record.RunRecord(str(tmp_path), total_steps=30, tracker=Tracker())
    # The first group died before its announcement was polled: only its failure is known.
    r.failure({0: Boom("killed")})
    r.report(announce(group=200.0, resumed=5), None)
    r.report(report(10, group=200.0, resumed=5), "checkpoint_a")
    s = r.summary()
    assert (s.restarts, s.resizes, s.failures) == (1, 0, 1)
    (restart,) = s.interruptions
    assert restart.from_workers is None and restart.to_workers == 2
    assert restart.resumed_from_step == 5 and restart.time_lost_s is None


def test_object_storage_gets_segments_at_checkpoints_and_linear_traffic(tmp_path, monkeypatch):
    """``log_every=1``, a checkpoint every 10 steps, run dir on a file:// URI: the event log is
    never read back or rewritten, so bytes written grow with the steps and nothing is read."""
    traffic = {"written": 0, "read": 0}
    write, read = storage.write_bytes, storage.read_bytes

    def counting_write(path, data):
        if "/events" in str(path):
            traffic["written"] += len(data)
        write(path, data)

    def counting_read(path):
        data = read(path)
        if "/events" in str(path):
            traffic["read"] += len(data)
        return data

    monkeypatch.setattr(storage, "write_bytes", counting_write)
    monkeypatch.setattr(storage, "read_bytes", counting_read)

    def run(steps: int) -> dict[str, int]:
        traffic.update(written=0, read=0)
        rd = f"file://{tmp_path}/bucket/{steps}"
        r = record.RunRecord(rd, total_steps=steps, tracker=Tracker())
        for step in range(1, steps + 1):
            r.report(report(step, group=1.0), f"checkpoint_{step}" if step % 10 == 0 else None)
        counted = dict(traffic)
        assert storage.list_files(f"{rd}/events") == [
            f"{r.invocation}-{i:06d}.jsonl" for i in range(steps // 10)]
        assert not storage.is_file(f"{rd}/events.jsonl")
        # The invocation, its group start and a progress per step.
        assert len(record.read(rd)) == steps + 2
        return counted

    hundred, two_hundred = run(100), run(200)
    assert hundred["read"] == 0 and two_hundred["read"] == 0
    assert two_hundred["written"] == pytest.approx(2 * hundred["written"], rel=0.02)
    print(f"events written: 100 steps {hundred['written']} B, 200 steps "
          f"{two_hundred['written']} B; read: 0 B")


def test_reports_held_back_reach_the_record_in_order_timed_when_made(tmp_path, capsys):
    """A worker whose last report waits for the controller's poll holds the next ones back
    and sends them with a later report (raylm.workers.checkpoint.Checkpointer): the record
    takes each as if it had come alone, at the time rank 0 made it."""
    r = record.RunRecord(str(tmp_path), total_steps=4, tracker=Tracker())
    r.after_report(None, [announce(group=100.0)], None)
    made = [{**report(step, group=100.0), "clock": {"t": 100.0 + step, "compute_s": step,
             "data_wait_s": 0.0, "eval_s": 0.0, "checkpoint_s": 0.0, "energy_j": None}}
            for step in (1, 2, 3, 4)]
    last = {**made[3], EARLIER_REPORTS: made[:3]}
    r.after_report(None, [last, dict(last)], _Checkpoint(f"{tmp_path}/checkpoint_4"))
    progress = [e for e in record.read(str(tmp_path)) if isinstance(e, Progress)]
    assert [(e.step, e.time) for e in progress] == [(1, 101.0), (2, 102.0), (3, 103.0),
                                                         (4, 104.0)]
    out = capsys.readouterr().out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == [
        "1/4", "2/4", "3/4", "4/4"]
    assert f"checkpoint {tmp_path}/checkpoint_4" in out.splitlines()[-1]
    assert r.summary().final_step == 4 and r.latest.step == 4
    assert r.goodput().seconds["productive"] == 4.0


class _Checkpoint:
    def __init__(self, path: str) -> None:
        self.path = path


def test_a_failing_hook_never_reaches_the_controller(tmp_path, capsys):
    r = record.RunRecord(str(tmp_path), total_steps=10, tracker=Tracker())
    r.after_report(None, [{"step": 1}], None)  # a report without the worker's fields
    out = capsys.readouterr().out
    assert ("warning: raylm run record: Malformed: a report lacks ['group_started', 'workers']"
            in out)


class CountingTracker(Tracker):
    """A tracker that keeps what it is asked to log."""

    def __init__(self) -> None:
        self.counts: list[tuple[int, dict[str, int]]] = []

    def __bool__(self) -> bool:
        return True

    def log_events(self, events, counts, step) -> None:
        self.counts.append((step, counts))


def test_fault_counts_are_logged_from_the_first_step_even_when_zero(tmp_path, capsys):
    tracker = CountingTracker()
    rec = record.RunRecord(str(tmp_path), total_steps=30, tracker=tracker)
    rec.report(announce(group=1.0), None)
    for step in (10, 20):
        rec.report(report(step, group=1.0), None)
    # A dashboard comparing runs sees zeros for a clean run, logged once.
    assert tracker.counts == [(10, {"restarts": 0, "resizes": 0, "failures": 0,
                                    "numerical_faults": 0})]
    rec.failure({0: Boom("worker lost")})
    rec.report(announce(group=2.0, resumed=20), None)
    rec.report(report(30, group=2.0, resumed=20), None)
    assert tracker.counts[1] == (30, {"restarts": 1, "resizes": 0, "failures": 1,
                                      "numerical_faults": 0})


class EndingTracker(Tracker):
    """A tracker that keeps how the run's end reached it."""

    def __init__(self) -> None:
        self.files: list[tuple[str, ...]] = []
        self.finished: list[bool] = []

    def __bool__(self) -> bool:
        return True

    def log_run_files(self, run_dir, names) -> None:
        self.files.append(names)

    def finish(self, *, failed: bool) -> None:
        self.finished.append(failed)


def test_the_record_alone_writes_the_final_summary_and_closes_the_mlflow_run(tmp_path):
    rd = str(tmp_path / "run")
    tracker = EndingTracker()
    ending = record.Ending(row_group_sizes=[8], seed=0, window=4)
    r = record.RunRecord(rd, total_steps=10, tracker=tracker, ending=ending)
    r.report(announce(group=1.0), None)
    r.report(report(10, group=1.0, val=4.5), "checkpoint_10")
    # While the run goes, the live summary is not the end's.
    assert json.loads(storage.read_text(storage.join(rd, "summary.json")))["status"] == "running"
    assert r.final_summary() is None
    r.finish(failed=False)
    final = r.final_summary()
    assert final.status == "finished" and final.final_step == 10
    assert final.val_loss == 4.5 and final.wall_s >= 0 and final.samples is None
    assert tracker.files == [("summary.json", "run.json")] and tracker.finished == [False]
    # Another invocation's record does not take this summary for its own.
    other = record.RunRecord(rd, total_steps=10, tracker=Tracker(), ending=ending)
    assert other.final_summary() is None
    other.finish(failed=True)
    assert other.final_summary().status == "failed"


def test_failures_that_recur_at_one_step_end_the_run_but_preemptions_do_not(tmp_path):
    from ray.train.v2._internal.execution.failure_handling import FailureDecision

    from raylm.faults import Preempted

    r = record.RunRecord(str(tmp_path), total_steps=100, tracker=Tracker())
    end = record.EndOfRun(r, max_failures_at_one_step=3)
    r.report(announce(group=1.0), None)
    r.report(report(40, group=1.0), "checkpoint_40")
    for n in range(2):  # each restart resumes at 40 and fails again before step 50
        r.failure({0: Boom("bad data")})
        r.report(announce(group=2.0 + n, resumed=40), None)
        end.before_controller_execute_failure_decision(FailureDecision.RETRY)
    r.failure({1: Preempted("spot node reclaimed")})  # not counted
    end.before_controller_execute_failure_decision(FailureDecision.RETRY)
    r.failure({0: Boom("bad data")})
    with pytest.raises(record.RepeatedFailure, match="3 failures in a row without training "
                                                     "past step 40"):
        end.before_controller_execute_failure_decision(FailureDecision.RETRY)
    # Progress past step 40 starts the count again.
    r.report(announce(group=9.0, resumed=40), None)
    r.report(report(50, group=9.0, resumed=40), None)
    r.failure({0: Boom("node lost")})
    end.before_controller_execute_failure_decision(FailureDecision.RETRY)
    # 0: no such limit.
    record.EndOfRun(r).before_controller_execute_failure_decision(FailureDecision.RETRY)
