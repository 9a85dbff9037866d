"""A run's ``events.jsonl``, one record per line: what the run's record on the controller
(:mod:`raylm.run.record`), its driver and ``raylm eval`` saw, each kind of :data:`Event` a
dataclass of its own here, read back by the goodput account, the summary's interruptions and
benchmarks, and :class:`raylm.api.Run` as those records, never by name.

A line is ``{"invocation", "event", "time", ...its fields}``, as raylm has always written it;
:func:`event_from_dict` reads every version (a field an older release did not write has its
default) and refuses a kind or a field it does not know, or a value not of its field's type.
Derived from them, not written there: the :class:`Interruption` records summary.json lists.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from raylm.contracts import EVENTS, Event, Malformed, fits, hints, typed
from raylm.contracts.report import FIGURE_PREFIXES, Report


@dataclass(kw_only=True)
class EventRecord:
    """One line of events.jsonl. ``invocation`` and ``time`` are stamped by the log that adds
    the record when it is made without them."""

    KIND: ClassVar[Event]
    invocation: str = ""
    time: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"invocation": self.invocation, "event": self.KIND, "time": self.time}
        out.update((f.name, getattr(self, f.name)) for f in fields(self)[2:])
        return out


@dataclass(kw_only=True)
class Started(EventRecord):
    """The invocation began: the goodput account counts its wall time from here."""

    KIND = Event.INVOCATION


@dataclass(kw_only=True)
class DeviceChosen(EventRecord):
    KIND = Event.DEVICE
    gpu: bool | str
    """scaling.use_gpu as set"""
    reason: str
    """Where the workers run, and why."""


@dataclass(kw_only=True)
class ScheduleMoved(EventRecord):
    """A resume whose learning-rate schedule differs at its step (:mod:`raylm.schedule`)."""

    KIND = Event.SCHEDULE_MOVED
    step: int
    lr_trained: float
    lr_now: float
    lr_next: float | None = None


@dataclass(kw_only=True)
class ResumedWithChanges(EventRecord):
    KIND = Event.RESUMED_WITH_CHANGES
    changed: list[str]
    """What the run resumed with although it changed (checkpoint.accept_changes)."""


@dataclass(kw_only=True)
class Placing(EventRecord):
    KIND = Event.PLACING
    workers: int | None = None  # None: before 0.3


@dataclass(kw_only=True)
class Placed(EventRecord):
    KIND = Event.PLACED
    resources_s: float | None = None
    """How long the group's placement group waited for resources."""


@dataclass(kw_only=True)
class GroupStart(EventRecord):
    """A worker group's first report: when it began on the workers (``time``), its set-up's
    seconds and phases, the step and clock it resumed from."""

    KIND = Event.GROUP_START
    workers: int
    from_step: int
    setup_s: float | None = None
    phases: dict[str, float | None] | None = None
    resumed_clock: dict[str, float] | None = None

    @classmethod
    def of(cls, r: Report) -> GroupStart:
        return cls(time=r.group_started, workers=r.workers, from_step=r.resumed_from_step or 0,
                   setup_s=r.setup_s, phases=r.phases, resumed_clock=r.resumed_clock)


@dataclass(kw_only=True)
class Progress(EventRecord):
    """A step's report as the run's history keeps it (:meth:`Report.history`): its set
    figures of :attr:`Report.HISTORY` and every one of its ``figures``."""

    KIND = Event.PROGRESS
    LATE: ClassVar[tuple[str, ...]] = ("energy_kwh", "workers")  # after the objective's
    step: int
    step_time: float
    clock: dict[str, float] | None = None
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    data_wait_fraction: float | None = None
    mfu: float | None = None
    peak_memory_gb: float | None = None
    watts_per_gpu: float | None = None
    joules_per_token: float | None = None
    energy_kwh: float | None = None
    workers: int | None = None
    figures: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, r: Report, *, step_time: float) -> Progress:
        history = r.history()
        named = {f.name for f in fields(cls)} & set(history)
        return cls(time=r.clock["t"] if r.clock else None, step=r.step, step_time=step_time,
                   clock=r.clock, figures={k: v for k, v in history.items() if k not in named},
                   **{k: history[k] for k in named})

    def to_dict(self) -> dict[str, Any]:
        # In the order a report's history has always had (Report.to_metrics): the window's
        # figures, the objective's, the run's totals and the group's, the validation's.
        head = dict(list(super().to_dict().items())[:6])  # invocation ... clock
        window = [f.name for f in fields(self)[5:] if f.name not in ("figures", *self.LATE)]
        val = {k: v for k, v in self.figures.items() if k.startswith("val_")}
        figures = {**{k: getattr(self, k) for k in window},
                   **{k: v for k, v in self.figures.items() if k not in val},
                   **{k: getattr(self, k) for k in self.LATE}, **val}
        return {**head, **{k: v for k, v in figures.items() if v is not None}}

    def history(self) -> dict[str, Any]:
        """The step's figures (the run's metric history: :attr:`raylm.api.Run.history`)."""
        return {k: v for k, v in self.to_dict().items()
                if k not in ("invocation", "event", "clock")}


@dataclass(kw_only=True)
class NumericalFault(EventRecord):
    """A step the numerical check kept from the weights (:mod:`raylm.workers.health`):
    its cause, what was done (``skip``, ``rewind``, ``stop``) and the samples it trained."""

    KIND = Event.NUMERICAL_FAULT
    step: int
    cause: str
    loss: float | str
    """The loss; "nan" or "inf" where it was not finite (JSON has neither)."""
    grad_norm: float | str
    action: str
    positions: list[list[int]]
    """The step's sample positions, as ranges [start, end)."""
    rows: list
    culprits: list[list[int]] | None = None
    """Of a rewound non-finite step: the positions not finite on their own, where found."""
    documents: list[dict[str, Any]] | None = None
    """The corpus documents its samples (or culprits) came from, the first 32."""
    documents_total: int | None = None

    def listed(self) -> dict[str, Any]:
        """As summary.json lists it: its time and fields."""
        return {k: v for k, v in self.to_dict().items() if k not in ("invocation", "event")}


@dataclass(kw_only=True)
class Failure(EventRecord):
    KIND = Event.FAILURE
    ranks: list[int] = field(default_factory=list)
    error: str = ""
    """The first failed rank's error, its first line (at most 300 characters)."""


@dataclass(kw_only=True)
class Benchmark(EventRecord):
    """A checkpoint's benchmark scores (:mod:`raylm.run.benchmarks`)."""

    KIND = Event.BENCHMARK
    step: int | None
    """None: an exported model's scores (``raylm eval`` of a model directory), not recorded"""
    checkpoint: str
    scores: dict[str, float]
    higher: dict[str, bool] = field(default_factory=dict)
    """Per score, whether higher is better (lm-eval's direction)."""
    seconds: float = 0.0


@dataclass(kw_only=True)
class BenchmarkFailed(EventRecord):
    KIND = Event.BENCHMARK_FAILED
    step: int
    checkpoint: str
    error: str


@dataclass(kw_only=True)
class WaitedForBenchmarks(EventRecord):
    """The run's end waited ``seconds`` for its pending benchmark evaluations."""

    KIND = Event.WAITED_FOR_BENCHMARKS
    seconds: float


@dataclass(kw_only=True)
class TrackingLost(EventRecord):
    KIND = Event.TRACKING_LOST
    step: int
    error: str


@dataclass(kw_only=True)
class Ended(EventRecord):
    KIND = Event.END
    status: str
    """finished or failed"""


KINDS: dict[str, type[EventRecord]] = {c.KIND: c for c in (
    Started, DeviceChosen, ScheduleMoved, ResumedWithChanges, Placing, Placed, GroupStart,
    Progress, NumericalFault, Failure, Benchmark, BenchmarkFailed, WaitedForBenchmarks,
    TrackingLost, Ended)}


def event_from_dict(data: Any) -> EventRecord:
    """The record one line of events.jsonl holds (see the module doc)."""
    if not isinstance(data, dict) or data.get("event") not in KINDS:
        kind = data.get("event") if isinstance(data, dict) else data
        raise Malformed(f"{EVENTS} holds a record of kind {kind!r}, which this raylm does not "
                        f"know")
    cls = KINDS[data["event"]]
    types = hints(cls)
    known = {f.name for f in fields(cls)} - {"figures"}
    found: dict[str, Any] = {}
    figures = {}
    for key, value in data.items():
        if key == "event":
            continue
        if key in known:
            if not fits(value, types[key]):
                raise Malformed(f"{EVENTS}: a record of kind {cls.KIND}: its {key} is "
                                f"{value!r:.100}")
            found[key] = value
        elif cls is Progress and key.startswith(FIGURE_PREFIXES):
            figures[key] = value
        else:
            raise Malformed(f"{EVENTS}: a record of kind {cls.KIND} holds {key!r}, which "
                            f"raylm's {cls.__name__} does not name")
    missing = [f.name for f in fields(cls) if f.name not in found and (
        f.name in ("invocation", "time") or f.default is f.default_factory is MISSING)]
    if missing:
        raise Malformed(f"{EVENTS}: a record of kind {cls.KIND} lacks {', '.join(missing)}")
    return cls(**found, **({"figures": figures} if cls is Progress else {}))


@dataclass(kw_only=True)
class Interruption:
    """A restart (a failure, then a new group) or a resize (a new group of another size) of
    one invocation, derived from its records (:func:`raylm.run.record.interruptions`)."""

    event: str
    """restart or resize"""
    from_workers: int | None
    """None: the group before failed before the controller heard of it."""
    to_workers: int
    at_step: int | None
    """The last step reported before it."""
    resumed_from_step: int
    steps_redone: int | None
    time_lost_s: float | None
    """From the last report to the new group's first step, less that step's own time."""
    failures: int
    cause: str
    """The last failure's error, or ``resize``."""

    @classmethod
    def from_dict(cls, data: Any) -> Interruption:
        return typed(cls, data, "an interruption")
