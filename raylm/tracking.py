"""MLflow: exactly one run per raylm run, written from the Ray Train controller, never per worker.

The driver creates the run (or finds it again: its id is kept in ``RUN_DIR/mlflow_run.json``, so
a resumed or restarted run logs into the same MLflow run) and logs the resolved config as
params. :class:`MLflowCallback`, a Ray Train V2 ``UserCallback``, runs on the controller and logs
every reported metric at its step, the attention backend and precision that actually ran, and
every checkpoint location. System metrics come from MLflow's own ``SystemMetricsMonitor``,
started on one worker per node with that node's id, so CPU, memory and (through NVML) GPU
utilisation and memory of the training nodes land in the same run as ``system/<node>/...``.

Tracking never stops training: if the store is unreachable, the error is printed once and the
run continues untracked (``mlflow_run_id: null`` in summary.json).

Default store: ``sqlite:///<storage_path>/mlflow.db`` with artifacts in
``<storage_path>/mlartifacts`` (no server; browse with ``mlflow ui --backend-store-uri
sqlite:///runs/mlflow.db``). ``tracking.uri`` or ``MLFLOW_TRACKING_URI`` points at a server.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from raylm import storage
from raylm.config import Config, run_dir, storage_root

try:
    from ray.train.v2.api.callback import UserCallback
except ImportError:  # pragma: no cover - Ray without Train V2
    UserCallback = object

RUN_FILE = "mlflow_run.json"
# Reported values that describe the run rather than measure it: params, not metrics.
DESCRIPTIVE = ("attention_backend", "precision")


def resolve_uri(cfg: Config) -> str:
    if cfg.tracking.uri:
        return cfg.tracking.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if storage.is_uri(cfg.run.storage_path):
        raise ValueError(
            f"run.storage_path={cfg.run.storage_path!r} is object storage, where MLflow's "
            f"default SQLite store cannot live: set tracking.uri (an MLflow server, e.g. "
            f"http://HEAD:5000) or MLFLOW_TRACKING_URI, or tracking.enabled=false.")
    return f"sqlite:///{os.path.join(storage_root(cfg), 'mlflow.db')}"


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _param_value(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (list, dict)) else str(v)


def start_run(cfg: Config, *, log=print, parent_run_id: str | None = None,
              uri: str | None = None) -> tuple[str | None, str | None]:
    """(run id, tracking uri) of this raylm run's MLflow run, created or found again; (None,
    None) when tracking is off or the store cannot be reached (said once). A sweep's trials
    pass the sweep's run as ``parent_run_id`` (and its ``uri``), so they nest under it."""
    if not cfg.tracking.enabled:
        return None, None
    uri = uri or resolve_uri(cfg)
    rd = run_dir(cfg)
    # A dead server must cost seconds, not MLflow's default minutes of retries.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    try:
        client = _client(uri)
        saved = storage.join(rd, RUN_FILE)
        if storage.is_file(saved):
            known = json.loads(storage.read_text(saved))
            if known.get("tracking_uri") == uri:
                run = client.get_run(known["run_id"])
                client.update_run(run.info.run_id, status="RUNNING")
                return run.info.run_id, uri
        exp = client.get_experiment_by_name(cfg.tracking.experiment)
        if exp is None:
            artifacts = None
            if uri.startswith("sqlite:///"):
                artifacts = str(Path(uri[len("sqlite:///"):]).parent / "mlartifacts")
            exp_id = client.create_experiment(cfg.tracking.experiment,
                                              artifact_location=artifacts)
        else:
            exp_id = exp.experiment_id
        tags = {"raylm.run_dir": rd, "raylm.run_name": cfg.run.name}
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        run = client.create_run(exp_id, run_name=cfg.run.name, tags=tags)
        from mlflow.entities import Param

        params = [Param(k, _param_value(v)[:6000]) for k, v in sorted(cfg.flat().items())]
        for i in range(0, len(params), 100):
            client.log_batch(run.info.run_id, params=params[i:i + 100])
        storage.write_text(saved, json.dumps({"run_id": run.info.run_id, "tracking_uri": uri}))
        return run.info.run_id, uri
    except Exception as e:  # MLflow raises many types for an unreachable or broken store
        log(f"warning: MLflow at {uri} is unavailable, training continues untracked: "
            f"{str(e).splitlines()[0][:300] if str(e) else type(e).__name__}")
        return None, None


def finish_run(run_id: str | None, uri: str | None, *, failed: bool) -> None:
    if not run_id:
        return
    try:
        _client(uri).set_terminated(run_id, status="FAILED" if failed else "FINISHED")
    except Exception:  # the failure was already reported when it first happened
        pass


class MLflowCallback(UserCallback):
    """On the Ray Train controller: every report's metrics, at their step, into one run."""

    def __init__(self, run_id: str, uri: str) -> None:
        self.run_id, self.uri = run_id, uri
        self.checkpoints: list[dict[str, Any]] = []
        self.params_logged = False
        self.broken = False
        self._client = None

    def _safe(self, fn, *args, **kwargs) -> None:
        if self.broken:
            return
        try:
            if self._client is None:
                self._client = _client(self.uri)
            fn(self._client, *args, **kwargs)
        except Exception as e:  # never let tracking stop training; say so once
            self.broken = True
            print(f"warning: MLflow logging failed, training continues untracked: "
                  f"{str(e).splitlines()[0][:300] if str(e) else type(e).__name__}", flush=True)

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if metrics[0].get("event") == "group_start":  # recorded as an event, not a metric
            return
        self._safe(self._log, metrics[0], checkpoint)

    def _log(self, client, m: dict[str, Any], checkpoint) -> None:
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        step = int(m["step"])
        values = [Metric(k, float(v), now, step) for k, v in m.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"]
        params = []
        if not self.params_logged:
            params = [Param(k, str(m[k])) for k in DESCRIPTIVE if k in m]
            self.params_logged = True
        client.log_batch(self.run_id, metrics=values, params=params)
        if checkpoint is not None:
            self.checkpoints.append({"step": step, "path": checkpoint.path})
            client.set_tag(self.run_id, "raylm.checkpoint_latest", checkpoint.path)
            client.log_dict(self.run_id, {"checkpoints": self.checkpoints}, "checkpoints.json")


def start_node_monitor(run_id: str | None, uri: str | None, node: str):
    """MLflow's system-metrics monitor for this node (CPU, memory, disk, network, and GPU
    through NVML when present), logging into the run as ``system/<node>/...``."""
    if not run_id:
        return None
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, sampling_interval=5, samples_before_logging=1,
                                       resume_logging=True, node_id=node, tracking_uri=uri)
        monitor.start()
        return monitor
    except Exception as e:  # system metrics are a nicety; training goes on without them
        print(f"warning: MLflow system metrics unavailable on {node}: {e}", flush=True)
        return None


def log_events(run_id: str, uri: str, records: list[dict[str, Any]], step: int) -> None:
    """Failures, restarts and resizes of every invocation of the run: ``events.json`` in its
    artifacts, and the counts ``restarts``, ``resizes`` and ``failures`` as metrics at the step
    of the report that saw them."""
    from mlflow.entities import Metric

    from raylm.events import summarize

    by_invocation: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_invocation.setdefault(r["invocation"], []).append(r)
    parts = [summarize(rs) for rs in by_invocation.values()]
    try:
        client = _client(uri)
        client.log_dict(run_id, {
            "interruptions": [e for p in parts for e in p["interruptions"]],
            "failures": [r for r in records if r["event"] == "failure"]}, "events.json")
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, float(sum(p[k] for p in parts)), now, step)
                                          for k in ("restarts", "resizes", "failures")])
    except Exception as e:  # tracking never stops training
        print(f"warning: MLflow could not record a run event: {e}", flush=True)


def log_sweep(run_id: str, uri: str, summary: dict[str, Any], plot_path: Path) -> None:
    """The sweep's parent run: its summary and plot as artifacts, the best validation loss
    and config, and the tag ``raylm.best`` on the best trial's (child) run."""
    from mlflow.entities import Metric, RunTag

    try:
        client = _client(uri)
        client.log_dict(run_id, summary, "tune_summary.json")
        if plot_path.is_file():
            client.log_artifact(run_id, str(plot_path))
        for t in summary["trials"]:
            # A trial that ASHA stopped was ended from outside: close its run as killed.
            saved = storage.join(summary["trials_dir"], str(t["trial_id"]), RUN_FILE)
            if t["stopped_early"] and storage.is_file(saved):
                child = json.loads(storage.read_text(saved))["run_id"]
                client.set_tag(child, "raylm.stopped_early", "true")
                client.set_terminated(child, status="KILLED")
        best = summary["best"]
        if best is None:
            return
        # Tags, not params: a resumed sweep may find a better trial, and MLflow params never
        # change once logged.
        client.log_batch(run_id, metrics=[Metric("best_val_loss", best["val_loss"],
                                                 int(time.time() * 1000), 0)],
                         tags=[RunTag(f"raylm.best.{k}", _param_value(v))
                               for k, v in best["config"].items()])
        if best["checkpoint_path"]:
            trial_run = storage.join(storage.parent(best["checkpoint_path"]), RUN_FILE)
            if storage.is_file(trial_run):
                child = json.loads(storage.read_text(trial_run))["run_id"]
                client.set_tag(child, "raylm.best", "true")
                client.set_tag(run_id, "raylm.best_run_id", child)
    except Exception as e:  # the sweep's results are on disk either way
        print(f"warning: MLflow could not record the sweep summary: {e}", flush=True)
