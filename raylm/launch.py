"""Build and run the TorchTrainer for a config: the driver side of ``raylm train``.

Everything that can be wrong with the request (batch arithmetic, sequence length, worker count
against the cluster) is checked here, on the driver, before any worker starts.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raylm import events, ledger, storage
from raylm.config import Config, run_dir, storage_root

try:  # the controller-side callback base class (Ray Train V2)
    from ray.train.v2.api.callback import UserCallback
except ImportError:  # pragma: no cover - Ray without Train V2
    UserCallback = object

class ProgressCallback(UserCallback):
    """Runs on the Ray Train controller: one progress line per report, and the ``failure``
    and ``progress`` records of ``RUN_DIR/events.jsonl``. When a report is the first of a new
    worker group it prints the restart or resize and passes all records to ``on_event``."""

    def __init__(self, run_dir: str, total_steps: int, *, invocation: str,
                 on_event: Callable[[list[dict[str, Any]], int], None] | None = None) -> None:
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.invocation = invocation
        self.on_event = on_event
        self.known = 0  # interruptions already announced
        self.records: list[dict[str, Any]] = []  # this invocation's, read so far
        self.offset = 0  # bytes of events.jsonl read so far
        self.unsettled = 0  # records from here on may change the interruptions

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        self._safely(self._report, metrics[0], checkpoint)

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        self._safely(self._failure, worker_exceptions)

    def _safely(self, fn, *args) -> None:
        # An exception in a controller callback ends the whole run; the progress log and the
        # event records are not worth that.
        try:
            fn(*args)
        except Exception as e:
            print(f"warning: raylm progress callback: {type(e).__name__}: {e}", flush=True)

    def _report(self, m: dict[str, Any], checkpoint) -> None:
        step = m["step"]
        step_time = m["elapsed_s"] / max(1, step - (m.get("resumed_from_step") or 0))
        events.append(self.run_dir, self.invocation, "progress", step=step,
                      step_time=step_time)
        self._read_new()
        if any(r["event"] != "progress" for r in self.records[self.unsettled:]):
            self._announce(step)
        line = (f"step {step}/{self.total_steps}  loss {m['loss']:.4f}  "
                f"lr {m['lr']:.2e}  {m['tokens_per_s']:,.0f} tok/s  "
                f"data wait {100 * m['data_wait_fraction']:.1f}%  "
                f"ETA {step_time * (self.total_steps - step):.0f}s")
        if "val_loss" in m:
            line += f"  val {m['val_loss']:.4f}"
        if checkpoint is not None:
            line += f"  checkpoint {checkpoint.path}"
        print(line, flush=True)

    def _failure(self, worker_exceptions: dict[int, Exception]) -> None:
        error = next(iter(worker_exceptions.values()))
        text = str(error).strip().splitlines()
        events.append(self.run_dir, self.invocation, "failure",
                      ranks=sorted(worker_exceptions),
                      error=f"{type(error).__name__}: {text[0] if text else ''}"[:300])

    def _announce(self, step: int) -> None:
        found = events.interruptions(self.records)
        # The last one is still open until its group reports (an earlier one whose group
        # never reported is final, its time lost unknown).
        done = found[:-1] if found and found[-1]["time_lost_s"] is None else found
        for e in done[self.known:]:
            lost = "unknown" if e["time_lost_s"] is None else f"{e['time_lost_s']:.1f}s"
            print(f"raylm: {e['event']} {e['from_workers']} -> {e['to_workers']} workers, "
                  f"resumed from step {e['resumed_from_step']} (last report at step "
                  f"{e['at_step']}), time lost {lost}", flush=True)
        if len(done) > self.known and self.on_event is not None:
            self.on_event(events.read(self.run_dir), step)
        self.known = len(done)
        if len(done) == len(found):  # nothing waits for a group's first report
            self.unsettled = len(self.records)

    def _read_new(self) -> None:
        # Group starts are appended by another process; read only what is new, so a long
        # run does not parse its whole log at every report.
        chunk = storage.read_bytes(storage.join(self.run_dir, events.EVENTS), self.offset)
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode().splitlines():
            record = json.loads(line) if line.strip() else None
            if record is not None and record["invocation"] == self.invocation:
                self.records.append(record)


def cluster_capacity() -> dict[str, float]:
    import ray

    return ray.cluster_resources()


def check_request(cfg: Config, *, max_positions: int) -> None:
    """Refuse impossible runs before workers start."""
    sc, t = cfg.scaling, cfg.train
    min_workers, max_workers = sc.worker_range
    counts = range(min_workers, max_workers + 1)
    bad = [n for n in counts if t.global_batch_size % n]
    if bad:
        fits = math.lcm(*counts)
        raise ValueError(
            f"train.global_batch_size={t.global_batch_size} cannot be split equally over "
            f"{', '.join(map(str, bad))} workers, which scaling.num_workers={sc.num_workers} "
            f"allows; every worker count in the range must divide the global batch (for "
            f"example train.global_batch_size={fits * max(1, round(t.global_batch_size / fits))}"
            f"), or narrow the range.")
    if cfg.data.seq_len > max_positions:
        raise ValueError(f"data.seq_len={cfg.data.seq_len} is above the model's "
                         f"{max_positions} positions; lower data.seq_len or choose a model "
                         f"with more positions.")
    if sc.wait_for_nodes:
        return
    have = cluster_capacity()
    if sc.use_gpu:
        gpus = have.get("GPU", 0)
        if min_workers > gpus:
            raise ValueError(f"scaling.num_workers={sc.num_workers} needs {min_workers} GPUs but "
                             f"the cluster has {gpus:g}; lower scaling.num_workers, add GPU "
                             f"nodes, or set scaling.wait_for_nodes=true if the cluster "
                             f"autoscales.")
    else:
        cpus = have.get("CPU", 0)
        need = min_workers * sc.cpus_per_worker
        if need > cpus:
            raise ValueError(f"scaling.num_workers={sc.num_workers} x scaling.cpus_per_worker="
                             f"{sc.cpus_per_worker:g} needs {need:g} CPUs but the cluster has "
                             f"{cpus:g}; lower one of them, or set scaling.wait_for_nodes=true "
                             f"if the cluster autoscales.")


def build_trainer(cfg: Config, prepared: str | Path, *, vocab_size: int, eos_id: int,
                  invocation: str, mlflow_run_id: str | None = None,
                  mlflow_tracking_uri: str | None = None, callbacks: list | None = None):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raylm import checkpoint
    from raylm.data import build_data_config, trainer_datasets
    from raylm.tracking import MLflowCallback, log_events
    from raylm.train import train_loop_per_worker

    sc, t = cfg.scaling, cfg.train
    rd = run_dir(cfg)
    workers = tuple(sc.num_workers) if isinstance(sc.num_workers, list) else sc.num_workers
    resources = {"CPU": sc.cpus_per_worker, **sc.worker_resources}
    if sc.use_gpu:
        resources["GPU"] = 1

    def start_step(world_size: int) -> int:
        # Evaluated once per worker group, when it asks for its data: the checkpoint the
        # workers load. Recorded, as it is the one moment the driver side learns of a group.
        found = checkpoint.latest_verified(rd)
        step = int(found[1]["state"]["step"]) if found else 0
        events.append(rd, invocation, "group_start", workers=world_size, from_step=step)
        return step

    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": cfg.to_dict(), "run_dir": rd, "vocab_size": vocab_size,
                           "eos_id": eos_id, "mlflow_run_id": mlflow_run_id,
                           "mlflow_tracking_uri": mlflow_tracking_uri},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=sc.use_gpu,
                                     resources_per_worker=resources,
                                     elastic_resize_monitor_interval_s=sc.resize_interval_s),
        run_config=RunConfig(
            name=cfg.run.name,
            storage_path=storage_root(cfg),
            failure_config=FailureConfig(max_failures=t.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            callbacks=[ProgressCallback(
                rd, t.steps, invocation=invocation,
                on_event=(functools.partial(log_events, mlflow_run_id, mlflow_tracking_uri)
                          if mlflow_run_id else None))] + (
                [MLflowCallback(mlflow_run_id, mlflow_tracking_uri)] if mlflow_run_id else []
            ) + list(callbacks or []),
        ),
        datasets=trainer_datasets(prepared, with_val=True),
        dataset_config=build_data_config(
            prepared, seed=t.seed, window=cfg.data.shuffle_window,
            global_batch=t.global_batch_size, num_steps=t.steps,
            eval_samples=t.eval_batches * t.micro_batch_size, start_step=start_step,
            resources=sc.data_resources),
    )


def train(cfg: Config, *, log=print, callbacks: list | None = None,
          mlflow_parent: tuple[str, str] | None = None) -> dict[str, Any]:
    """Prepare data if needed, fit, and write ``RUN_DIR/summary.json``. Needs ``ray.init``.

    A sweep's trial adds Ray Train ``callbacks`` (its Tune reporter) and nests its MLflow run
    under ``mlflow_parent`` (run id, tracking uri)."""
    from raylm import checkpoint, tracking
    from raylm.data import LAYOUT, prepared_dir
    from raylm.export import write_run_info
    from raylm.model import build_config, max_positions
    from raylm.tokenizer import load_backend

    rd = run_dir(cfg)
    # The vocabulary is not known before the data is prepared, and no check needs it.
    provisional = build_config(preset=cfg.model.preset, path=cfg.model.path, vocab_size=1,
                               eos_id=0, attn_implementation="sdpa")
    check_request(cfg, max_positions=max_positions(provisional))
    if cfg.tracking.enabled and mlflow_parent is None:
        tracking.resolve_uri(cfg)  # a store that cannot exist fails now, not after the data
    prepared = prepared_dir(cfg, log=log)
    manifest = json.loads((prepared / "manifest.json").read_text())
    layout = json.loads((prepared / LAYOUT).read_text())
    backend, eos = load_backend(manifest["tokenizer_path"])
    vocab = backend.get_vocab_size()
    model_cfg = build_config(preset=cfg.model.preset, path=cfg.model.path, vocab_size=vocab,
                             eos_id=eos, attn_implementation="sdpa")
    found = checkpoint.latest_verified(rd, warn=lambda m: log(f"warning: {m}"))
    if found is not None:
        checkpoint.check_compatible(found[1], model_cfg, str(found[0]))
        log(f"raylm: run {cfg.run.name!r} exists; resuming from step "
            f"{found[1]['state']['step']} of {cfg.train.steps} ({found[0]})")
    max_workers = cfg.scaling.worker_range[1]
    val_blocks = layout["splits"]["val"]["blocks"]
    if val_blocks < max_workers:
        raise ValueError(f"the validation split has {val_blocks} blocks, fewer than the "
                         f"{max_workers} workers that evaluate it; raise data.val_fraction "
                         f"(now {cfg.data.val_fraction}) or use a larger corpus.")
    blocks = layout["splits"]["train"]["blocks"]
    log(f"raylm: training {cfg.model.path or cfg.model.preset} on {blocks:,} blocks of "
        f"{layout['seq_len']} tokens, run dir {rd}")
    write_run_info(rd, config=cfg.to_dict(), vocab_size=vocab, eos_id=eos,
                   tokenizer_path=manifest["tokenizer_path"])
    run_id, uri = tracking.start_run(
        cfg, log=log, parent_run_id=mlflow_parent[0] if mlflow_parent else None,
        uri=mlflow_parent[1] if mlflow_parent else None)
    if run_id:
        log(f"raylm: MLflow run {run_id} at {uri}")
    invocation = f"{time.time():.6f}"
    t0 = time.time()
    error = None
    try:
        result = build_trainer(cfg, prepared, vocab_size=vocab, eos_id=eos,
                               invocation=invocation, mlflow_run_id=run_id,
                               mlflow_tracking_uri=uri, callbacks=callbacks).fit()
        m = result.metrics or {}
    except Exception as e:  # Ray Train raises once max_failures is used up
        error, m = e, {}
    finally:
        tracking.finish_run(run_id, uri, failed=error is not None)
    wall = time.time() - t0
    final = checkpoint.latest_verified(rd)
    records = events.read(rd, invocation)
    start = next((r for r in records if r["event"] == "group_start"), None)
    final_step = m.get("step") or (final[1]["state"]["step"] if final else None)
    summary = {
        "status": "failed" if error is not None else "finished",
        "final_step": final_step,
        "train_loss": m.get("loss"),
        "val_loss": m.get("val_loss"),
        "tokens_per_s": m.get("tokens_per_s"),
        "mfu": m.get("mfu"),
        "data_wait_fraction": m.get("data_wait_fraction_run"),
        "wall_s": round(wall, 2),
        "checkpoint_path": str(final[0]) if final else None,
        "mlflow_run_id": run_id,
        "mlflow_tracking_uri": uri,
        "resumed_from_step": (start["from_step"] or None) if start else None,
        "workers": m.get("workers"),
        **events.summarize(records),
        "samples": None,
        "attention_backend": m.get("attention_backend"),
        "precision": m.get("precision"),
    }
    rows = checkpoint.load_samples(final[0]) if final else None
    if rows is not None:
        summary["samples"] = ledger.account(
            rows, group_sizes=layout["splits"]["train"]["row_group_sizes"],
            seed=cfg.train.seed, window=cfg.data.shuffle_window)
    summary_path = storage.join(rd, "summary.json")
    storage.write_text(summary_path, json.dumps(summary, indent=2))
    if error is not None:
        log(f"raylm: failed at step {final_step} after {summary['failures']} failures; the "
            f"latest checkpoint is {summary['checkpoint_path']}; run again with the same "
            f"run.name to resume. Summary: {summary_path}")
        raise error
    log(f"raylm: done: step {summary['final_step']}, val loss {summary['val_loss']}, "
        f"{summary['restarts']} restarts, {summary['resizes']} resizes, checkpoint "
        f"{summary['checkpoint_path']}, summary {summary_path}")
    if run_id:
        log(f"raylm: MLflow run {run_id} ({uri}); browse with: mlflow ui --backend-store-uri "
            f"{uri}")
    return summary
