"""The run's record, kept on the Ray Train controller from the workers' reports.

:class:`RunRecord` is a Ray Train ``UserCallback``: Ray runs it on the controller, which sees every
report once (not once per worker). It is the only writer of what the run says about itself while it
runs: the progress lines, ``events.jsonl``, the restart and resize records, the live
``summary.json``, and the MLflow metrics and events (through the run's tracker). Nothing feeds it
but reports and worker exceptions, and what the driver gave it before the run started
(:meth:`RunRecord.note`: a ``schedule_moved`` record when a resume's settings move the learning
rate; :class:`Ending`: what finishing the run needs). When the run ends, the controller calls it
once more (``after_controller_finish``, through :class:`EndOfRun`): it writes the final summary
and logs the run's files to MLflow; the MLflow run is closed then, or by the driver once it has
logged the final model (:mod:`raylm.run.launch`). Of the run directory's files
(:mod:`raylm.contracts`) it writes ``events.jsonl`` and ``summary.json``.

How a restart or resize is detected: a worker group announces itself with a report as soon as
it is set up (``event: group_start``: workers, step resumed from), and every later report
carries the same ``group_started`` time. A report with a new one is that group's first: the
record adds a ``group_start`` record, and :func:`interruptions` derives, as a pure function of
the records, one record per change of group: ``restart`` when failures came between (a lost
worker or node, a preempted worker), ``resize`` when Ray Train replaced a healthy group. Each
says from how many workers to how many, the last step reported before (``at_step``), the step
resumed from, the steps trained again, and the time lost: wall time from the last report
before to the first report after, less the time the steps beyond ``at_step`` took at the speed
before. Reports reach the controller when it polls the workers (:mod:`raylm.run.launch` sets
how often): a group that dies before its announcement was polled is not seen, and its failures
count towards the next restart, whose "from" side is then unknown (None).

Storage traffic grows linearly with the run: on a local or mounted path each record is one
small append; in object storage (no appends) records are buffered and written as a new
numbered segment at every checkpoint and failure, so nothing is ever read back or rewritten.
``summary.json`` (a few hundred bytes) is rewritten at the same moments.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

# The controller-side callback base classes (Ray Train V2, which the pin guarantees).
from ray.train.v2.api.callback import UserCallback

from raylm import rundir, storage
from raylm.compat import ControllerCallback, FailureDecision, WorkerGroupCallback
from raylm.console import quiet_libraries
from raylm.contracts import (
    EARLIER_REPORTS,
    EVENT_SEGMENTS,
    EVENTS,
    RUN_INFO,
    SUMMARY,
    Event,
)
from raylm.contracts.events import (
    Benchmark,
    BenchmarkFailed,
    DeviceChosen,
    Ended,
    EventRecord,
    Failure,
    GroupStart,
    Interruption,
    NumericalFault,
    Placed,
    Placing,
    Progress,
    ResumedWithChanges,
    Started,
    TrackingLost,
    WaitedForBenchmarks,
    event_from_dict,
)
from raylm.contracts.report import Report
from raylm.contracts.summary import Summary
from raylm.faults import LeaseLost, Mistake, Preempted, Rewind, cause, check_lease
from raylm.live import LiveMetrics
from raylm.run import benchmarks as bench
from raylm.run.benchmarks import Benchmarks
from raylm.run.goodput import goodput
from raylm.run.objectives import OBJECTIVES, RunObjective
from raylm.run.tracking import Tracker

# ---- events.jsonl: writing and reading -----------------------------------------------------


class EventLog:
    """The event records of one invocation of a run, written as described in the module doc."""

    def __init__(self, run_dir: str, invocation: str) -> None:
        self.run_dir, self.invocation = run_dir, invocation
        self.remote = storage.is_uri(run_dir)
        self.pending: list[str] = []
        self.segments_written = 0

    def add(self, record: EventRecord) -> EventRecord:
        """``record`` added, stamped with this invocation and (unless it has one) now."""
        record = dataclasses.replace(record, invocation=self.invocation,
                                     time=time.time() if record.time is None else record.time)
        line = json.dumps(record.to_dict()) + "\n"
        if self.remote:
            self.pending.append(line)
        else:
            storage.append_text(storage.join(self.run_dir, EVENTS), line)
        return record

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"{self.invocation}-{self.segments_written:06d}.jsonl"
        storage.write_text(storage.join(self.run_dir, EVENT_SEGMENTS, name), "".join(self.pending))
        self.segments_written += 1
        self.pending = []


def read(run_dir: str, invocation: str | None = None) -> list[EventRecord]:
    """The event records of a run (of one invocation, if given), in order."""
    parts = []
    local = storage.join(run_dir, EVENTS)
    if storage.is_file(local):
        parts.append(storage.read_text(local))
    folder = storage.join(run_dir, EVENT_SEGMENTS)
    # Invocation ids are fixed-width times, so names sort in the order they were written.
    parts += [storage.read_text(storage.join(folder, n)) for n in storage.list_files(folder)]
    records = [event_from_dict(json.loads(line)) for part in parts
               for line in part.splitlines() if line.strip()]
    return [r for r in records if invocation is None or r.invocation == invocation]


# ---- Restarts and resizes, derived from the records ----------------------------------------


def interruptions(records: list[EventRecord]) -> list[Interruption]:
    """The restart and resize records of one invocation's events (see the module doc)."""
    out: list[Interruption] = []
    group: GroupStart | None = None  # the current group's start record
    last: Progress | None = None  # the last progress record of the current group
    step_time = 0.0
    failures: list[Failure] = []
    pending = None  # an interruption waiting for the new group's first report, and its since
    for r in records:
        if isinstance(r, Failure):
            failures.append(r)
        elif isinstance(r, GroupStart):
            if pending is not None:
                out.append(pending[0])
            pending = None
            if group is None and failures:
                # This invocation's earlier group failed before the controller heard of it.
                pending = Interruption(
                    event=Event.RESTART, from_workers=None, to_workers=r.workers, at_step=None,
                    resumed_from_step=r.from_step, steps_redone=None, time_lost_s=None,
                    failures=len(failures), cause=failures[-1].error), None, 0.0
            elif group is not None:
                at, since = ((last.step, last.time) if last is not None
                             else (group.from_step, group.time))
                pending = Interruption(
                    event=Event.RESTART if failures else Event.RESIZE,
                    from_workers=group.workers, to_workers=r.workers, at_step=at,
                    resumed_from_step=r.from_step, steps_redone=max(0, at - r.from_step),
                    time_lost_s=None, failures=len(failures),
                    cause=failures[-1].error if failures else "resize"), since, step_time
            group, last, failures = r, None, []
        elif isinstance(r, Progress):
            if pending is not None:
                e, since, before = pending
                if since is not None:
                    lost = r.time - since - max(0, r.step - e.at_step) * before
                    e.time_lost_s = round(max(0.0, lost), 2)
                out.append(e)
                pending = None
            last, step_time = r, r.step_time
    if pending is not None:
        out.append(pending[0])
    return out


def summarize(records: list[EventRecord]) -> Counted:
    """The restarts, resizes and failures of one invocation's records, and its interruptions."""
    inter = interruptions(records)
    return Counted(restarts=sum(e.event == Event.RESTART for e in inter),
                   resizes=sum(e.from_workers not in (None, e.to_workers) for e in inter),
                   failures=sum(isinstance(r, Failure) for r in records), interruptions=inter)


@dataclass(frozen=True)
class Counted:
    restarts: int
    resizes: int
    failures: int
    interruptions: list[Interruption]


def by_invocation(records: list[EventRecord]) -> list[list[EventRecord]]:
    """Records (in the order written) grouped by invocation, in the order they ran."""
    groups: dict[str, list[EventRecord]] = {}
    for r in records:
        groups.setdefault(r.invocation, []).append(r)
    return list(groups.values())


def counts(parts: list[Counted]) -> dict[str, int]:
    """Restarts, resizes and failures of every invocation's :func:`summarize`."""
    return {"restarts": sum(p.restarts for p in parts), "resizes": sum(p.resizes for p in parts),
            "failures": sum(p.failures for p in parts)}


# ---- The controller callback ---------------------------------------------------------------


@dataclass(frozen=True)
class FinalModel:
    """How the run's final model is logged to MLflow (a LoRA run's adapter, or the model)."""

    adapter: bool
    run_name: str
    register_as: str | None = None


@dataclass(frozen=True)
class Ending:
    """What the record needs from the driver to finish the run: the train split's row groups
    and the order's seed and window (the final checkpoint's sample accounting), and whether
    the driver logs a final model once the run has finished (None: tracking is off, or the run
    is a sweep's trial); the record then leaves the MLflow run open for it."""

    row_group_sizes: list[int]
    seed: int
    window: int
    final_model: FinalModel | None = None
    skip_positions: list[list[int]] = ()
    """train.skip_positions (the run's rewinds' ranges are read from its run directory)."""


class RunRecord(UserCallback):
    """On the Ray Train controller: the record of one invocation of a run (made on the
    driver, which passes it to Ray Train with the run's tracker)."""

    def __init__(self, run_dir: str, *, total_steps: int, tracker: Tracker,
                 verbose: bool = False, progress=None, ending: Ending | None = None,
                 lease: str | None = None, benchmarks: Benchmarks | None = None,
                 objective: RunObjective = OBJECTIVES["sft"]) -> None:
        self.run_dir = run_dir
        self.objective = objective  # what the progress lines say of its figures
        # The checkpoints' benchmark evaluations (raylm.run.benchmarks), when eval.tasks names
        # any; ``listeners`` hear each one's scores (a sweep trial's reporter to Tune).
        self.benchmarks = benchmarks
        self.live: LiveMetrics | None = None
        self.live_at = 0.0  # when the live metrics were last worked out (monotonic)
        self.listeners: list[Any] = []
        # The token of the run directory's lease its driver holds: once another holds it,
        # nothing more is written (raylm.run.lease).
        self.lease = lease
        self.lease_lost = False
        self.ending = ending
        self.started = time.time()
        # The driver's progress queue (raylm.run.progress) when it draws a bar; else lines.
        self.progress = progress
        self.verbose = verbose
        self.quieted = False  # the controller's libraries (see raylm.console)
        self.total_steps = total_steps
        self.tracker = tracker
        self.invocation = f"{time.time():.6f}"
        self.log = EventLog(run_dir, self.invocation)
        self.records: list[dict[str, Any]] = []  # this invocation's
        self.group: float | None = None  # the current worker group's start time
        self.group_reported = False  # has it reported a step yet?
        self.resumed_from_step: int | None = None  # where this invocation's first group began
        self.latest: Report | None = None
        self.val_loss: float | None = None
        self.val_figures: dict[str, float] = {}
        self.checkpoint_path: str | None = None
        self.tracking_lost: TrackingLost | None = None  # once MLflow failed
        self.announced = 0  # interruptions printed and logged so far
        self.counts_logged = False  # restarts/resizes/failures logged to MLflow yet?
        self.earlier: list[dict[str, Any]] | None = None  # earlier invocations' records
        self.furthest = -1  # the furthest step reported
        self.stuck_at = -1  # the furthest step when the failures counted below began
        self.failures_in_place = 0  # failures in a row without training past stuck_at
        # The goodput account counts this invocation's wall time from here (raylm.run.goodput).
        self._add(Started(time=self.started))

    # Ray Train's hooks. An exception in a controller callback ends the whole run; the record
    # is not worth that, so each hook reports its own errors and returns.

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        # The reports rank 0 held back while its last one waited for the controller's poll
        # (raylm.workers.checkpoint.Checkpointer) come first, in the order they were made.
        m = dict(metrics[0])
        for earlier in m.pop(EARLIER_REPORTS, ()):
            self._safely(self.report, earlier, None)
        self._safely(self.report, m, None if checkpoint is None else storage.name(checkpoint.path))

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        self._safely(self.failure, worker_exceptions)

    def _safely(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:
            print(f"warning: raylm run record: {type(e).__name__}: {e}", flush=True)

    # What the hooks do, callable on their own.

    def report(self, metrics: dict[str, Any], checkpoint_name: str | None) -> None:
        """One report (rank 0's metrics, :meth:`Report.to_metrics`), with the name of the
        checkpoint directory it saved."""
        if not self.quieted:
            quiet_libraries(self.verbose)
            self.quieted = True
        r = Report.from_metrics(metrics)
        step = r.step
        if r.group_started != self.group:
            if self.group is None:
                self.resumed_from_step = r.resumed_from_step
            self.group = r.group_started
            self._add(GroupStart.of(r))
            self.group_reported = False
        if r.announces:
            return
        step_time = r.elapsed_s / max(1, step - (r.resumed_from_step or 0))
        # Timed when rank 0 made it, which for a report held back is earlier than its arrival.
        self._add(Progress.of(r, step_time=step_time))
        first_of_group = not self.group_reported
        if first_of_group:  # an interruption is complete at its group's first step
            self.group_reported = True
            self._announce(step)
        for fault in r.numerical_faults or ():
            self._numerical_fault(fault)
        self.latest = r
        self.furthest = max(self.furthest, step)
        if r.evaluated:
            self.val_loss = r.val_loss
            # Preference tuning's evaluation figures besides the loss (val_accuracy ...),
            # reinforcement learning's instead of it (val_reward).
            self.val_figures = r.validation()
        path = None
        if checkpoint_name is not None:
            path = self.checkpoint_path = storage.join(self.run_dir, checkpoint_name)
        self.tracker.log_report(r, path)
        self._live(interrupted=first_of_group)
        self._note_tracking(step)
        self._progress(r, step_time=step_time, checkpoint=path)
        if self.benchmarks is not None:
            self._benchmark(step, path)
        if path is not None:
            self.flush()

    def _live(self, *, interrupted: bool) -> None:
        """The run's goodput and interruptions so far, as live metrics (:mod:`raylm.live`);
        the gauges are made here, on the controller (the record is pickled to it). Worked
        out at a group's first report and then at most every 10 s, Ray's export interval:
        the account reads every record (29 ms at 10,000 reports, measured here)."""
        now = time.monotonic()
        if self.live is None:
            self.live = LiveMetrics(storage.name(self.run_dir))
        elif not interrupted and now - self.live_at < 10:
            return
        self.live_at = now
        records = self._every_record()
        self.live.record({**counts([summarize(rs) for rs in by_invocation(records)]),
                          "goodput": goodput(records).goodput})

    def _benchmark(self, step: int, checkpoint: str | None) -> None:
        """Start the evaluation of a due checkpoint (at the invocation's first report, those
        of earlier invocations left unscored too) and record those that have ended; never
        waits (see :mod:`raylm.run.benchmarks`)."""
        b = self.benchmarks
        if not b.resumed:
            b.resume(self._every_record(),
                     bad=rundir.read_manifest(self.run_dir)["bad_checkpoints"])
        if checkpoint is not None:
            b.start(step, checkpoint)
        self._scored(b.collect())

    def _scored(self, outcomes: list[Benchmark | BenchmarkFailed]) -> None:
        for r in outcomes:
            self._add(r)
            print(bench.describe(r), flush=True)
            if isinstance(r, Benchmark):
                self.tracker.log_scores(r.scores, r.step)
                for listener in self.listeners:
                    listener.scored(r, val_loss=self.val_loss)
        if outcomes:
            self.flush()

    def _progress(self, r: Report, *, step_time: float, checkpoint: str | None) -> None:
        if self.progress is not None:
            try:
                self.progress.put_nowait(r)
                return
            except Exception as e:  # the driver is gone: lines from here on
                print(f"warning: raylm progress bar: {type(e).__name__}: {e}", flush=True)
                self.progress = None
        print(progress_line(r, total_steps=self.total_steps, step_time=step_time,
                            checkpoint=checkpoint, objective=self.objective), flush=True)

    def _numerical_fault(self, fault: dict[str, Any]) -> None:
        """A step the numerical check kept from the weights: in the events, said in a line,
        and logged to MLflow with the run's other events."""
        f = self._add(NumericalFault(**fault))
        ranges = ", ".join(f"{a}-{b - 1}" for a, b in f.positions)
        done = {"skip": "its update skipped", "rewind": "the run rewinds",
                "stop": "the run stops"}[f.action]
        loss, norm = (f"{float(v):.4g}" for v in (f.loss, f.grad_norm))
        print(f"raylm: numerical fault at step {f.step}: {f.cause} (loss {loss}, "
              f"grad norm {norm}), samples {ranges}: {done}", flush=True)
        if self.tracker:
            self._log_events(f.step)

    def note(self, record: EventRecord) -> None:
        """A record of something the driver saw before the run started (a moved schedule)."""
        self._add(record)

    def failure(self, worker_exceptions: dict[int, Exception]) -> None:

        error = next(iter(worker_exceptions.values()))
        if self.furthest > self.stuck_at:
            self.stuck_at, self.failures_in_place = self.furthest, 0
        # A preemption is the cloud's doing, wherever it falls; a rewind is the run's own,
        # limited by train.max_rewinds.
        if not any(cause(e, Preempted) or cause(e, Rewind) for e in worker_exceptions.values()):
            self.failures_in_place += 1
        text = str(error).strip().splitlines()
        self._add(Failure(ranks=sorted(worker_exceptions),
                          error=f"{type(error).__name__}: {text[0] if text else ''}"[:300]))
        self.flush()

    def _ours(self) -> bool:
        """Whether the run directory is still this run's to write (its lease is its driver's);
        said once when it is not."""
        if not self.lease_lost:
            try:
                check_lease(self.run_dir, self.lease)
            except LeaseLost as e:
                self.lease_lost = True
                print(f"raylm: error: {e}", flush=True)
        return not self.lease_lost

    def flush(self) -> None:
        """Write what is buffered, and the live summary."""
        if not self._ours():
            return
        self.log.flush()
        rundir.write_summary(self.run_dir, self.summary())

    def finish(self, failed: bool) -> None:
        """The run ended (``failed``: Ray Train gave up on it): the final summary.json, and
        the MLflow run's files and status (its final model: see :class:`Ending`)."""
        driver_ends = False
        try:
            if not self._ours():
                return
            if self.benchmarks is not None:
                began = time.time()
                if self.benchmarks.pending:
                    self._scored(self.benchmarks.wait())
                    self._add(WaitedForBenchmarks(seconds=round(time.time() - began, 2)))
                self.benchmarks.release()
            self._add(Ended(status="failed" if failed else "finished"))
            self.log.flush()
            summary = dataclasses.replace(
                self.summary(), status="failed" if failed else "finished",
                wall_s=round(time.time() - self.started, 2),
                goodput=self.goodput(every_invocation=True))
            self.tracker.log_goodput(summary.goodput, self.furthest)
            e = self.ending
            if e is not None and self.checkpoint_path is not None:
                summary.samples = sample_accounting(self.checkpoint_path, e,
                                                    run_dir=self.run_dir)
            rundir.write_summary(self.run_dir, summary)
            self.tracker.log_run_files(self.run_dir, (SUMMARY, RUN_INFO))
            # The driver logs the final model (torch and transformers are loaded there, not
            # here) and then ends the MLflow run (raylm.run.launch.end_tracked_run).
            driver_ends = (not failed and e is not None and e.final_model is not None
                           and bool(self.tracker))
        finally:
            if not driver_ends:
                self.tracker.finish(failed=failed)

    def final_summary(self) -> Summary | None:
        """summary.json as this invocation's record finished it (read on the driver once the
        run has ended); None when it did not (the controller was lost)."""
        written = rundir.read_summary(self.run_dir)
        if written is None or written.invocation != self.invocation or not written.ended:
            return None
        return written

    def goodput(self, *, every_invocation: bool = False) -> dict[str, Any]:
        """The goodput account (:mod:`raylm.run.goodput`) of this invocation, or of the whole
        run (the earlier invocations' records are read once)."""
        return goodput(self._every_record() if every_invocation else self.records)

    def _every_record(self) -> list[EventRecord]:
        """Every invocation's records: the earlier ones' read once, when first needed."""
        if self.earlier is None:
            self.earlier = [r for r in read(self.run_dir) if r.invocation != self.invocation]
        return self.earlier + self.records

    def placing(self, workers: int) -> None:
        """Ray Train starts placing a worker group of ``workers``."""
        self._add(Placing(workers=workers))

    def placed(self, resources_s: float | None) -> None:
        """The group is placed; its placement group waited ``resources_s`` for resources."""
        self._add(Placed(resources_s=resources_s))

    def summary(self) -> Summary:
        """summary.json as the record knows it: where the run is now."""
        m = self.latest or Report(step=None, group_started=None, workers=None)
        tracker = self.tracker
        counted = summarize(self.records)
        return Summary(
            status="running", invocation=self.invocation, final_step=m.step,
            train_loss=m.loss, val_loss=self.val_loss,
            # Reinforcement learning's figures of the latest step (rl_reward ...).
            figures={**self.val_figures, **m.objective_figures("rl_")},
            tokens_per_s=m.tokens_per_s, mfu=m.mfu, data_wait_fraction=m.data_wait_fraction_run,
            checkpoint_path=(storage.redact(self.checkpoint_path) if self.checkpoint_path
                             else None),
            mlflow_run_id=tracker.run_id,
            mlflow_tracking_uri=storage.redact(tracker.uri) if tracker.uri else tracker.uri,
            tracking_lost=self.tracking_lost, resumed_from_step=self.resumed_from_step,
            workers=m.workers, trainable_params=m.trainable_params,
            peak_memory_gb=m.peak_memory_gb, param_memory_gb=m.param_memory_gb,
            optimizer_memory_gb=m.optimizer_memory_gb, data_parallel=m.data_parallel,
            tensor_parallel=m.tensor_parallel, pipeline_parallel=m.pipeline_parallel,
            # GPU energy and time (None on CPUs): see raylm.workers.energy.
            joules_per_token=m.joules_per_token, watts_per_gpu=m.watts_per_gpu,
            energy_kwh=m.energy_kwh, gpu_hours=m.gpu_hours, cost=m.cost,
            restarts=counted.restarts, resizes=counted.resizes, failures=counted.failures,
            interruptions=counted.interruptions,
            numerical_faults=[r.listed() for r in self.records if isinstance(r, NumericalFault)],
            device=next((r.reason for r in reversed(self.records)
                         if isinstance(r, DeviceChosen)), None),
            attention_backend=m.attention_backend, precision=m.precision,
            changed_on_resume=sorted({c for r in self.records
                                      if isinstance(r, ResumedWithChanges) for c in r.changed}),
            goodput=self.goodput(),
            benchmarks=(bench.summarize(self._every_record())
                        if self.benchmarks is not None else None))

    def _add(self, record: EventRecord) -> EventRecord:
        record = self.log.add(record)
        self.records.append(record)
        return record

    def _announce(self, step: int) -> None:
        found = interruptions(self.records)
        for e in found[self.announced:]:
            lost = "unknown" if e.time_lost_s is None else f"{e.time_lost_s:.1f}s"
            print(f"raylm: {e.event} {e.from_workers} -> {e.to_workers} workers, resumed from "
                  f"step {e.resumed_from_step} (last report at step {e.at_step}), time lost "
                  f"{lost}", flush=True)
        # The counts are logged at this invocation's first step even when they are zero, so
        # that runs without faults can be compared with those that had some.
        if (len(found) > self.announced or not self.counts_logged) and self.tracker:
            self._log_events(step)
            self.counts_logged = True
        self.announced = len(found)

    def _note_tracking(self, step: int) -> None:
        """Once the tracker has failed (it said so, once): the step and the cause, in the
        record and the summary, so the run's record shows where MLflow's ends."""
        if self.tracker.lost and self.tracking_lost is None:
            self.tracking_lost = self._add(TrackingLost(step=step, error=self.tracker.lost))
            self.flush()

    def _log_events(self, step: int) -> None:
        # MLflow's run spans every invocation of the raylm run.
        records = self._every_record()
        parts = [summarize(rs) for rs in by_invocation(records)]
        faults = [r.to_dict() for r in records if isinstance(r, NumericalFault)]
        self.tracker.log_events(
            {"interruptions": [asdict(e) for p in parts for e in p.interruptions],
             "failures": [r.to_dict() for r in records if isinstance(r, Failure)],
             "numerical_faults": faults},
            {**counts(parts), "numerical_faults": len(faults)}, step)


class RepeatedFailure(RuntimeError):
    """Worker groups kept failing without training past one step: not a machine lost at
    random, so restarting again would only repeat it."""


class EndOfRun(ControllerCallback, WorkerGroupCallback):
    """The controller's calls the record needs beyond reports and worker errors (which Ray
    Train alone gives user callbacks): the run's end; each decision to restart, which it
    refuses once ``max_failures_at_one_step`` failures came in a row without progress; and
    each worker group's placement, for the goodput account. Made with the record and pickled
    with it in one list of callbacks, so both are one object on the controller."""

    def __init__(self, record: RunRecord, *, max_failures_at_one_step: int = 0) -> None:
        self.record = record
        self.limit = max_failures_at_one_step

    def before_controller_execute_failure_decision(self, failure_decision) -> None:
        r = self.record
        if (self.limit and failure_decision == FailureDecision.RETRY
                and r.failures_in_place >= self.limit):
            raise RepeatedFailure(
                f"{r.failures_in_place} failures in a row without training past step "
                f"{max(r.stuck_at, 0)}: a fault that recurs at one place, not restarted again "
                f"(train.max_failures_at_one_step={self.limit}); the failures are in "
                f"{r.run_dir}'s events")

    def after_controller_finish(self, result) -> None:
        self.record._safely(self.record.finish, result.error is not None)

    def before_worker_group_start(self, worker_group_context) -> None:
        self.record._safely(lambda: self.record.placing(worker_group_context.num_workers))

    def after_worker_group_start(self, worker_group) -> None:
        self.record._safely(lambda: self.record.placed(resource_wait(worker_group)))


def resource_wait(worker_group) -> float | None:
    """Seconds the worker group's placement group waited before it was created (Ray's own
    measure, from the GCS); None when Ray does not say."""
    import ray.util

    try:
        pg = worker_group.get_worker_group_state().placement_group_handle.placement_group
        stats = ray.util.placement_group_table(pg)["stats"]
        return stats["end_to_end_creation_latency_ms"] / 1000
    except Exception:  # noqa: BLE001 - a figure of the goodput account, not worth failing a start for
        return None


def progress_line(r: Report, *, total_steps: int, step_time: float, checkpoint: str | None,
                  objective: RunObjective = OBJECTIVES["sft"]) -> str:
    """The console's line for a step's report: the common figures, then the objective's own
    (:meth:`raylm.run.objectives.RunObjective.progress`)."""
    step = r.step
    line = (f"step {step}/{total_steps}  loss {r.loss:.4f}  lr {r.lr:.2e}  "
            f"{r.tokens_per_s:,.0f} tok/s  data wait {100 * r.data_wait_fraction:.1f}%  "
            f"ETA {step_time * (total_steps - step):.0f}s")
    line += objective.progress(r)
    if checkpoint is not None:
        line += f"  checkpoint {checkpoint}"
    return line


def sample_accounting(checkpoint_path: str, ending: Ending, *, run_dir: str
                      ) -> dict[str, Any] | None:
    """What the final checkpoint's sample ledger says was trained (see raylm.workers.ledger),
    against the order less the positions the run left out; None when it keeps no ledger."""
    rows = rundir.load_samples(checkpoint_path)
    if rows is None:
        return None
    skips = rundir.read_manifest(run_dir)["ranges"] + list(ending.skip_positions)
    return rundir.account_samples(rows, group_sizes=ending.row_group_sizes, seed=ending.seed,
                                  window=ending.window, skips=skips)


class FreshClusterView(ControllerCallback):
    """On an elastic run's controller: Ray Train's elastic policy sizes a group by what Ray
    Data's autoscaling coordinator reserved for it, which reads the cluster's nodes every 20 s;
    after a node loss the policy asked again for the old size and waited
    ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` (60 s by default) for it. At each decision to
    restart, the coordinator is asked to read them again (its ``recompute``, as Ray Train asks
    before pinning nodes); unawaited, as it takes one caller's calls in order. Only then: read
    while a group runs, a lost node turned the restart into a healthy-looking resize before
    the lost worker's failure was seen. Without the coordinator, Ray's own refresh applies."""

    coordinator = None

    def before_controller_execute_failure_decision(self, failure_decision) -> None:
        if failure_decision != FailureDecision.RETRY:
            return
        import ray

        try:
            self.coordinator = self.coordinator or ray.get_actor(
                "AutoscalingCoordinator", namespace="AutoscalingCoordinator")
            self.coordinator.get_reserved_resources.remote("raylm", recompute=True)
        except Exception:  # noqa: BLE001 - a faster view, never a reason to fail the run
            self.coordinator = None


def controller_callbacks(record: RunRecord, cfg) -> list:
    """The record and the controller callbacks that go with it, for ``cfg``'s run."""
    elastic = [FreshClusterView()] if isinstance(cfg.scaling.num_workers, list) else []
    return [record, EndOfRun(record, max_failures_at_one_step=(
        cfg.train.max_failures_at_one_step)), EndOnMistake(), *elastic]


class EndOnMistake(ControllerCallback, WorkerGroupCallback):
    """On the controller: a worker's :class:`Mistake` ends the run instead of a restart."""

    def __init__(self) -> None:
        self.mistake: str | None = None

    def after_worker_group_poll_status(self, worker_group_status) -> None:
        for rank, error in sorted(worker_group_status.errors.items()):
            found = cause(error)
            if found is not None:
                self.mistake = f"rank {rank}: {found}"
                return

    def before_controller_execute_failure_decision(self, failure_decision) -> None:
        if self.mistake is not None and failure_decision == FailureDecision.RETRY:
            raise Mistake(self.mistake)
