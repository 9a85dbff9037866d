"""The driver side of ``raylm train``: prepare the data, build and fit the TorchTrainer, and
read the summary the run's record finished.

Everything here runs in the driver process (the CLI, a job's entrypoint, a notebook, a Tune
trial's function). What needs neither data nor the cluster was checked by the preflight
(:mod:`raylm.run.preflight`) before Ray started; what needs them (worker count against the
cluster, a checkpoint for another model or run, too small a validation split) is refused here,
before any worker starts. While the run goes, the driver only waits: the workers
(:mod:`raylm.workers.loop`) train and report, and the run's record (:mod:`raylm.run.record`,
on the Ray Train controller) writes what the run says about itself, to its end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import tempfile
from pathlib import Path
from typing import Any

import ray
from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from raylm import faults, rundir, storage
from raylm.config import Config, run_dir, storage_root
from raylm.console import (
    one_copy_of_worker_prints,
    quiet_libraries,
    quiet_model_io,
    train_log_level,
)
from raylm.contracts import EXPORT_INFO, LAYOUT, PREPARED_MANIFEST, SUMMARY, ExportInfo, Marker
from raylm.contracts.events import DeviceChosen, ResumedWithChanges, ScheduleMoved
from raylm.contracts.summary import LoggedModel, Summary
from raylm.data.preparation import prepared_dir
from raylm.data.tokenizer import load_backend
from raylm.formats.exporter import export, write_run_info
from raylm.model import lora
from raylm.model.spec import ModelSpec
from raylm.run import goodput, tracking
from raylm.run.benchmarks import Benchmarks
from raylm.run.group import ProcessGroup
from raylm.run.lease import Lease, LeaseError, hold
from raylm.run.objectives import objective_of
from raylm.run.preflight import Checked, preflight
from raylm.run.progress import Feed
from raylm.run.record import Ending, FinalModel, RunRecord, controller_callbacks
from raylm.run.reference import stored_reference
from raylm.run.resources import ResourcePlan, choose_device, plan_benchmarks, plan_resources
from raylm.schedule import EXTEND_CLEANLY, schedule_change
from raylm.workers.handoff import HANDOFF, Handoff
from raylm.workers.loop import train_loop_per_worker

# Ray Train's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by
# default): it takes one report per worker per poll, finds a dead worker at a poll, and ends a
# run the poll after the one that took its last report. raylm polls every 0.5 s, less often as
# the group grows (at most 128 workers a second; Ray's 2 s from 256 workers up), unless the
# variable is set. Measured (python -m raylm.bench startup, 2 workers, 2-core CPU): a run's
# end 1.9 s after its last step instead of 8.0, a dead worker found 0.2 s after its death
# instead of 3.4. The driver's variable reaches the controller (Ray Train passes it on).
POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
_poll_set: dict[str, str] = {}  # the value raylm set in this process, if any


def poll_interval(max_workers: int) -> float:
    """Seconds between the controller's polls of a group of at most ``max_workers``."""
    return min(2.0, max(0.5, max_workers / 128))


def set_poll_interval(max_workers: int) -> None:
    """The controller's poll for this run, unless the user set one (see :data:`POLL_ENV`)."""
    current = os.environ.get(POLL_ENV)
    if current is None or current == _poll_set.get("value"):
        _poll_set["value"] = os.environ[POLL_ENV] = f"{poll_interval(max_workers):g}"


def build_trainer(cfg: Config, prepared: str, *, vocab_size: int, eos_id: int,
                  record: RunRecord, resources: ResourcePlan, callbacks: list | None = None,
                  identity: dict[str, str] | None = None, reference: str | None = None,
                  lease: str | None = None, keeper: Any = None) -> TorchTrainer:
    """The run's TorchTrainer. ``identity``: what the run trains with, written into every
    checkpoint's marker (:func:`raylm.rundir.check_same_run`); ``reference``: the
    stored reference of a DPO full fine-tune (:mod:`raylm.run.reference`); ``lease``: the
    token of the run directory's lease the driver holds, which the workers check before each
    checkpoint (:mod:`raylm.run.lease`); ``keeper``: the owner of a GRPO run's generators
    (:mod:`raylm.rollout.keeper`)."""
    sc = cfg.scaling
    workers = tuple(sc.num_workers) if isinstance(sc.num_workers, list) else sc.num_workers
    set_poll_interval(sc.worker_range[1])
    return TorchTrainer(
        train_loop_per_worker,
        torch_config=ProcessGroup(backend="nccl" if sc.use_gpu else "gloo",
                                  timeout_s=int(cfg.train.collective_timeout_s)),
        train_loop_config={HANDOFF: Handoff(
            cfg=cfg, run_dir=run_dir(cfg), prepared=prepared, vocab_size=vocab_size,
            eos_id=eos_id, reader_resources=resources.reader,
            tracking=((record.tracker.uri, record.tracker.run_id)
                      if record.tracker and not record.tracker.lost else None),
            identity=identity or {}, reference=reference, lease=lease, keeper=keeper)},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=sc.use_gpu,
                                     resources_per_worker=resources.worker,
                                     elastic_resize_monitor_interval_s=sc.resize_interval_s),
        run_config=RunConfig(
            name=cfg.run.name,
            storage_path=storage_root(cfg),
            failure_config=FailureConfig(max_failures=cfg.train.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            callbacks=[*controller_callbacks(record, cfg), *(callbacks or [])],
            logging_config=LoggingConfig(log_level=train_log_level(cfg.run.verbose)),
        ),
    )


def train(cfg: Config, *, log=print, callbacks: list | None = None,
          tracking_parent: tracking.Tracker | None = None, bar: bool = False,
          checked: Checked | None = None, lease_owner: str | None = None) -> dict[str, Any]:
    """Prepare data if needed, fit, and finish ``RUN_DIR/summary.json``; return its mapping
    (:meth:`raylm.contracts.summary.Summary.to_dict`). Needs ``ray.init``.

    A sweep's trial adds Ray Train ``callbacks`` (its Tune reporter) and nests its MLflow run
    under the sweep's tracker (``tracking_parent``). ``bar``: progress as a bar drawn here
    (:mod:`raylm.run.progress`) instead of the controller's lines. ``checked``: the
    preflight of ``cfg``, when the caller ran it (:mod:`raylm.run.preflight`). The run's
    lease is held throughout (:mod:`raylm.run.lease`): a second live driver of the same run
    directory is refused, one held elsewhere watched for a renewal first."""
    checked = checked or preflight(cfg, tracked=tracking_parent is None)
    with hold(run_dir(checked.cfg), owner=lease_owner, log=log) as held:
        return _train(checked.cfg, log=log, callbacks=callbacks,
                      tracking_parent=tracking_parent, bar=bar, held=held).to_dict()


def _train(cfg: Config, *, log, callbacks: list | None, tracking_parent: tracking.Tracker | None,
           bar: bool, held: Lease) -> Summary:
    """:func:`train`, once the run is checked and its lease (``held``) held."""
    rd = run_dir(cfg)
    quiet_libraries(cfg.run.verbose)
    one_copy_of_worker_prints()
    capacity = ray.cluster_resources()
    cfg, device = choose_device(cfg, capacity)
    log(f"raylm: {device}")
    resources = plan_resources(cfg, None if cfg.scaling.wait_for_nodes else capacity)
    if resources.note:
        log(f"raylm: {resources.note}")
    note = plan_benchmarks(cfg, resources, None if cfg.scaling.wait_for_nodes else capacity)
    if note:
        log(f"raylm: {note}")
    prepared = prepared_dir(cfg, log=log)
    manifest = json.loads((prepared / PREPARED_MANIFEST).read_text())
    layout = json.loads((prepared / LAYOUT).read_text())
    backend, eos = load_backend(manifest["tokenizer_path"], cfg.model.path)
    vocab = backend.get_vocab_size()
    skipped = rundir.read_manifest(rd)
    if rundir.describe_manifest(skipped):
        log(f"raylm: {rundir.describe_manifest(skipped)}")
    rundir.check_ray_state(rd)
    found = rundir.latest_usable(rd, bad=skipped["bad_checkpoints"],
                                 warn=lambda m: log(f"warning: {m}"))
    done = finished(cfg, found)
    if done is not None:
        log(f"raylm: run {cfg.run.name!r} has trained its {done.final_step} steps already "
            f"(train.steps={cfg.train.steps}): nothing to do; raise train.steps to train on. "
            f"Summary: {storage.join(rd, SUMMARY)}")
        return end_left_running(cfg, rd, done, final_model_of(cfg, tracking_parent), log=log)
    identity = run_identity(cfg, manifest, backend)
    changed = check_same_run(cfg, found, identity, log=log)
    moved = check_resumable(cfg, found, vocab_size=vocab, eos_id=eos, log=log)
    max_workers = cfg.scaling.worker_range[1]
    val_blocks = layout["splits"]["val"]["blocks"]
    if val_blocks < max_workers:
        raise ValueError(f"the validation split has {val_blocks} blocks, fewer than the "
                         f"{max_workers} workers that evaluate it; raise data.val_fraction "
                         f"(now {cfg.data.val_fraction}) or use a larger corpus.")
    reference = stored_reference(cfg, prepared, identity=identity, resources=resources.worker,
                                 vocab_size=vocab, eos_id=eos, log=log)
    log(f"raylm: training {cfg.model.path or cfg.model.preset} on "
        f"{layout['splits']['train']['blocks']:,} blocks of {layout['seq_len']} tokens, run dir "
        f"{storage.redact(rd)}")
    write_run_info(rd, config=cfg.to_dict(), vocab_size=vocab, eos_id=eos,
                   tokenizer_path=manifest["tokenizer_path"], prepared=str(prepared))
    tracker = tracking.start(cfg, log=log, parent=tracking_parent)
    tracker.log_dataset(manifest, str(prepared))
    feed = Feed(cfg.train.steps) if bar else None
    ending = Ending(row_group_sizes=layout["splits"]["train"]["row_group_sizes"],
                    seed=cfg.train.seed, window=cfg.data.shuffle_window,
                    skip_positions=cfg.train.skip_positions,
                    final_model=final_model_of(cfg, tracking_parent))
    record = RunRecord(rd, total_steps=cfg.train.steps, tracker=tracker,
                       verbose=cfg.run.verbose, progress=feed and feed.queue, ending=ending,
                       lease=held.token, benchmarks=Benchmarks(
                           rd, cfg.eval, checkpoint_every=cfg.checkpoint.every,
                           total_steps=cfg.train.steps) if cfg.eval.tasks else None,
                       objective=objective_of(cfg))
    # A sweep trial's reporter hears each benchmark's scores (raylm.run.sweep).
    record.listeners += [c for c in callbacks or () if hasattr(c, "scored")]
    record.note(DeviceChosen(gpu=cfg.scaling.use_gpu, reason=device))
    if moved is not None:
        record.note(moved)
    if changed:
        record.note(ResumedWithChanges(changed=changed))
    try:
        error = fit(cfg, str(prepared), vocab_size=vocab, eos_id=eos, record=record,
                    resources=resources, callbacks=callbacks, identity=identity,
                    reference=reference, lease=held.token)
    finally:
        if feed is not None:
            feed.close()
    if held.lost.is_set() or faults.cause(error, faults.LeaseLost):
        tracker.finish(failed=True)
        raise LeaseError(f"run {cfg.run.name!r} stopped: its driver lost the lease on "
                         f"{storage.redact(rd)} to another process, which now drives the run "
                         f"(see {storage.redact(held.path)})")
    # The record finished summary.json (and the MLflow run, unless the final model is logged
    # next) on the controller as the run ended; this reads it.
    summary = record.final_summary()
    if summary is None:  # the controller itself was lost
        tracker.finish(failed=True)
        if error is not None:
            raise error
        raise RuntimeError(f"the Ray Train controller of run {cfg.run.name!r} ended without "
                           f"finishing its record; see its log")
    if error is None and ending.final_model is not None and tracker:
        summary = end_tracked_run(rd, summary, tracker, ending.final_model, log=log)
    say_how_it_ended(cfg, summary, error=error, tracker=tracker, log=log,
                     trial=tracking_parent is not None)
    return summary


def fit(cfg: Config, prepared: str, **trainer: Any) -> Exception | None:
    """Fit the run's trainer (:func:`build_trainer`'s arguments); return what ended it, if
    anything did (Ray Train raises once max_failures is used up). The objective's keeper
    (GRPO's generators) is made here first, so that what it owns outlives the group's
    restarts, and ended after."""
    keeper = objective_of(cfg).keeper(cfg)
    try:
        build_trainer(cfg, prepared, keeper=keeper, **trainer).fit()
    except Exception as e:
        return e
    finally:
        if keeper is not None:
            ray.kill(keeper)
    return None


def final_model_of(cfg: Config, tracking_parent: tracking.Tracker | None) -> FinalModel | None:
    """What the run logs to MLflow as its model when it ends (a sweep's trials: nothing)."""
    if not cfg.tracking.log_model or tracking_parent is not None:
        return None
    return FinalModel(adapter=bool(cfg.lora.rank), run_name=cfg.run.name,
                      register_as=cfg.tracking.register_as)


def end_left_running(cfg: Config, rd: str, summary: Summary, final: FinalModel | None, *,
                     log=print) -> Summary:
    """A finished run whose command ended (killed) after the record's end and before its final
    model reached MLflow leaves the MLflow run RUNNING, without the model: running it again
    logs the model and ends the MLflow run, as that command would have."""
    if (final is None or not cfg.tracking.enabled or summary.logged_model is not None
            or summary.tracking_lost or not tracking.left_running(cfg, summary.mlflow_run_id)):
        return summary
    log("raylm: the run's final model never reached MLflow (the command that trained it "
        "ended first): logging it now")
    tracker = tracking.start(cfg, log=log)
    return end_tracked_run(rd, summary, tracker, final, log=log) if tracker else summary


def end_tracked_run(rd: str, summary: Summary, tracker: tracking.Tracker,
                    final: FinalModel, *, log=print) -> Summary:
    """A finished run's final model logged to MLflow (see :func:`log_final_model`), its URI
    added to summary.json, and then the MLflow run ended. Here, on the driver, rather than on
    the controller as the run ends: the driver has torch and transformers loaded already (the
    preflight built the model), which the controller imported for this alone (the command
    ended 1.0 to 1.7 s later after a tracked tiny run here)."""
    if summary.tracking_lost:  # the store went away during the run: left alone
        return summary
    try:
        if summary.finished:
            model = log_final_model(rd, tracker, final, log=log)
            if model is not None:
                summary = dataclasses.replace(summary, logged_model=model)
                rundir.write_summary(rd, summary)
                tracker.log_run_files(rd, (SUMMARY,))
    finally:
        tracker.finish(failed=not summary.finished)
    return summary


def log_final_model(run_dir: str, tracker: tracking.Tracker, final: FinalModel, *, log=print
                    ) -> LoggedModel | None:
    """The run's final checkpoint, exported (a LoRA run's adapter, or the full model), logged
    to MLflow as the run's model and, with ``register_as``, registered."""
    with (tempfile.TemporaryDirectory(prefix="raylm-final-model-") as tmp,
          quiet_model_io()):
        try:
            exported = export(run_dir, Path(tmp) / "model", log=log)
        except Exception as e:  # the run trained; only its copy for MLflow is missing
            log(f"raylm: warning: the final model was not logged to MLflow: it could not be "
                f"exported ({type(e).__name__}: {e}); `raylm export {run_dir}` says why")
            return None
        step = ExportInfo.read(exported).step
        model = tracker.log_model(
            exported, adapter=final.adapter, step=step,
            name="adapter" if final.adapter else "model",
            description=f"raylm run {final.run_name!r} ({run_dir}) at step {step}",
            register_as=final.register_as)
    if model is not None:
        registered = (f", registered as {model.registered_model} version "
                      f"{model.registered_version}" if model.registered_model else "")
        log(f"raylm: final model logged to MLflow as {model.mlflow_model_uri}{registered}")
    return model


def reference_before_trials(cfg: Config, prepared: str, *, log=print) -> None:
    """A sweep's stored DPO reference (:mod:`raylm.run.reference`), scored once by its driver
    so that trials running at once do not each score it; they read it."""
    if not objective_of(cfg).needs_stored_reference(cfg):
        return
    manifest = json.loads((Path(prepared) / PREPARED_MANIFEST).read_text())
    backend, eos = load_backend(manifest["tokenizer_path"], cfg.model.path)
    stored_reference(cfg, prepared, identity=run_identity(cfg, manifest, backend),
                     resources=plan_resources(cfg, None).worker,
                     vocab_size=backend.get_vocab_size(), eos_id=eos, log=log)


def say_how_it_ended(cfg: Config, summary: Summary, *, error: Exception | None,
                     tracker: tracking.Tracker, log, trial: bool = False) -> None:
    """The run's last lines; raise what ended it (a mistake in one line, not retried)."""
    rd = run_dir(cfg)
    summary_path = storage.join(rd, SUMMARY)
    mistake = faults.cause(error) if error is not None else None
    if summary.goodput:
        log(f"raylm: {goodput.describe(summary.goodput)}")
    if mistake is not None:
        log(f"raylm: stopped at step {summary.final_step}, not retried: the run's input is "
            f"wrong, no machine failed. Summary: {summary_path}")
        raise mistake from None
    if error is not None:
        log(f"raylm: failed at step {summary.final_step} after {summary.failures} "
            f"failures; the latest checkpoint is {summary.checkpoint_path}; run again with "
            f"the same run.name to resume. Summary: {summary_path}")
        raise error
    outcome = (f"raylm: done: step {summary.final_step}, {objective_of(cfg).outcome(summary)}, "
               f"{summary.restarts} restarts, {summary.resizes} resizes")
    if trial:  # one line of many in a sweep's console; the sweep ends with its own lines
        log(f"{outcome}, summary {summary_path}")
        return
    log(outcome)
    log(f"raylm: checkpoint {summary.checkpoint_path}")
    log(f"raylm: summary {summary_path} (raylm train --json prints it too)")
    if summary.tracking_lost:
        log(f"raylm: MLflow run {tracker.run_id} ({storage.redact(tracker.uri)}) holds the run "
            f"up to step {summary.tracking_lost.step}, where tracking was lost; the run's "
            f"own record in {storage.redact(rd)} has all of it")
    elif tracker:
        uri = storage.redact(tracker.uri)
        log(f"raylm: MLflow run {tracker.run_id} ({uri}); browse with: mlflow ui "
            f"--backend-store-uri {uri}")
    log(f"raylm: next: {next_commands(cfg, rd)}")


def next_commands(cfg: Config, rd: str) -> str:
    """What a person tries after a run: sample from it, then export it for other tools (a
    LoRA run merged, which plain transformers loads)."""
    try:  # runs/NAME, as a person types it from where the run began
        if not storage.is_uri(rd) and Path(rd).resolve().is_relative_to(Path.cwd()):
            rd = os.path.relpath(rd)
    except OSError:  # the working directory is gone (a job's, removed as it ended)
        pass
    here = shlex.quote(rd)
    ask = '--chat "Hello"' if cfg.data.format == "chat" else '--prompt "The"'
    out = shlex.quote(f"{storage.name(rd) if storage.is_uri(rd) else rd}-hf")
    merge = " --merge" if cfg.lora.rank else ""
    return f"raylm generate {here} {ask}, or raylm export {here} --output {out}{merge}"


def finished(cfg: Config, found: tuple[str, Marker] | None) -> Summary | None:
    """The summary of a run that finished at or beyond ``train.steps`` (``found``: its latest
    verified checkpoint), or None. Running such a run again (a notebook cell run twice)
    returns it instead of starting a worker group that would train nothing and overwrite the
    summary with an empty one."""
    summary = rundir.read_summary(run_dir(cfg)) if found is not None else None
    if (summary is None or not summary.finished or found[1].step < cfg.train.steps
            or summary.final_step != found[1].step):
        return None
    return summary


def run_identity(cfg: Config, manifest: dict[str, Any], backend) -> dict[str, str]:
    """What makes a run the same run across invocations: its prepared data (the corpus's
    content and the preparation settings), data format, tokenizer (its whole definition, so a
    retrained tokenizer of the same size differs) and base model (its config and weight
    files)."""
    # data_identity: the blocks' samples, whatever the blocks keep beside them (a prompt set's
    # rows): a run prepared before the rows were kept resumes on the same samples.
    return {"data": manifest.get("data_identity", manifest["fingerprint"]),
            "format": cfg.data.format,
            "tokenizer": hashlib.blake2b(backend.to_str().encode(), digest_size=12).hexdigest(),
            "base_model": base_model_identity(cfg)}


# The format of :func:`base_model_identity`'s value, its prefix: a checkpoint recorded with an
# identity of another format is not compared on that part (it cannot be).
BASE_IDENTITY_FORMAT = "v3"
# Each safetensors file: its header (every tensor's name, dtype, shape and place) and the first
# and last 4 KiB of every tensor, which any change of a whole tensor (a layer tuned in place, a
# re-export) changes: ~8 KiB per tensor, where hashing a 7B model's 15 GB would cost every
# start minutes. Other weight files: the first MiB and 16 spans of 64 KiB over the rest. A few
# bytes edited inside a tensor go unseen (the marker's hashes are for accidents, and who can
# write a model directory is trusted with it: docs/fault-tolerance.md).
_HEAD, _SPANS, _SPAN, _END = 1 << 20, 16, 1 << 16, 1 << 12


def _sampled(file: Path) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        try:  # a safetensors header is at most 100 MB
            header = json.loads(f.read(n)) if file.suffix == ".safetensors" and n < 1e8 else {}
            spans = [(8 + n + x, _END) for k, v in header.items() if k != "__metadata__"
                     for a, b in [v["data_offsets"]] for x in (int(a), int(b) - _END)]
        except (ValueError, TypeError, KeyError, AttributeError):
            spans = []
        size = file.stat().st_size
        for at, length in [(0, 8 + n), *spans] if spans else [(0, _HEAD)] + [
                (_HEAD + (size - _HEAD - _SPAN) * i // (_SPANS - 1), _SPAN)
                for i in range(_SPANS) if size > _HEAD + _SPAN]:
            f.seek(max(0, at))
            h.update(f.read(length))
    return h.digest()


def base_model_identity(cfg: Config) -> str:
    """The base model's part of :func:`run_identity`: the preset's name, or its directory's
    config, each weight file's name, size and sampled content, raylm's export marker (run and
    step) and a hub snapshot's commit."""
    if not cfg.model.path:
        return f"preset:{cfg.model.preset}"
    path = Path(cfg.model.path)
    h = hashlib.blake2b(digest_size=12)
    h.update((path / "config.json").read_bytes())
    for f in sorted(f for f in path.iterdir() if f.suffix in (".safetensors", ".bin")):
        h.update(json.dumps([f.name, f.stat().st_size]).encode())
        h.update(_sampled(f))
    if (path / EXPORT_INFO).is_file():
        h.update((path / EXPORT_INFO).read_bytes())
    if path.parent.name == "snapshots":  # the hub cache names a snapshot by its commit
        h.update(path.name.encode())
    return f"{BASE_IDENTITY_FORMAT}:{h.hexdigest()}"


def check_same_run(cfg: Config, found: tuple[str, Marker] | None, identity: dict[str, str], *,
                   log) -> list[str]:
    """A resume continues the same run: refused in one line when the checkpoint was trained
    with other data, tokenizer or base model, unless ``checkpoint.accept_changes`` allows it
    (then said, and returned for the record)."""
    if found is None:
        return []
    changed = rundir.check_same_run(found[1], identity, str(found[0]),
                                    accept=cfg.checkpoint.accept_changes)
    if changed:
        log(f"raylm: warning: resuming {found[0]} with changed "
            f"{', '.join(rundir.IDENTITY[k] for k in changed)} "
            f"(checkpoint.accept_changes={cfg.checkpoint.accept_changes})")
    return changed


def check_resumable(cfg: Config, found: tuple[str, Marker] | None, *, vocab_size: int,
                    eos_id: int, log) -> ScheduleMoved | None:
    """A checkpoint the workers would resume from must be for this model: refused here, in one
    line, rather than on every worker. (The workers' restored train state, not this look,
    decides where the run continues.) Returns how the current settings move the learning-rate
    schedule of the run, if they do, having said so. ``found``: the run's latest verified
    checkpoint."""
    if found is None:
        return None
    model_cfg = ModelSpec.from_config(cfg, vocab_size=vocab_size,
                                      eos_id=eos_id).transformers_config()
    rundir.check_compatible(found[1], model_cfg, str(found[0]), lora.settings(cfg.lora))
    log(f"raylm: run {cfg.run.name!r} exists; resuming from step {found[1].step} "
        f"of {cfg.train.steps} ({found[0]})")
    o = cfg.optim
    change = schedule_change(found[1].state, o, total=cfg.train.steps)
    if change is not None:
        nxt = "" if change.lr_next is None else f", and {change.lr_next:.3e} next"
        log(f"raylm: warning: the learning-rate schedule moved: step {change.step} trained "
            f"at lr {change.lr_trained:.3e}, where the current settings (optim.schedule="
            f"{o.schedule}, train.steps={cfg.train.steps}) give {change.lr_now:.3e}{nxt}. "
            f"Extending train.steps moves every schedule shaped by it; "
            f"{' and '.join(EXTEND_CLEANLY)} (before its decay) extend cleanly.")
    return change
