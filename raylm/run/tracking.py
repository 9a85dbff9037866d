"""MLflow, on the driver and the controller (the workers' node monitors are
:mod:`raylm.workers.node_metrics`). One tracker per raylm run, made once on the driver.

:func:`start` gives an :class:`MLflowTracker` (the run created, or found again through
``RUN_DIR/mlflow_run.json`` so a resumed or restarted run logs into the same MLflow run, with the
resolved config as params) or a :class:`Tracker` that does nothing, when tracking is off or
the store cannot be reached. The same object then travels to the Ray Train controller, where
the run's record (:mod:`raylm.run.record`) logs every report's metrics, checkpoint locations
and restart/resize events through it; the workers get its URI and run id. A sweep's trials
nest their runs under the sweep's tracker. When training ends the driver logs the final model
through it (a LoggedModel, optionally registered).

Ray 2.60's ``UserCallback`` has ``after_report`` and ``after_exception`` but no hooks before or
after the run, so the driver starts the MLflow run and finishes it when ``fit`` returns.

Tracking never stops training: every method of :class:`MLflowTracker` goes through
:meth:`MLflowTracker._guard`, which prints the first failure and turns the tracker off.

Default store: ``sqlite:///<storage_path>/mlflow.db`` with artifacts in
``<storage_path>/mlartifacts`` (no server; browse with ``mlflow ui --backend-store-uri
sqlite:///runs/mlflow.db``). ``tracking.uri`` or ``MLFLOW_TRACKING_URI`` points at a server.
mlflow itself is imported only when a tracker first talks to the store (it takes seconds).
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

from raylm import storage
from raylm.config import Config, run_dir, storage_root
from raylm.contracts import MLFLOW_RUN
from raylm.contracts.report import Report
from raylm.contracts.summary import Goodput, LoggedModel, Summary, SweepSummary
from raylm.run.goodput import table
from raylm.workers.node_metrics import fail_fast


def resolve_uri(cfg: Config) -> str:
    """The tracking URI for ``cfg``; ValueError for a store that cannot exist (checked before
    Ray starts)."""
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


def run_tracker(run_dir: str, summary: Summary | None, *, log) -> Tracker:
    """A finished run's MLflow run, for ``raylm eval`` and ``prune``: in the store
    MLFLOW_TRACKING_URI names, else the default one beside the run directory, never one the
    run directory names (it would get the user's MLflow credentials)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.dirname(run_dir)}/mlflow.db"
    if summary is None or not summary.mlflow_run_id:
        return Tracker()
    named = summary.mlflow_tracking_uri
    if storage.redact(uri) != named:
        log(f"raylm: not logged to MLflow: the run's summary names its store {named}; raylm "
            f"logs only to MLFLOW_TRACKING_URI's (else {uri}): set it there if you trust it")
        return Tracker()
    return MLflowTracker(summary.mlflow_run_id, uri)


def _param_value(v: Any) -> str:
    return storage.redact(json.dumps(v) if isinstance(v, (list, dict)) else str(v))


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0][:300] if str(e) else type(e).__name__


class Tracker:
    """What the run tracks through; this base is the null tracker (tracking off): every call
    does nothing, so the loop and the record never branch on whether tracking is on."""

    run_id: str | None = None
    uri: str | None = None
    lost: str | None = None  # why tracking stopped, once it has

    def __bool__(self) -> bool:
        return False

    # What a tracker does (MLflowTracker says how); here, nothing.
    def lose(self, reason: str) -> None: ...  # stop without a word: another copy said it
    def log_report(self, report: Report, checkpoint_path: str | None) -> None: ...
    def log_events(self, events: dict[str, Any], counts: dict[str, int], step: int) -> None: ...
    def log_goodput(self, account: Goodput, step: int) -> None: ...
    def log_scores(self, scores: dict[str, float], step: int) -> None: ...
    def log_pruning(self, report: dict[str, Any]) -> None: ...
    def log_sweep(self, summary: SweepSummary, plot_path: Path) -> None: ...
    def log_dataset(self, manifest: dict[str, Any], prepared: str) -> None: ...
    def log_model(self, directory: Path, *, adapter: bool, step: int, name: str,
                  description: str, register_as: str | None) -> LoggedModel | None: ...
    def log_run_files(self, run_dir: str, names: tuple[str, ...]) -> None: ...
    def finish(self, *, failed: bool) -> None: ...


def _guarded(what: str):
    """A tracker method that never stops training: called with the tracker's MLflow client
    (made on first use), it turns the tracker off at its first failure, saying ``what`` it
    could not do, and returns None (:meth:`MLflowTracker._guard`)."""
    def wrap(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            return self._guard(what, lambda client: method(self, client, *args, **kwargs))
        return guarded
    return wrap


class MLflowTracker(Tracker):
    """One MLflow run. Picklable (its id and URI); the client is made where it is used."""

    def __init__(self, run_id: str, uri: str, *, keep: int | None = None) -> None:
        self.run_id, self.uri = run_id, uri
        self.keep = keep
        """How many checkpoints Ray Train keeps (checkpoint.keep): the newest, by step."""
        self.broken = False
        self.params_logged = False
        self.checkpoints: list[dict[str, Any]] = []
        self._client = None

    def __bool__(self) -> bool:
        return True

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}

    def _guard(self, what: str, fn) -> Any:
        if self.broken:
            return None
        try:
            if self._client is None:
                from mlflow import MlflowClient

                fail_fast()
                self._client = MlflowClient(tracking_uri=self.uri)
            return fn(self._client)
        except Exception as e:  # MLflow raises many types for an unreachable or broken store
            self.lose(f"could not {what}: {_first_line(e)}")
            print(f"warning: MLflow could not {what}; the run continues untracked: "
                  f"{_first_line(e)}", flush=True)
            return None

    def lose(self, reason: str) -> None:
        self.broken, self.lost = True, reason

    @_guarded("log metrics")
    def log_report(self, client, report: Report, checkpoint_path: str | None) -> None:
        """A report's numeric values as metrics at its step; the descriptive ones as params
        (what the run started with: MLflow's params never change) and as tags (what the
        latest invocation runs: a resume may run another kernel or precision), once per
        invocation; a checkpoint's location as a tag and in ``checkpoints.json``."""
        from mlflow.entities import Param, RunTag

        step = int(report.step)
        values = _metrics(report.logged_metrics(), step)
        params, tags = [], []
        if not self.params_logged:
            held = client.get_run(self.run_id).data.params
            described = report.described().items()
            params = [Param(k, v) for k, v in described if k not in held]
            tags = [RunTag(f"raylm.{k}", v) for k, v in described]
            self.params_logged = True
        client.log_batch(self.run_id, metrics=values, params=params, tags=tags)
        if checkpoint_path is not None:
            self.checkpoints.append({"step": step, "path": checkpoint_path})
            # Ray Train has deleted the older ones (num_to_keep), so the list names only those
            # a user can still open.
            if self.keep:
                self.checkpoints = self.checkpoints[-self.keep:]
            client.set_tag(self.run_id, "raylm.checkpoint_latest", checkpoint_path)
            client.log_dict(self.run_id, {"checkpoints": self.checkpoints}, "checkpoints.json")

    @_guarded("record a run event")
    def log_events(self, client, events, counts, step) -> None:
        """Restarts, resizes and failures: ``events`` as the ``events.json`` artifact, and
        ``counts`` as metrics at the step of the report that saw them."""
        client.log_dict(self.run_id, events, "events.json")
        client.log_batch(self.run_id, metrics=_metrics(counts, step))

    @_guarded("log the goodput account")
    def log_goodput(self, client, account, step) -> None:
        """The goodput account (:mod:`raylm.run.goodput`): ``goodput`` and ``goodput_<cause>_s``
        as metrics at the run's last step, and the table by cause as ``goodput.json``."""
        if not account.total_s:
            return
        values = {"goodput": account.goodput, "goodput_total_s": account.total_s,
                  "goodput_recomputed_steps": account.recomputed_steps,
                  **{f"goodput_{k}_s": v for k, v in account.seconds.items()}}
        if account.energy_wasted_j is not None:
            values["energy_wasted_j"] = account.energy_wasted_j
        client.log_batch(self.run_id, metrics=_metrics(values, max(step, 0)))
        client.log_table(self.run_id, data=table(account), artifact_file="goodput.json")

    @_guarded("log benchmark scores")
    def log_scores(self, client, scores: dict[str, float], step: int) -> None:
        """Benchmark scores (:mod:`raylm.run.benchmarks`) as metrics at the step of the
        checkpoint they score."""
        client.log_batch(self.run_id, metrics=_metrics(scores, step))

    @_guarded("log the pruning report")
    def log_pruning(self, client, report: dict[str, Any]) -> None:
        """A pruned copy's figures (:mod:`raylm.after.prune`) as metrics at the step of the
        checkpoint pruned, ``prune/<method>_<target>/...``, and its report as an artifact."""
        tag = f"{report['method']}_{report['sparsity'].replace(':', 'of').replace('%', 'pct')}"
        figures = {f"prune/{tag}/{k}": report[k] for k in (
            "layer_sparsity", "val_loss", "val_loss_before") if report[k] is not None}
        client.log_batch(self.run_id, metrics=_metrics(figures, report["step"] or 0))
        client.log_text(self.run_id, json.dumps(report, indent=1), f"pruning/{tag}.json")

    @_guarded("record the sweep summary")
    def log_sweep(self, client, summary: SweepSummary, plot_path: Path) -> None:
        """The sweep's run: its summary and plot as artifacts, the best validation loss and
        config, the tag ``raylm.best`` on the best trial's (child) run, and ASHA-stopped
        trials' runs closed as killed."""
        from mlflow.entities import RunTag

        client.log_dict(self.run_id, summary.to_dict(), SweepSummary.FILE)
        if plot_path.is_file():
            client.log_artifact(self.run_id, str(plot_path))
        for t in summary.trials:
            # A trial that ASHA stopped was ended from outside: close its run as killed.
            child = saved_run_id(storage.join(summary.trials_dir, str(t.trial_id)))
            if t.stopped_early and child:
                client.set_tag(child, "raylm.stopped_early", "true")
                client.set_terminated(child, status="KILLED")
        best = summary.best
        if best is None:
            return
        # Tags, not params: a resumed sweep may find a better trial, and MLflow params never
        # change once logged.
        ranked = {f"best_{k}": v for k, v in (("val_loss", best.val_loss),
                                              (summary.metric, best.ranked)) if v is not None}
        client.log_batch(self.run_id, metrics=_metrics(ranked, 0),
                         tags=[RunTag(f"raylm.best.{k}", _param_value(v))
                               for k, v in best.config.items()])
        child = (saved_run_id(storage.parent(best.checkpoint_path))
                 if best.checkpoint_path else None)
        if child:
            client.set_tag(child, "raylm.best", "true")
            client.set_tag(self.run_id, "raylm.best_run_id", child)

    @_guarded("record the final model")
    def log_model(self, client, directory: Path, adapter: bool, step: int, name: str,
                   description: str, register_as: str | None) -> LoggedModel:
        """The final model as an MLflow LoggedModel, an output of the run at ``step`` (the
        Models tab of MLflow's UI lists it), and with ``register_as`` a new version of that
        registered model. ``directory`` is raylm's export: a Hugging Face model directory,
        logged in MLflow's transformers flavor (``mlflow.transformers.load_model(uri)`` gives a
        text-generation pipeline), or with ``adapter`` a peft adapter directory, logged as it
        is (``PeftModel.from_pretrained(base, mlflow.artifacts.download_artifacts(uri))``):
        the flavor would store the whole base model beside every adapter. Returns its URI
        and, when registered, the registered model and its version."""
        import tempfile

        from mlflow.entities import LoggedModelOutput, LoggedModelStatus

        experiment = client.get_run(self.run_id).info.experiment_id
        with tempfile.TemporaryDirectory(prefix="raylm-mlflow-model-") as tmp:
            artifacts = directory if adapter else _transformers_flavor(
                directory, Path(tmp) / "model", description)
            model = client.create_logged_model(
                experiment, name=name, source_run_id=self.run_id,
                model_type="peft-adapter" if adapter else "transformers",
                params={"step": str(step)}, tags={"raylm.run_id": self.run_id})
            client.log_model_artifacts(model.model_id, str(artifacts))
        client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        client.log_outputs(self.run_id, [LoggedModelOutput(model.model_id, step)])
        logged = LoggedModel(mlflow_model_uri=model.model_uri)
        if register_as:
            from mlflow.exceptions import MlflowException

            try:
                client.create_registered_model(register_as)
            except MlflowException as e:
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
            # The artifact location, not the models:/ URI: MLflow's SQL registry store
            # resolves that URI through the process-wide tracking URI, not this client's.
            # Used directly, that store keeps no model id: the tag names the logged model.
            version = client.create_model_version(
                register_as, source=model.artifact_location, run_id=self.run_id,
                model_id=model.model_id, tags={"raylm.model_id": model.model_id},
                description=description)
            logged.registered_model = register_as
            logged.registered_version = int(version.version)
        return logged

    @_guarded("record the dataset")
    def log_dataset(self, client, manifest: dict[str, Any], prepared: str) -> None:
        """The prepared data as the run's MLflow dataset input (context ``training``): where
        it lies as the source, the manifest's fingerprint as the digest, the manifest's counts
        as the profile, so runs can be searched and compared by the data they trained on."""
        from mlflow.entities import DatasetInput, InputTag

        dataset = prepared_dataset(manifest, prepared)
        client.log_inputs(self.run_id, datasets=[DatasetInput(
            dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", "training")])])

    @_guarded("record the run's files")
    def log_run_files(self, client, run_dir: str, names: tuple[str, ...]) -> None:
        """Files of the run directory (summary.json, run.json) as artifacts of the run."""
        for name in names:
            path = storage.join(run_dir, name)
            if storage.is_file(path):
                client.log_text(self.run_id, storage.read_text(path), name)

    @_guarded("close the run")
    def finish(self, client, *, failed: bool) -> None:
        client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _transformers_flavor(directory: Path, output: Path, description: str) -> Path:
    """A Hugging Face model directory saved as MLflow's transformers flavor (a text-generation
    pipeline, also loadable as pyfunc). Saved from a pipeline object: MLflow 3.17's path for a
    local checkpoint directory fails with transformers 5 (it reads a task's pipeline class
    where transformers now keeps its name). The model card is given, so MLflow does not look
    for one on the Hugging Face Hub under the directory's name."""
    import huggingface_hub
    import mlflow.transformers
    import torch
    import transformers

    pipeline = transformers.pipeline("text-generation", model=str(directory.resolve()),
                                     device="cpu")
    mlflow.transformers.save_model(
        pipeline, str(output),
        model_card=huggingface_hub.ModelCard(f"---\ntags: [raylm]\n---\n{description}\n"),
        pip_requirements=[f"torch>={torch.__version__.split('+')[0]}",
                          f"transformers>={transformers.__version__}"])
    return output


def prepared_dataset(manifest: dict[str, Any], prepared: str):
    """An MLflow dataset that names prepared data without copying it."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource

    counts = {k: manifest[k] for k in ("documents_read", "documents_kept", "dropped", "tokens",
                                       "blocks", "block_length", "tail_tokens_dropped",
                                       "trained_tokens", "padding_tokens") if k in manifest}

    class Prepared(MetaDataset):
        @property
        def profile(self) -> dict[str, Any]:
            return counts

        def to_dict(self) -> dict[str, str]:
            return {**super().to_dict(), "profile": json.dumps(self.profile)}

    source = (resolve_dataset_source(prepared) if storage.is_uri(prepared)
              else LocalArtifactDatasetSource(str(Path(prepared).resolve())))
    return Prepared(source, name=f"prepared-{manifest['fingerprint'][:8]}",
                    digest=manifest["fingerprint"][:36])


def run_tags(cfg: Config) -> dict[str, str]:
    """Tags to filter runs on (``tags.raylm.training = 'lora'``): the model, how it is trained,
    the worker count, the precision asked for and the data format."""
    lo, hi = cfg.scaling.worker_range
    training = "full"
    if cfg.lora.rank:
        training = "qlora" if cfg.lora.base_quantization == "nf4" else "lora"
    return {
        "raylm.model": (Path(cfg.model.path).name if cfg.model.path
                        else f"preset:{cfg.model.preset}"),
        "raylm.training": training if cfg.model.path else f"pretrain-{training}",
        "raylm.workers": str(lo) if lo == hi else f"{lo}-{hi}",
        "raylm.precision": cfg.train.precision,
        "raylm.data_format": cfg.data.format,
    }


def _metrics(values: dict[str, Any], step: int) -> list:
    """MLflow metrics of ``values`` at ``step``, timed now."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    return [Metric(k, float(v), now, step) for k, v in values.items()]


def saved_run_id(directory: str) -> str | None:
    """The MLflow run id a run directory recorded, if any."""
    saved = storage.join(directory, MLFLOW_RUN)
    return json.loads(storage.read_text(saved))["run_id"] if storage.is_file(saved) else None


def start(cfg: Config, *, log=print, parent: Tracker | None = None) -> Tracker:
    """The tracker of this raylm run: its MLflow run created or found again, or a
    :class:`Tracker` that does nothing when tracking is off or the store cannot be reached
    (said once). A sweep's trials pass the sweep's tracker as ``parent``, so their runs nest
    under it."""
    if not cfg.tracking.enabled:
        return Tracker()
    uri = parent.uri if parent else resolve_uri(cfg)
    fail_fast()
    try:
        run_id = _find_or_create_run(cfg, uri, parent.run_id if parent else None)
    except Exception as e:  # MLflow raises many types for an unreachable or broken store
        refused = refusal(e, uri, cfg.tracking.experiment)
        if refused:
            raise ValueError(refused) from None
        log(f"warning: MLflow at {storage.redact(uri)} is unavailable, training continues "
            f"untracked: {storage.redact(_first_line(e))}")
        return Tracker()
    log(f"raylm: MLflow run {run_id} at {storage.redact(uri)}")
    return MLflowTracker(run_id, uri, keep=cfg.checkpoint.keep)


def left_running(cfg: Config, run_id: str | None) -> bool:
    """Whether the MLflow run ``run_id`` is still RUNNING in ``cfg``'s store (False where it
    cannot be read)."""
    from mlflow import MlflowClient

    fail_fast()
    try:
        return bool(run_id) and MlflowClient(tracking_uri=resolve_uri(cfg)).get_run(
            run_id).info.status == "RUNNING"
    except Exception:  # noqa: BLE001 - an unreachable store: nothing to mend from here
        return False


def check_access(cfg: Config) -> None:
    """ValueError for a store that cannot exist, or a tracking server that answers but
    refuses this client (see :func:`refusal`); one request, only to http(s) servers. A server
    that does not answer is not a mistake here: :func:`start` says so and trains untracked."""
    uri = resolve_uri(cfg)
    if not uri.startswith(("http://", "https://")):
        return
    from mlflow import MlflowClient

    fail_fast()
    try:
        MlflowClient(tracking_uri=uri).get_experiment_by_name(cfg.tracking.experiment)
    except Exception as e:  # unreachable, or refused
        refused = refusal(e, uri, cfg.tracking.experiment)
        if refused:
            raise ValueError(refused) from None


def refusal(e: Exception, uri: str, experiment: str) -> str | None:
    """What to do about a server that answered but refused (credentials, permissions, Host
    header), or None for any other failure. A refusal is a mistake in the setup, which no
    retry mends: the run is refused rather than trained untracked."""
    status = getattr(e, "get_http_status_code", lambda: None)()
    where = storage.redact(uri)
    if status == 401:
        return (f"MLflow at {where} asks for credentials (401): set MLFLOW_TRACKING_USERNAME "
                f"and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) where the run "
                f"starts and on the Ray nodes (the cluster files read them from a Secret or "
                f"the node's env file), or tracking.enabled=false.")
    if status == 403 and "Host header" in str(e):
        host = uri.split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1]
        return (f"MLflow at {where} refuses the Host header {host!r} (403): add it to the "
                f"server's --allowed-hosts (MLFLOW_ALLOWED_HOSTS for cluster/mlflow.sh).")
    if status == 403:
        return (f"MLflow at {where} refused this user (403): grant it EDIT on experiment "
                f"{experiment!r}, or use an account that has it.")
    return None


def _find_or_create_run(cfg: Config, uri: str, parent_run_id: str | None) -> str:
    from mlflow import MlflowClient
    from mlflow.entities import Param

    client = MlflowClient(tracking_uri=uri)
    rd = run_dir(cfg)
    saved = storage.join(rd, MLFLOW_RUN)
    if storage.is_file(saved):
        known = json.loads(storage.read_text(saved))
        if known.get("tracking_uri") in (uri, storage.redact(uri)):
            run = client.get_run(known["run_id"])
            client.update_run(run.info.run_id, status="RUNNING")
            # A resume may change the workers or the precision: the tags say what ran last.
            for k, v in run_tags(cfg).items():
                client.set_tag(run.info.run_id, k, v)
            return run.info.run_id
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        artifacts = None
        if uri.startswith("sqlite:///"):
            artifacts = str(Path(uri[len("sqlite:///"):]).parent / "mlartifacts")
        exp_id = client.create_experiment(cfg.tracking.experiment, artifact_location=artifacts)
    else:
        exp_id = exp.experiment_id
    tags = {"raylm.run_dir": storage.redact(rd), "raylm.run_name": cfg.run.name,
            **run_tags(cfg)}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(exp_id, run_name=cfg.run.name, tags=tags)
    params = [Param(k, _param_value(v)[:6000]) for k, v in sorted(cfg.flat().items())]
    for i in range(0, len(params), 100):
        client.log_batch(run.info.run_id, params=params[i:i + 100])
    # The store's address without credentials: the file is read to find the run again,
    # which its redacted address does as well as the whole one.
    storage.write_text(saved, json.dumps({"run_id": run.info.run_id,
                                          "tracking_uri": storage.redact(uri)}))
    return run.info.run_id
