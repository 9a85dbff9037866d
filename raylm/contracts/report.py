"""A worker group's report to the run's record: :class:`Report`, made once on the workers and
read once on the Ray Train controller (:meth:`Report.from_metrics`, where the record receives
it). Between them travels :meth:`Report.to_metrics`, the flat mapping Ray Train carries and
MLflow logs under its names: those names are the record's fields, so renaming a figure is a
change here that every reader sees, not a key some reader misses.

An objective's own figures (DPO's ``dpo_*``, GRPO's ``rl_*``) and the validation figures
(``val_*``) ride in one field, :attr:`Report.figures`, rather than as fields each: they differ
by objective and come and go with evaluations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from raylm.contracts import EARLIER_REPORTS, Event, Malformed

FIGURE_PREFIXES = ("dpo_", "rl_", "val_")


@dataclass(kw_only=True)
class Report:
    """rank 0's report (every rank reports the same figures). A group's first is its
    announcement (``event`` = :attr:`Event.GROUP_START`: the layout, ``setup_s``, ``phases``
    and the clock it resumed from); the others are a step's."""

    # The group: the same in every report of a worker group.
    step: int
    group_started: float
    """When the worker group began (seconds since the epoch): a new value is a new group."""
    workers: int
    resumed_from_step: int | None = None
    accumulation: int | None = None
    micro_batch: int | None = None
    data_parallel: int | None = None
    tensor_parallel: int | None = None
    pipeline_parallel: int | None = None
    trainable_params: int | None = None
    attention_backend: str | None = None
    precision: str | None = None
    data_startup_s: float | None = None
    # The group's announcement only.
    event: str | None = None
    setup_s: float | None = None
    phases: dict[str, float | None] | None = None
    resumed_clock: dict[str, float] | None = None
    # A step's.
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    tokens_seen: int | None = None
    preempted: bool | None = None
    tokens_per_s: float | None = None
    data_wait_fraction: float | None = None
    data_wait_fraction_run: float | None = None
    mfu: float | None = None
    elapsed_s: float | None = None
    """Seconds since the group began training (its step time's numerator)."""
    peak_memory_gb: float | None = None
    param_memory_gb: float | None = None
    optimizer_memory_gb: float | None = None
    joules_per_step: float | None = None
    watts_per_gpu: float | None = None
    joules_per_token: float | None = None
    energy_kwh: float | None = None
    gpu_hours: float | None = None
    cost: float | None = None
    clock: dict[str, float] | None = None
    """The group's clocks (:class:`raylm.workers.loop.StepMeter`): the goodput account's."""
    numerical_faults: list[dict[str, Any]] | None = None
    figures: dict[str, float] = field(default_factory=dict)
    """The objective's and the validation's figures, by name (``rl_reward``, ``val_loss``)."""

    # The order reports had before they were a record (a progress record, and the history read
    # from it, keeps the order): the group's fields less the step, and the step's in two
    # parts, around the objective's figures; a step's validation figures come last.
    GROUP: ClassVar[tuple[str, ...]] = (
        "workers", "accumulation", "micro_batch", "data_parallel", "tensor_parallel",
        "pipeline_parallel", "trainable_params", "attention_backend", "precision",
        "resumed_from_step", "group_started", "data_startup_s")
    START: ClassVar[tuple[str, ...]] = ("step", "event", "setup_s", "phases", "resumed_clock")
    WINDOW: ClassVar[tuple[str, ...]] = (
        "step", "loss", "lr", "grad_norm", "tokens_seen", "preempted", "tokens_per_s",
        "data_wait_fraction", "data_wait_fraction_run", "mfu", "elapsed_s", "peak_memory_gb",
        "joules_per_step", "watts_per_gpu", "joules_per_token")
    TOTALS: ClassVar[tuple[str, ...]] = ("energy_kwh", "gpu_hours", "cost")
    STATE: ClassVar[tuple[str, ...]] = ("param_memory_gb", "optimizer_memory_gb", "clock")
    # The figures each progress record of the run's events keeps, with every one of
    # ``figures``: the run's metric history (raylm.api reads it back as a DataFrame).
    HISTORY: ClassVar[frozenset[str]] = frozenset((
        "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "data_wait_fraction",
        "peak_memory_gb", "workers", "joules_per_token", "watts_per_gpu", "energy_kwh"))

    @property
    def announces(self) -> bool:
        """Whether this is a group's announcement rather than a step's report."""
        return self.event == Event.GROUP_START

    @property
    def val_loss(self) -> float | None:
        return self.figures.get("val_loss")

    @property
    def evaluated(self) -> bool:
        """Whether the report closes an evaluation (its validation figures)."""
        return any(k.startswith("val_") for k in self.figures)

    def validation(self) -> dict[str, float]:
        """The validation figures besides the loss (DPO's accuracy, GRPO's held-out reward)."""
        return {k: v for k, v in self.figures.items()
                if k.startswith("val_") and k not in ("val_loss", "val_perplexity")}

    def objective_figures(self, prefix: str) -> dict[str, float]:
        return {k: v for k, v in self.figures.items() if k.startswith(prefix)}

    def history(self) -> dict[str, Any]:
        """What a progress record keeps of the report: its set history figures, in order."""
        return {k: v for k, v in self.to_metrics().items() if v is not None
                and (k in self.HISTORY or k in self.figures)}

    def to_metrics(self) -> dict[str, Any]:
        """The flat mapping Ray Train carries and MLflow logs: an announcement's group and
        start fields; a step's figures (unmeasured ones as None), the objective's, the run's
        totals, the group's, the state's, any numerical faults, then validation figures."""
        def named(names) -> dict[str, Any]:
            return {n: getattr(self, n) for n in names}

        if self.announces:
            return {**named(self.GROUP), **named(self.START)}
        val = {k: v for k, v in self.figures.items() if k.startswith("val_")}
        faults = {} if self.numerical_faults is None else {
            "numerical_faults": self.numerical_faults}
        return {**named(self.WINDOW), **{k: v for k, v in self.figures.items() if k not in val},
                **named(self.TOTALS), **named(self.GROUP), **named(self.STATE), **faults, **val}

    def logged_metrics(self) -> dict[str, float]:
        """What MLflow logs as metrics at the report's step: every number, less the step
        itself and the group's start time (which tells worker groups apart)."""
        return {k: v for k, v in self.to_metrics().items() if isinstance(v, (int, float))
                and not isinstance(v, bool) and k not in ("step", "group_started")}

    def described(self) -> dict[str, str]:
        """What MLflow logs once as the run's params: the kernel and the precision."""
        return {k: str(v) for k, v in (("attention_backend", self.attention_backend),
                                       ("precision", self.precision)) if v is not None}

    @classmethod
    def from_metrics(cls, metrics: dict[str, Any]) -> Report:
        """The report ``metrics`` (:meth:`to_metrics`) holds; a name that is neither a field
        nor a figure is refused (workers and controller run one release)."""
        known = {f.name for f in fields(cls)} - {"figures"}
        figures = {k: v for k, v in metrics.items()
                   if k not in known and k != EARLIER_REPORTS and k.startswith(FIGURE_PREFIXES)}
        unknown = set(metrics) - known - set(figures) - {EARLIER_REPORTS}
        if unknown:
            raise Malformed(f"a report holds {sorted(unknown)}, which no field of raylm's "
                            f"Report names")
        missing = [f.name for f in fields(cls) if f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING and f.name not in metrics]
        if missing:
            raise Malformed(f"a report lacks {missing}")
        return cls(**{k: v for k, v in metrics.items() if k in known}, figures=figures)
