"""The training step and loop: the only place model, data, optimizer and checkpoints meet.

The core (``build_training_model``, ``train_step``, ``evaluate``) needs only torch and
transformers: it runs in one process, under torchrun, or inside Ray Train's workers.

Loss arithmetic: every block holds exactly ``seq_len`` targets (no padding), so each
micro-batch's mean cross-entropy divided by the accumulation steps, summed over micro-batches
and averaged over ranks by FSDP's gradient reduction, is exactly the mean over the global batch:
``global_batch = micro_batch x accumulation x workers`` sequences (16 x 256 = 4,096 targets per
optimizer step with the defaults).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from raylm.attention import AttentionChoice, choose_attention
from raylm.model import build_config, build_meta_model, init_weights
from raylm.parallelize import autocast, parallelize, resolve_precision


@dataclass
class TrainState:
    """What a checkpoint needs besides model and optimizer to continue exactly."""

    step: int = 0
    """Optimizer steps done."""
    tokens_seen: int = 0
    """Target tokens trained on, all workers."""
    data_position: int = 0
    """Next position in the global sample order (= step x global batch)."""

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.data_position = int(state["data_position"])


@dataclass
class Built:
    model: nn.Module
    attention: AttentionChoice
    precision: str
    device: torch.device
    config: object


def build_training_model(*, preset: str | None, path: str | None, vocab_size: int, eos_id: int,
                         device: torch.device, precision: str = "auto", attention: str = "auto",
                         cross_document: bool = True, activation_checkpointing: bool = False,
                         compile: bool = False, seed: int = 0) -> Built:
    """Build on meta, parallelize, materialize on ``device``, initialize (or load pretrained
    weights, read once on rank 0 and scattered)."""
    choice = choose_attention(device.type, requested=attention, cross_document=cross_document)
    precision = resolve_precision(precision, device.type)
    config = build_config(preset=preset, path=path, vocab_size=vocab_size, eos_id=eos_id,
                          attn_implementation=choice.implementation)
    model = build_meta_model(config)
    parallelize(model, device_type=device.type, precision=precision,
                activation_checkpointing=activation_checkpointing, compile=compile)
    model.to_empty(device=device)
    if path:
        from raylm.checkpoint import load_pretrained_weights

        load_pretrained_weights(model, path)
    else:
        init_weights(model, seed=seed, num_layers=config.num_hidden_layers)
    model.train()
    return Built(model, choice, precision, device, config)


def batch_loss(built: Built, batch: dict[str, torch.Tensor], *, cross_document: bool
               ) -> torch.Tensor:
    """Mean next-token cross-entropy of a batch of packed blocks (fp32 loss)."""
    tokens = batch["input_ids"].to(built.device, non_blocking=True)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    kwargs = {}
    if not cross_document:
        kwargs["position_ids"] = batch["position_ids"][:, :-1].to(built.device,
                                                                   non_blocking=True)
    with built.attention.context(), autocast(built.precision, built.device.type):
        logits = built.model(input_ids=inputs, **kwargs).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm over all shards (clipped when ``max_norm`` > 0)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    # Under FSDP the norm is a DTensor reduced over every shard; make it a plain tensor.
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def train_step(built: Built, optimizer: torch.optim.Optimizer,
               micro_batches: Iterable[dict[str, torch.Tensor]], *, accumulation: int,
               grad_clip: float, cross_document: bool = True) -> tuple[float, float]:
    """One optimizer step over ``accumulation`` micro-batches; returns (loss averaged over the
    global batch, global gradient norm before clipping)."""
    total = torch.zeros((), device=built.device)
    n = 0
    for batch in micro_batches:
        loss = batch_loss(built, batch, cross_document=cross_document)
        (loss / accumulation).backward()
        total += loss.detach()
        n += 1
    if n != accumulation:
        raise RuntimeError(f"expected {accumulation} micro-batches, got {n}")
    norm = clip_grad_norm(built.model, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mean = total / accumulation
    if dist.is_initialized():
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    return float(mean), float(norm)


@torch.no_grad()
def evaluate(built: Built, batches: Iterable[dict[str, torch.Tensor]], *,
             cross_document: bool = True) -> float:
    """Mean loss over ``batches`` (equal counts on every rank), averaged over ranks."""
    built.model.eval()
    total = torch.zeros((), device=built.device)
    n = torch.zeros((), device=built.device)
    for batch in batches:
        total += batch_loss(built, batch, cross_document=cross_document)
        n += 1
    built.model.train()
    if dist.is_initialized():
        dist.all_reduce(total)
        dist.all_reduce(n)
    return float(total / n) if n > 0 else float("nan")


# --------------------------------------------------------------------------------------------
# The Ray Train worker loop
# --------------------------------------------------------------------------------------------


def batch_plan(global_batch: int, micro_batch: int, world_size: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) so that micro x accumulation x workers = global.

    The global batch is fixed by the config; when the worker count changes (an elastic resize,
    a restart on fewer nodes) each rank's share changes, and it is split into equal
    micro-batches no larger than ``micro_batch`` (16 sequences on 2 workers: 8 each, 1 x 8;
    on 1 worker: 2 x 8; on 3 workers: impossible, 16 does not divide by 3).
    """
    if global_batch % world_size:
        raise ValueError(
            f"train.global_batch_size={global_batch} does not divide by {world_size} workers, so "
            f"the workers cannot share every global batch equally; use a global batch that is a "
            f"multiple of {world_size}, or other worker counts.")
    per_rank = global_batch // world_size
    micro = max(m for m in range(1, min(micro_batch, per_rank) + 1) if per_rank % m == 0)
    return micro, per_rank // micro


def check_positions(positions: np.ndarray, *, step: int, global_batch: int, rank: int,
                    world_size: int) -> None:
    """The samples a rank is about to train at ``step`` (0-based) must be its slice of that
    global batch; anything else would silently train on the wrong data."""
    per_rank = global_batch // world_size
    first = step * global_batch + rank * per_rank
    if not np.array_equal(positions, np.arange(first, first + per_rank)):
        raise RuntimeError(
            f"rank {rank}: the data stream is at positions {positions[:4].tolist()}... but step "
            f"{step} needs {first}..{first + per_rank - 1}; the stream and the checkpoint "
            f"disagree about where the run is.")


def train_loop_per_worker(loop_config: dict) -> None:
    """Run by ``TorchTrainer`` on every worker: restore, train, evaluate, report, checkpoint.

    Every worker calls ``ray.train.report`` at the same steps (Ray Train needs all of them);
    metrics are global figures, identical on every rank.
    """
    from raylm import preemption

    preemption.install_in_ray_worker()
    try:
        _train(loop_config)
    finally:
        preemption.uninstall_in_ray_worker()


def _train(loop_config: dict) -> None:
    import itertools
    import tempfile
    import time

    import ray.train
    import ray.train.torch

    from raylm import checkpoint as ckpt
    from raylm import ledger, preemption
    from raylm.config import config_from_dict
    from raylm.metrics import flops_per_token, mfu, peak_flops, peak_memory_bytes
    from raylm.optim import build_optimizer, lr_at, set_lr

    cfg = config_from_dict(loop_config["config"])
    run_dir = loop_config["run_dir"]
    ctx = ray.train.get_context()
    world, rank = ctx.get_world_size(), ctx.get_world_rank()
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        # One intra-op thread per reserved CPU: workers sharing a node must not oversubscribe.
        torch.set_num_threads(max(1, int(cfg.scaling.cpus_per_worker)))
    d, t, o = cfg.data, cfg.train, cfg.optim
    cross_doc = d.cross_document_attention
    built = build_training_model(
        preset=cfg.model.preset, path=cfg.model.path, vocab_size=loop_config["vocab_size"],
        eos_id=loop_config["eos_id"], device=device, precision=t.precision,
        attention=cfg.model.attention, cross_document=cross_doc,
        activation_checkpointing=cfg.model.activation_checkpointing, compile=cfg.model.compile,
        seed=t.seed)
    optimizer = build_optimizer(built.model, lr=o.lr, weight_decay=o.weight_decay,
                                betas=(o.beta1, o.beta2), device_type=device.type)
    state = TrainState()
    found = ckpt.latest_verified(run_dir)
    if found is not None:
        state.load_state_dict(ckpt.load(found[0], model=built.model, optimizer=optimizer,
                                        config=built.config))
        if rank == 0:
            print(f"raylm: {world} workers resuming from step {state.step} ({found[0]})",
                  flush=True)
    resumed_from = state.step if found is not None else None
    # The sample ledger continues the checkpoint's; every rank decides alike (it gathers).
    keep_ledger = t.sample_ledger and (found is None or ckpt.load_samples(found[0]) is not None)
    history = None
    if keep_ledger and rank == 0:
        history = ckpt.load_samples(found[0]) if found is not None else np.zeros(
            (0, t.global_batch_size), np.int32)
    pending: list[np.ndarray] = []
    micro_batch, accumulation = batch_plan(t.global_batch_size, t.micro_batch_size, world)
    if state.data_position != state.step * t.global_batch_size:
        raise ckpt.CheckpointError(
            f"checkpoint data position {state.data_position} is not step {state.step} x "
            f"train.global_batch_size={t.global_batch_size}; keep the global batch of the run.")

    monitor = None
    if ctx.get_local_rank() == 0:
        from raylm.tracking import start_node_monitor

        monitor = start_node_monitor(loop_config.get("mlflow_run_id"),
                                     loop_config.get("mlflow_tracking_uri"),
                                     node=f"node{ctx.get_node_rank()}")
    flops_token = flops_per_token(built.config, d.seq_len)
    peak = peak_flops(device, built.precision)
    tokens_per_step = t.global_batch_size * d.seq_len
    train_batches = iter(ray.train.get_dataset_shard("train").iter_torch_batches(
        batch_size=micro_batch, prefetch_batches=d.prefetch_batches))
    val_shard = ray.train.get_dataset_shard("val")
    # Starting the stream (actors, first blocks) is a one-off cost, reported on its own rather
    # than folded into the steady-state data-wait fraction.
    startup_t0 = time.perf_counter()
    if state.step < t.steps:
        train_batches = itertools.chain([next(train_batches)], train_batches)
    data_startup_s = time.perf_counter() - startup_t0

    try:
        wait_s = busy_s = 0.0
        window_t0, window_tokens, window_wait = time.perf_counter(), 0, 0.0
        run_t0 = time.perf_counter()
        while state.step < t.steps:
            step_t0 = time.perf_counter()
            micro = []
            for _ in range(accumulation):
                w0 = time.perf_counter()
                micro.append(next(train_batches))
                window_wait += time.perf_counter() - w0
            check_positions(torch.cat([b["sample_position"] for b in micro]).numpy(),
                            step=state.step, global_batch=t.global_batch_size, rank=rank,
                            world_size=world)
            lr = lr_at(state.step, schedule=o.schedule, peak=o.lr, warmup=o.warmup_steps,
                       total=t.steps, min_ratio=o.min_lr_ratio, decay_fraction=o.decay_fraction,
                       cycle_steps=o.cycle_steps)
            set_lr(optimizer, lr)
            loss, grad_norm = train_step(built, optimizer, micro, accumulation=accumulation,
                                         grad_clip=o.grad_clip, cross_document=cross_doc)
            state.step += 1
            state.tokens_seen += tokens_per_step
            state.data_position += t.global_batch_size
            if keep_ledger:
                pending.append(torch.cat([b["row"] for b in micro]).numpy())
            window_tokens += tokens_per_step
            busy_s += time.perf_counter() - step_t0
            last = state.step == t.steps
            # Every rank takes part in the vote; at the last step the final save covers it.
            preempted = preemption.any_rank_requested(device) and not last
            evaluate_now = (state.step % t.eval_every == 0 or last) and not preempted
            save_now = state.step % cfg.checkpoint.every == 0 or last or preempted
            if state.step % t.log_every and not evaluate_now and not save_now:
                continue
            now = time.perf_counter()
            elapsed = now - window_t0
            tok_s = window_tokens / elapsed
            wait_s += window_wait
            metrics = {
                "step": state.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "tokens_per_s": tok_s, "tokens_seen": state.tokens_seen,
                "data_wait_fraction": window_wait / elapsed,
                "data_wait_fraction_run": wait_s / max(busy_s, 1e-9),
                "mfu": mfu(tok_s, flops_token, peak, world),
                "peak_memory_gb": peak_memory_bytes(device) / 2**30,
                "workers": world, "accumulation": accumulation, "micro_batch": micro_batch,
                "attention_backend": built.attention.backend, "precision": built.precision,
                "resumed_from_step": resumed_from, "elapsed_s": now - run_t0,
                "data_startup_s": data_startup_s, "preempted": preempted,
            }
            if evaluate_now:
                # The val stream holds eval_batches micro-batches per rank (fewer, and the same
                # number on every rank, when the split is small).
                val = evaluate(built, val_shard.iter_torch_batches(batch_size=t.micro_batch_size),
                               cross_document=cross_doc)
                metrics.update(val_loss=val, val_perplexity=float(torch.exp(torch.tensor(val))))
            if save_now:
                if keep_ledger:
                    new_rows = ledger.gather(pending, device)
                    if rank == 0:
                        history = np.concatenate([history, new_rows])
                    pending = []
                with tempfile.TemporaryDirectory(prefix="raylm-ckpt-") as tmp:
                    ckpt.save(tmp, model=built.model, optimizer=optimizer,
                              state=state.state_dict(), config=built.config, samples=history)
                    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
            else:
                ray.train.report(metrics)
            if preempted:
                raise preemption.Preempted(
                    f"a worker was asked to stop (SIGTERM); checkpoint saved at step {state.step}, "
                    f"the run resumes from it")
            window_t0, window_tokens, window_wait = time.perf_counter(), 0, 0.0
    finally:
        if monitor is not None:
            monitor.finish()
