"""The goodput account: every second of a run's wall time, by what it was spent on.

A pure function of the run's event records (:mod:`raylm.run.record`), over every invocation, so
it survives restarts, resizes and new invocations without state of its own. What feeds it:

- each worker group's first report (``group_start``: when the group began on the workers, and
  ``setup_s``: building, restoring and waiting for the first batch);
- each progress report's ``clock``: rank 0's wall time at the report and its counters since the
  group was set up (seconds computing steps, waiting for data, evaluating, blocked on
  checkpoints; in reinforcement learning waiting for completions and handing weights to the
  generators), and the energy the window drew where NVML reads it;
- the controller's own records: each attempt to place a worker group (``placing``/``placed``,
  with the seconds its placement group waited for resources), each failure, the invocation's
  start and end, and the wait for benchmark evaluations at its end. The evaluations
  themselves run on resources of their own (:mod:`raylm.run.benchmarks`), beside the run's
  wall time, not in it: ``raylm eval``'s records, written after the fact, are not counted.

The wall time of each invocation (from the driver building the run to its end) is split into
causes (``productive``, ``recomputed``, ``data_wait``, ...), and starts and restarts into their
phases (``startup_phases``), as docs/fault-tolerance.md ("Where the time went") describes each.

``goodput`` is ``productive / total``. Steps trained again are not found by arithmetic on step
numbers alone: a window of reported steps is "recomputed" in the share that a later group's
``from_step`` cut off (the steps it trains again), so a rewind that goes back several groups
counts each lost step once. Clocks: the workers' figures are rank 0's clock, the gaps between
groups the controller's; on one node they are the same clock, across nodes NTP keeps them within
milliseconds of each other, which is below the resolution this account is read at.

Written by hand: neither Ray Train nor MLflow keeps such an account (MaxText's goodput package
reads Google Cloud Logging, which a Ray cluster does not have).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raylm.contracts.events import (
    Benchmark,
    BenchmarkFailed,
    Ended,
    EventRecord,
    Failure,
    GroupStart,
    Placed,
    Placing,
    Progress,
    WaitedForBenchmarks,
)
from raylm.contracts.summary import Goodput

CAUSES = ("productive", "recomputed", "data_wait", "generation", "weight_transfer", "checkpoint",
          "evaluation", "preemption", "benchmarks", "resources", "startup", "restart",
          "reporting", "finish", "other")
# A report clock's counters (raylm.workers.loop.StepMeter.clock); reinforcement learning's two
# (waiting for completions, handing weights to the generators) are absent from other runs'.
_COUNTERS = ("compute_s", "data_wait_s", "generate_s", "transfer_s", "eval_s", "checkpoint_s")
PHASES = ("controller", "resources", "workers", "imports", "ray_train", "stream", "build",
          "restore", "validation", "first_batch", "setup_other")
# The worker's set-up phases as its group's first report names them (raylm.workers.loop).
_WORKER_PHASES = ("stream", "build", "restore", "validation", "first_batch")


@dataclass
class _Window:
    """The steps ``(first, last]`` one progress report covers, and what they cost."""

    first: int
    last: int
    compute_s: float
    wait_s: float
    energy_j: float | None
    generate_s: float = 0.0
    transfer_s: float = 0.0
    alive_to: int = field(init=False)
    """Steps up to here still count; beyond it a later group trained them again."""

    def __post_init__(self) -> None:
        self.alive_to = self.last

    def cut(self, from_step: int) -> None:
        self.alive_to = max(self.first, min(self.alive_to, from_step))

    @property
    def lost_share(self) -> float:
        return (self.last - self.alive_to) / max(1, self.last - self.first)


class _Account:
    """Walks the records once, in order (see :func:`goodput`)."""

    def __init__(self) -> None:
        self.s = dict.fromkeys(CAUSES, 0.0)
        self.total = 0.0
        self.windows: list[_Window] = []
        self.invocation: str | None = None
        self.start = self.end = None  # the current invocation's span
        self.group_seen = False  # in this invocation
        self.gap_from: float | None = None  # when the time without a training group began
        self.gap_resources = 0.0  # resource waits inside that gap
        self.placing: float | None = None  # an attempt to place a group, not yet placed
        self.clock: dict[str, float] | None = None  # the current group's last clock
        self.step = 0  # the current group's last reported step
        self.group: float | None = None  # the current group's start time
        self.lost: Failure | None = None  # the failure that ended the current group
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.launch_from: float | None = None  # when the wait for the next placing began
        self.placed_from: float | None = None  # the last placing of the group to come
        self.tail_benchmarks = 0.0  # benchmark waits since the last report

    def close_invocation(self) -> None:
        if self.start is not None and self.end is not None:
            self.total += max(0.0, self.end - self.start)
        self.start = self.end = None

    def record(self, r: EventRecord) -> None:
        if isinstance(r, (Benchmark, BenchmarkFailed)):
            return  # beside the wall time (see the module doc)
        if r.invocation != self.invocation:
            self.end_of_lost_group()
            self.close_invocation()
            self.invocation, self.group_seen = r.invocation, False
            self.start, self.gap_from, self.gap_resources = r.time, r.time, 0.0
            self.clock, self.placing, self.lost = None, None, None
            self.launch_from = r.time
        self.end = max(self.end or r.time, r.time)
        getattr(self, "on_" + r.KIND, lambda r: None)(r)

    def on_placing(self, r: Placing) -> None:
        if self.placing is not None:  # the attempt before timed out waiting for resources
            self.gap_resources += r.time - self.placing
        self.placing = self.placed_from = r.time
        if self.launch_from is not None:
            self.phases["controller"] += max(0.0, r.time - self.launch_from)
            self.launch_from = None

    def on_placed(self, r: Placed) -> None:
        self.placing = None
        self.gap_resources += r.resources_s or 0.0

    def on_group_start(self, r: GroupStart) -> None:
        ready = r.time + (r.setup_s or 0.0)
        saved = r.resumed_clock
        if (saved and self.clock is not None and saved.get("group") == self.group
                and saved["t"] > self.clock["t"] and r.from_step > self.step):
            # The checkpoint this group resumed from was saved by the group before after its
            # last report the controller took: the steps up to it count.
            self.on_progress(Progress(step=r.from_step, step_time=0.0, clock=saved))
        self.end_of_lost_group()
        for w in self.windows:
            w.cut(r.from_step)
        if self.gap_from is None:  # a resize: the old group ended with its last report
            self.gap_from = self.clock["t"] if self.clock else r.time
        gap = max(0.0, ready - self.gap_from)
        resources = min(self.gap_resources, gap)
        self.s["resources"] += resources
        self.s["restart" if self.group_seen else "startup"] += gap - resources
        self.split_phases(r, resources)
        self.group_seen = True
        self.gap_from, self.gap_resources = None, 0.0
        self.clock = {"t": ready, **dict.fromkeys(_COUNTERS, 0.0)}
        self.step, self.group = r.from_step, r.time

    def split_phases(self, r: GroupStart, resources: float) -> None:
        """A group's start in its parts (see the module doc); what a record lacks (older runs,
        a group placed before its invocation's records began) stays in ``setup_other``."""
        p = self.phases
        p["resources"] += resources
        worker = r.phases or {}
        before = (worker.get("process_s") or 0.0) + (worker.get("ray_train_s") or 0.0)
        if self.placed_from is not None:
            p["workers"] += max(0.0, r.time - self.placed_from - resources - before)
        p["imports"] += worker.get("process_s") or 0.0
        p["ray_train"] += worker.get("ray_train_s") or 0.0
        setup = r.setup_s or 0.0
        parts = {k: worker.get(f"{k}_s") or 0.0 for k in _WORKER_PHASES}
        for k, v in parts.items():
            p[k] += v
        p["setup_other"] += max(0.0, setup - sum(parts.values()))
        self.placed_from = None

    def on_progress(self, r: Progress) -> None:
        c = r.clock
        if c is None or self.clock is None:
            return
        now = {k: c.get(k, 0.0) for k in _COUNTERS}
        d = {k: now[k] - self.clock[k] for k in _COUNTERS}
        self.s["reporting"] += max(0.0, c["t"] - self.clock["t"] - sum(d.values()))
        self.tail_benchmarks = 0.0
        self.windows.append(_Window(self.step, r.step, d["compute_s"], d["data_wait_s"],
                                    c.get("energy_j"), d["generate_s"], d["transfer_s"]))
        self.s["evaluation"] += d["eval_s"]
        self.s["checkpoint"] += d["checkpoint_s"]
        self.clock, self.step = {"t": c["t"], **now}, r.step

    def on_waited_for_benchmarks(self, r: WaitedForBenchmarks) -> None:
        self.s["benchmarks"] += r.seconds
        self.tail_benchmarks += r.seconds

    def on_end(self, r: Ended) -> None:
        if r.status == "finished" and self.clock is not None and self.lost is None:
            self.s["finish"] += max(0.0, r.time - self.clock["t"] - self.tail_benchmarks)

    def on_failure(self, r: Failure) -> None:
        if self.gap_from is None:
            self.gap_from = r.time
            if self.clock is not None:
                self.lost = r
        if self.launch_from is None:
            self.launch_from = r.time

    def end_of_lost_group(self) -> None:
        """A preempted group stops right after its checkpoint: the drain. Any other loss
        takes with it what was trained since its last report (or the checkpoint the next
        group resumed from, when it was saved after that report)."""
        if self.lost is not None:
            tail = max(0.0, self.lost.time - self.clock["t"])
            preempted = "Preempted" in self.lost.error
            self.s["preemption" if preempted else "recomputed"] += tail
        self.lost = None

    def finish(self) -> dict[str, Any]:
        self.end_of_lost_group()
        self.close_invocation()
        steps_lost = 0.0
        # Zero where every report window was measured, None where none was (CPUs).
        wasted_j = 0.0 if any(w.energy_j is not None for w in self.windows) else None
        for w in self.windows:
            lost = w.lost_share
            self.s["productive"] += (1 - lost) * w.compute_s
            self.s["data_wait"] += (1 - lost) * w.wait_s
            self.s["generation"] += (1 - lost) * w.generate_s
            self.s["weight_transfer"] += (1 - lost) * w.transfer_s
            self.s["recomputed"] += lost * (w.compute_s + w.wait_s + w.generate_s + w.transfer_s)
            steps_lost += w.last - w.alive_to
            if w.energy_j is not None:
                wasted_j += lost * w.energy_j
        known = sum(v for k, v in self.s.items() if k != "other")
        self.s["other"] = max(0.0, self.total - known)
        return Goodput(
            total_s=round(self.total, 2),
            goodput=round(self.s["productive"] / self.total, 4) if self.total else None,
            seconds={k: round(v, 2) for k, v in self.s.items()},
            startup_phases={k: round(v, 2) for k, v in self.phases.items()},
            recomputed_steps=int(steps_lost), energy_wasted_j=wasted_j)


def goodput(records: list[EventRecord]) -> Goodput:
    """The goodput account of a run's records (every invocation's, in the order they were written):
    ``total_s``, ``goodput``, ``seconds`` by cause (:data:`CAUSES`), ``recomputed_steps``
    (reported steps trained again) and ``energy_wasted_j`` (the energy of those steps' report
    windows; None without an energy counter)."""
    account = _Account()
    for r in records:
        account.record(r)
    return account.finish()


def describe(g: Goodput) -> str:
    """The account in one line, largest causes first."""
    if not g.total_s:
        return "goodput: nothing measured"
    parts = sorted(((v, k) for k, v in g.seconds.items() if k != "productive" and v >= 0.05),
                   reverse=True)
    rest = ", ".join(f"{k.replace('_', ' ')} {v:.1f}s" for v, k in parts)
    line = (f"goodput {100 * g.goodput:.1f}% of {g.total_s:.1f}s "
            f"(productive {g.seconds['productive']:.1f}s" + (f"; {rest}" if rest else "") + ")")
    if g.recomputed_steps:
        line += f"; {g.recomputed_steps} steps trained twice"
    return line


def table(g: Goodput) -> dict[str, list]:
    """The account as columns (cause, seconds, share of the total), for a table artifact."""
    total = g.total_s or 1.0
    return {"cause": list(CAUSES), "seconds": [g.seconds.get(k, 0.0) for k in CAUSES],
            "share": [round(g.seconds.get(k, 0.0) / total, 4) for k in CAUSES]}
