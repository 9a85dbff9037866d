"""Build and run the TorchTrainer for a config: the driver side of ``raylm train``.

Everything that can be wrong with the request (batch arithmetic, sequence length, worker count
against the cluster) is checked here, on the driver, before any worker starts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from raylm.config import Config, run_dir

try:  # the controller-side callback base class (Ray Train V2)
    from ray.train.v2.api.callback import UserCallback
except ImportError:  # pragma: no cover - Ray without Train V2
    UserCallback = object

EVENTS = "events.jsonl"


class ProgressCallback(UserCallback):
    """Runs on the Ray Train controller: one progress line per report, and a record of every
    worker-group failure in ``RUN_DIR/events.jsonl``."""

    def __init__(self, run_dir: str, total_steps: int) -> None:
        self.run_dir = run_dir
        self.total_steps = total_steps

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        m = metrics[0]
        step = m["step"]
        rate = m["elapsed_s"] / max(1, step - (m.get("resumed_from_step") or 0))
        eta = rate * (self.total_steps - step)
        line = (f"step {step}/{self.total_steps}  loss {m['loss']:.4f}  "
                f"lr {m['lr']:.2e}  {m['tokens_per_s']:,.0f} tok/s  "
                f"data wait {100 * m['data_wait_fraction']:.1f}%  ETA {eta:.0f}s")
        if "val_loss" in m:
            line += f"  val {m['val_loss']:.4f}"
        if checkpoint is not None:
            line += f"  checkpoint {checkpoint.path}"
        print(line, flush=True)

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        event = {"event": "worker_failure", "time": time.time(),
                 "ranks": sorted(worker_exceptions),
                 "error": repr(next(iter(worker_exceptions.values())))[:500]}
        path = Path(self.run_dir)
        path.mkdir(parents=True, exist_ok=True)
        with open(path / EVENTS, "a") as f:
            f.write(json.dumps(event) + "\n")


def cluster_capacity() -> dict[str, float]:
    import ray

    return ray.cluster_resources()


def check_request(cfg: Config, *, max_positions: int) -> None:
    """Refuse impossible runs before workers start."""
    from raylm.train import accumulation_steps

    sc, t = cfg.scaling, cfg.train
    max_workers = sc.num_workers[1] if isinstance(sc.num_workers, list) else sc.num_workers
    min_workers = sc.num_workers[0] if isinstance(sc.num_workers, list) else sc.num_workers
    accumulation_steps(t.global_batch_size, t.micro_batch_size, max_workers)
    accumulation_steps(t.global_batch_size, t.micro_batch_size, min_workers)
    if cfg.data.seq_len > max_positions:
        raise ValueError(f"data.seq_len={cfg.data.seq_len} is above the model's "
                         f"{max_positions} positions; lower data.seq_len or choose a model "
                         f"with more positions.")
    have = cluster_capacity()
    if sc.use_gpu:
        gpus = have.get("GPU", 0)
        if min_workers > gpus:
            raise ValueError(f"scaling.num_workers={sc.num_workers} needs {min_workers} GPUs but "
                             f"the cluster has {gpus:g}; lower scaling.num_workers or add GPU "
                             f"nodes.")
    else:
        cpus = have.get("CPU", 0)
        need = min_workers * sc.cpus_per_worker
        if need > cpus:
            raise ValueError(f"scaling.num_workers={sc.num_workers} x scaling.cpus_per_worker="
                             f"{sc.cpus_per_worker:g} needs {need:g} CPUs but the cluster has "
                             f"{cpus:g}; lower one of them.")


def build_trainer(cfg: Config, prepared: str | Path, *, vocab_size: int, eos_id: int,
                  mlflow_run_id: str | None = None, mlflow_tracking_uri: str | None = None):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raylm import checkpoint
    from raylm.data import build_data_config, trainer_datasets
    from raylm.tracking import MLflowCallback
    from raylm.train import train_loop_per_worker

    sc, t = cfg.scaling, cfg.train
    rd = str(run_dir(cfg))
    workers = tuple(sc.num_workers) if isinstance(sc.num_workers, list) else sc.num_workers
    resources = {"CPU": sc.cpus_per_worker}
    if sc.use_gpu:
        resources["GPU"] = 1

    def start_step() -> int:
        # Evaluated each time a worker group starts: the same checkpoint the workers load.
        found = checkpoint.latest_verified(rd)
        return int(found[1]["state"]["step"]) if found else 0

    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": cfg.to_dict(), "run_dir": rd, "vocab_size": vocab_size,
                           "eos_id": eos_id, "mlflow_run_id": mlflow_run_id,
                           "mlflow_tracking_uri": mlflow_tracking_uri},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=sc.use_gpu,
                                     resources_per_worker=resources),
        run_config=RunConfig(
            name=cfg.run.name,
            storage_path=str(Path(rd).parent),
            failure_config=FailureConfig(max_failures=t.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            callbacks=[ProgressCallback(rd, t.steps)] + (
                [MLflowCallback(mlflow_run_id, mlflow_tracking_uri)] if mlflow_run_id else []),
        ),
        datasets=trainer_datasets(prepared, with_val=True),
        dataset_config=build_data_config(
            prepared, seed=t.seed, window=cfg.data.shuffle_window,
            global_batch=t.global_batch_size, num_steps=t.steps,
            eval_samples=t.eval_batches * t.micro_batch_size, start_step=start_step),
    )


def train(cfg: Config, *, log=print) -> dict[str, Any]:
    """Prepare data if needed, fit, and write ``RUN_DIR/summary.json``. Needs ``ray.init``."""
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
    max_workers = (cfg.scaling.num_workers[1] if isinstance(cfg.scaling.num_workers, list)
                   else cfg.scaling.num_workers)
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
    run_id, uri = tracking.start_run(cfg, log=log)
    if run_id:
        log(f"raylm: MLflow run {run_id} at {uri}")
    t0 = time.time()
    failed = True
    try:
        result = build_trainer(cfg, prepared, vocab_size=vocab, eos_id=eos,
                               mlflow_run_id=run_id, mlflow_tracking_uri=uri).fit()
        failed = result.error is not None
    finally:
        tracking.finish_run(run_id, uri, failed=failed)
    wall = time.time() - t0
    m = result.metrics or {}
    final = checkpoint.latest_verified(rd)
    restarts = 0
    if (rd / EVENTS).is_file():
        restarts = sum(1 for line in (rd / EVENTS).read_text().splitlines() if line.strip())
    summary = {
        "final_step": m.get("step"),
        "train_loss": m.get("loss"),
        "val_loss": m.get("val_loss"),
        "tokens_per_s": m.get("tokens_per_s"),
        "mfu": m.get("mfu"),
        "data_wait_fraction": m.get("data_wait_fraction_run"),
        "wall_s": round(wall, 2),
        "checkpoint_path": str(final[0]) if final else None,
        "mlflow_run_id": run_id,
        "mlflow_tracking_uri": uri,
        "resumed_from_step": m.get("resumed_from_step"),
        "restarts": restarts,
        "attention_backend": m.get("attention_backend"),
        "precision": m.get("precision"),
    }
    rd.mkdir(parents=True, exist_ok=True)
    (rd / "summary.json").write_text(json.dumps(summary, indent=2))
    log(f"raylm: done: step {summary['final_step']}, val loss {summary['val_loss']}, "
        f"checkpoint {summary['checkpoint_path']}, summary {rd / 'summary.json'}")
    if run_id:
        log(f"raylm: MLflow run {run_id} ({uri}); browse with: mlflow ui --backend-store-uri "
            f"{uri}")
    return summary
