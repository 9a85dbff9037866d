"""``summary.json``: where a run stands, as its record (:mod:`raylm.run.record`) writes it while
the run goes and at its end, and as every later reader (the driver, ``raylm export``, ``eval``,
``prune``, :class:`raylm.api.Run`, a later release) reads it: :class:`Summary`.

Its keys are the names summary.json has always had, in the same order, so scripts reading the
file see no change: the latest step's figures and the run's state, an objective's ``rl_*`` and
the validation's ``val_*`` figures (:attr:`Summary.figures`) after the validation loss, and the
final model's MLflow URI (:attr:`Summary.logged_model`), which the driver adds, last. The version is
implicit: a summary.json without ``version`` is of version 1 (every one raylm has written); a
later shape will say its version, and this reader refuses what it does not know.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from raylm.contracts import SUMMARY, Malformed, fits, hints, typed
from raylm.contracts.events import Interruption, TrackingLost
from raylm.contracts.report import FIGURE_PREFIXES

STATUSES = ("running", "finished", "failed")


@dataclass(kw_only=True)
class Goodput:
    """The goodput account (:mod:`raylm.run.goodput`): the wall time (``total_s``) by cause,
    the productive share of it, a start's phases, the steps trained twice and their energy."""

    total_s: float
    goodput: float | None
    seconds: dict[str, float]
    startup_phases: dict[str, float] | None = None  # None: before 0.4
    recomputed_steps: int = 0
    energy_wasted_j: float | None = None
    """None without an energy counter (CPUs)."""


@dataclass(kw_only=True)
class LoggedModel:
    """The run's final model in MLflow, which the driver logs once the run finished
    (:meth:`raylm.run.tracking.MLflowTracker.log_model`), and its registered version."""

    mlflow_model_uri: str
    registered_model: str | None = None
    registered_version: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(kw_only=True)
class Summary:
    """summary.json: the latest step's figures, the run's state and, once it ended, its
    outcome (:attr:`status`), wall time and sample accounting."""

    FILE: ClassVar[str] = SUMMARY
    VERSION: ClassVar[int] = 1
    # Known once the run has ended (absent while it runs).
    FINAL: ClassVar[tuple[str, ...]] = ("wall_s", "samples")

    status: str
    invocation: str
    """The invocation (:class:`raylm.run.record.RunRecord`) that wrote it."""
    final_step: int | None = None
    train_loss: float | None = None
    val_loss: float | None = None
    figures: dict[str, float | None] = field(default_factory=dict)
    """The latest evaluation's ``val_*`` figures besides its loss, then the latest step's
    ``rl_*`` figures."""
    tokens_per_s: float | None = None
    mfu: float | None = None
    data_wait_fraction: float | None = None
    checkpoint_path: str | None = None
    mlflow_run_id: str | None = None
    mlflow_tracking_uri: str | None = None
    tracking_lost: TrackingLost | None = None
    """The step and cause, once MLflow failed during the run (written as those two)."""
    resumed_from_step: int | None = None
    workers: int | None = None
    trainable_params: int | None = None
    peak_memory_gb: float | None = None
    param_memory_gb: float | None = None
    optimizer_memory_gb: float | None = None
    data_parallel: int | None = None
    tensor_parallel: int | None = None
    pipeline_parallel: int | None = None
    joules_per_token: float | None = None
    watts_per_gpu: float | None = None
    energy_kwh: float | None = None
    gpu_hours: float | None = None
    cost: float | None = None
    restarts: int = 0
    resizes: int = 0
    failures: int = 0
    interruptions: list[Interruption] = field(default_factory=list)
    numerical_faults: list = field(default_factory=list)
    device: str | None = None
    """Where the workers ran, and why (scaling.use_gpu, and the cluster)."""
    attention_backend: str | None = None
    precision: str | None = None
    changed_on_resume: list = field(default_factory=list)
    """What this invocation resumed with although it changed (checkpoint.accept_changes)."""
    goodput: Goodput | None = None
    """This invocation's account while it runs; the whole run's in the final summary."""
    benchmarks: dict | None = None
    """Every invocation's benchmark scores; None when none are asked for."""
    wall_s: float | None = None
    samples: dict | None = None
    """What the final checkpoint's sample ledger says was trained (None: it keeps none)."""
    logged_model: LoggedModel | None = None

    @property
    def ended(self) -> bool:
        return self.status != "running"

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    def to_dict(self) -> dict[str, Any]:
        """summary.json's mapping, its keys in their order."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "figures":
                out.update(self.figures)
            elif f.name == "logged_model":
                out.update(self.logged_model.to_dict() if self.logged_model else {})
            elif f.name == "interruptions":
                out[f.name] = [asdict(e) for e in self.interruptions]
            elif f.name == "tracking_lost":
                t = self.tracking_lost
                out[f.name] = None if t is None else {"step": t.step, "error": t.error}
            elif f.name == "goodput":
                out[f.name] = None if self.goodput is None else asdict(self.goodput)
            elif f.name not in self.FINAL or self.ended:
                out[f.name] = getattr(self, f.name)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> Summary:
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise Malformed(f"{SUMMARY} is malformed (not a JSON object)")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Summary:
        """The summary ``data`` holds (every version raylm wrote); a key neither a field, a
        figure nor the final model's, or a value not of its field's type, is refused."""
        version = data.get("version", 1)
        if version != cls.VERSION:
            raise Malformed(f"{SUMMARY} is of version {version!r}, which this raylm does not "
                            f"read: upgrade raylm")
        types = hints(cls)
        known = {f.name for f in fields(cls)} - {"figures", "logged_model"}
        found: dict[str, Any] = {"figures": {}}
        model = {}
        models = {f.name for f in fields(LoggedModel)}
        for key, value in data.items():
            if key == "version":
                continue
            if key in known:
                value = _READ[key](value) if key in _READ else value
                if not fits(value, types[key]):
                    raise Malformed(f"{SUMMARY} is malformed ({key} is {value!r:.200})")
                found[key] = value
            elif key.startswith(FIGURE_PREFIXES):
                if not fits(value, float | None):
                    raise Malformed(f"{SUMMARY} is malformed ({key} is {value!r})")
                found["figures"][key] = value
            elif key in models:
                model[key] = value
            else:
                raise Malformed(f"{SUMMARY} holds {key!r}, which raylm's Summary does not name")
        for key in ("status", "invocation"):
            if key not in found:
                raise Malformed(f"{SUMMARY} is malformed ({key} is missing)")
        if found["status"] not in STATUSES:
            raise Malformed(f"{SUMMARY} is malformed (status {found['status']!r} is not one "
                            f"of {', '.join(STATUSES)})")
        if model:
            found["logged_model"] = typed(LoggedModel, model, f"{SUMMARY}'s final model")
        return cls(**found)


# The fields summary.json holds as records of their own.
_READ = {"interruptions": lambda v: [Interruption.from_dict(e) for e in v]
         if isinstance(v, list) else v,
         "goodput": lambda v: None if v is None else typed(Goodput, v, f"{SUMMARY}'s goodput"),
         "tracking_lost": lambda v: None if v is None else typed(TrackingLost, v,
                                                                 f"{SUMMARY}'s tracking_lost")}


@dataclass(kw_only=True)
class Trial:
    """One trial of a sweep: its sampled settings, its best validation loss and best figure
    by the sweep's metric (``ranked``, written under the metric's name), how far it trained,
    why it stopped, its newest checkpoint, and its curve (``history``: ``[step, value]`` of
    the validation loss, or of the metric where the run has none; ``scores``: a benchmark's)."""

    trial_id: str
    config: dict[str, Any]
    val_loss: float | None
    ranked: float | None
    steps: int
    stopped_early: bool
    error: str | None
    checkpoint_path: str | None
    history: list[list[float]]
    scores: list[list[float]] | None = None

    def to_dict(self, metric: str) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("ranked", "scores")}
        ordered = dict(list(out.items())[:3]) | {metric: self.ranked} | out
        return ordered | ({} if self.scores is None else {"scores": self.scores})


@dataclass(kw_only=True)
class SweepSummary:
    """``tune_summary.json``, which ``raylm tune`` writes at the end (:mod:`raylm.run.sweep`):
    every trial, the metric they are ranked by, the best, and the sweep's MLflow run."""

    FILE: ClassVar[str] = "tune_summary.json"
    trials: list[Trial]
    metric: str = "val_loss"  # sweeps before tune.metric ranked by it
    best_trial: str | None = None
    mlflow_parent_run_id: str | None = None
    mlflow_tracking_uri: str | None = None
    trials_dir: str | None = None

    @property
    def best(self) -> Trial | None:
        return next((t for t in self.trials if t.trial_id == self.best_trial), None)

    def to_dict(self) -> dict[str, Any]:
        b = self.best
        best = None if b is None else {
            "trial_id": b.trial_id, "config": b.config, "val_loss": b.val_loss,
            self.metric: b.ranked, "checkpoint_path": b.checkpoint_path}
        return {"trials": [t.to_dict(self.metric) for t in self.trials], "metric": self.metric,
                "best": best, "mlflow_parent_run_id": self.mlflow_parent_run_id,
                "mlflow_tracking_uri": self.mlflow_tracking_uri, "trials_dir": self.trials_dir}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> SweepSummary:
        try:
            data = json.loads(text)
            metric = data.get("metric", "val_loss")
            trials = [Trial(**{k: v for k, v in t.items() if k not in (metric, "val_loss")},
                            val_loss=t.get("val_loss"), ranked=t.get(metric))
                      for t in data["trials"]]
            best = data["best"] and data["best"]["trial_id"]
            return cls(trials=trials, metric=metric, best_trial=best,
                       **{k: data.get(k) for k in ("mlflow_parent_run_id",
                                                   "mlflow_tracking_uri", "trials_dir")})
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise Malformed(f"{cls.FILE} is malformed ({type(e).__name__}: {e})") from None
