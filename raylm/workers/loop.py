"""The loop Ray Train runs on every worker: set up, then step, report and checkpoint.

The ``while`` loop in :func:`train` reads top to bottom like nanoGPT's; what it calls is kept
apart as torchtitan keeps it:

- :func:`setup`: build and parallelize the model, restore the latest checkpoint, and only then
  open this rank's data streams, at the step the restored :class:`~raylm.workers.step.TrainState`
  holds. That state is the run's one resume point: nothing else decides where the data starts.
- :class:`StepMeter`: wall time, tokens and time spent waiting for data, per report window and
  over the run.
- :func:`at_boundary`: a pure function of the step saying whether to report, evaluate, save or
  stop for a preemption.
- :func:`save_and_report`: the checkpoint (with the sample ledger) and ``ray.train.report``;
  :class:`raylm.workers.checkpoint.Checkpointer` makes periodic checkpoints asynchronous.
- The first batch is waited for by :class:`raylm.data.streams.FirstBatch`, which names what
  a stream that does not start waits for.

Every worker reports at the same steps (Ray Train needs all of them); metrics are global
figures, identical on every rank. A worker group's first report, made as soon as it is set up
and before it trains, announces it (``event: group_start``, with the world size and the step it
resumed from); every report carries ``group_started``, the time the group began. That is how
the controller's record (:mod:`raylm.run.record`) learns of restarts and resizes.
"""

from __future__ import annotations

import collections
import copy
import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch

from raylm import rundir, storage
from raylm.config import Config, batch_plan
from raylm.console import quiet_libraries
from raylm.contracts import Event, Marker
from raylm.contracts.report import Report
from raylm.data.packing import SampleOrder, Skips, check_positions, step_positions
from raylm.data.streams import (
    FirstBatch,
    PackedSplit,
    build_train_stream,
    read_val_blocks,
    reader_wait,
)
from raylm.faults import MISTAKES, Mistake, Preempted, Rewind, check_lease
from raylm.live import LiveMetrics
from raylm.model import sparsity
from raylm.model.assemble import (
    Built,
    batch_loss,
    logit_spread,
    plain,
)
from raylm.model.lora import adapter_args
from raylm.model.lora import settings as lora_settings
from raylm.model.parallelize import Layout, ParallelPlan, layout_of, loss_context
from raylm.model.pipeline import describe_split
from raylm.model.spec import ModelSpec
from raylm.schedule import lr_at
from raylm.workers import checkpoint as ckpt
from raylm.workers import preemption
from raylm.workers.energy import EnergyCounter, run_figures, window_figures
from raylm.workers.grpo import Reinforce
from raylm.workers.handoff import HANDOFF, Handoff
from raylm.workers.health import (
    Fault,
    Health,
    NumericalFault,
    decide,
    first_prediction_check,
)
from raylm.workers.ledger import Ledger
from raylm.workers.metrics import (
    mfu,
    peak_flops,
    peak_memory_bytes,
    state_memory_bytes,
)
from raylm.workers.node_metrics import NodeMonitor
from raylm.workers.optim import build_optimizer, set_lr
from raylm.workers.preference import Preference
from raylm.workers.step import NextToken, Objective, TrainState
from raylm.workers.watchdog import bounded


@dataclass
class FaultTrace:
    """What traces a faulty step to its samples and documents, and leaves them out."""

    health: Health
    skips: Skips
    """The position ranges the run leaves out of its order (its rewinds', train.skip_positions)."""
    manifest: dict[str, Any]
    """The run's skipped_samples.json as this group found it."""
    resumed: tuple[str, int] | None
    """The checkpoint this group resumed from: its directory name and step."""
    order: SampleOrder
    """The training order, for the stored rows of a faulty step's positions."""
    split: PackedSplit
    """The stored training blocks, for the records a faulty step's rows hold."""
    recent: collections.deque
    """(step, micro-batches) of the steps since the last report: a rewind finds the samples
    of a faulty step that are at fault on their own in them. On the host, a few MB."""


@dataclass
class Reporting:
    """What a worker measures and tells: figures, gauges, system metrics, the stop vote."""

    meter: StepMeter
    vote: preemption.Vote
    constant: dict[str, Any]
    """Reported with every step: the layout, the kernels that ran, where the group resumed."""
    phases: dict[str, float]
    """Seconds the set-up spent on each of its parts (``build_s``, ``restore_s``, ...)."""
    live: LiveMetrics | None = None
    """This rank's gauges in Ray's metrics (:mod:`raylm.live`)."""
    monitor: NodeMonitor | None = None  # this node's system metrics, on its local rank 0
    state_memory: dict[str, float] | None = None
    """Parameter and optimizer-state memory of the rank holding most, once measured."""


@dataclass
class Setup:
    """What one worker trains with, once set up."""

    cfg: Config
    rank: int
    layout: Layout
    built: Built
    optimizer: torch.optim.Optimizer
    objective: Objective
    state: TrainState
    ledger: Ledger
    accumulation: int
    batches: Iterator[dict[str, torch.Tensor]]
    val_batches: list[dict[str, torch.Tensor]]
    checkpointer: ckpt.Checkpointer
    identity: dict[str, str]
    """What the run trains with, written into every checkpoint (data, tokenizer, base)."""
    run_dir: str
    lease: str | None
    """The token of the run directory's lease its driver holds (raylm.run.lease)."""
    zeros: list[tuple[torch.Tensor, torch.Tensor]]
    """(weight, mask) of a pruned model.path's layers, zeroed again after every step (full
    fine-tuning: :mod:`raylm.model.sparsity`); empty otherwise."""
    trace: FaultTrace
    reporting: Reporting


# When this module finished importing: a worker imports it (torch, Ray Train, transformers'
# model code and raylm's) while Ray Train unpacks the training function, before it runs it.
IMPORTED = time.time()


def process_started() -> float | None:
    """When this process started (Linux's /proc), or None."""
    try:
        with open("/proc/self/stat") as f:
            # The command name (field 2) may hold spaces; what follows its ")" does not.
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def train_loop_per_worker(loop_config: dict[str, Handoff]) -> None:
    """Run by ``TorchTrainer`` on every worker."""
    group_started = time.time()
    preemption.install_in_ray_worker()
    try:
        try:
            run = setup(loop_config[HANDOFF], group_started=group_started)
        except Mistake:
            raise
        except MISTAKES as e:
            raise Mistake(f"worker setup: {type(e).__name__}: {e}") from e
        try:
            started = process_started()
            ray.train.report(Report(
                **run.reporting.constant, step=run.state.step, event=Event.GROUP_START,
                setup_s=time.time() - group_started,
                phases={"process_s": None if started is None else max(0.0, IMPORTED - started),
                        "ray_train_s": group_started - IMPORTED, **run.reporting.phases},
                resumed_clock=run.state.clock).to_metrics())
            train(run)
        finally:
            if run.reporting.monitor is not None:
                run.reporting.monitor.stop()
    finally:
        preemption.uninstall_in_ray_worker()


def train(run: Setup) -> None:
    t, o = run.cfg.train, run.cfg.optim
    state = run.state
    tokens_per_step = t.global_batch_size * run.cfg.data.seq_len
    meter = run.reporting.meter
    while state.step < t.steps:
        meter.step_begins()
        micro = meter.fetch(run.batches, run.accumulation)
        check_positions(torch.cat([b["sample_position"] for b in micro]).numpy(),
                        step=state.step, global_batch=t.global_batch_size,
                        rank=run.layout.dp_rank, world_size=run.layout.dp_size,
                        skips=run.trace.skips)
        lr = lr_at(state.step, o, total=t.steps)
        set_lr(run.optimizer, lr)
        if (state.step == 0 and run.cfg.model.path and run.built.pipeline is None
                and run.objective.checks_first_prediction):
            # Once, before a run from pretrained weights trains on them.
            first_prediction_check(
                logit_spread(run.built, micro[0],
                             cross_document=run.cfg.data.across_documents),
                model_path=run.cfg.model.path)
        loss, grad_norm, figures = run.objective.step(
            run.built, run.optimizer, micro, accumulation=run.accumulation,
            grad_clip=o.grad_clip, health=run.trace.health)
        sparsity.reapply(run.zeros)
        # GRPO's steps train rows of prompt and completion, which it counts.
        tokens = run.objective.tokens if run.objective.tokens is not None else tokens_per_step
        state.advance(samples=t.global_batch_size, tokens=tokens, lr=lr)
        run.ledger.add(torch.cat([b["row"] for b in micro]).numpy())
        run.trace.recent.append((state.step, micro))
        meter.step_ends(tokens)
        # Every rank takes part in the vote, every step.
        verdict = run.reporting.vote(busy=run.checkpointer.busy())
        cause = verdict.cause
        todo = at_boundary(state.step, cfg=run.cfg, preempt_requested=cause is not None)
        if not todo.report:
            continue
        window = meter.window()
        window_energy = window.pop("energy_j")
        state.add_usage(joules=window_energy, gpu_seconds=window.pop("gpu_s"))
        if run.reporting.state_memory is None:  # after a step: the optimizer's state exists
            run.reporting.state_memory = state_memory(run)
        # The only host-device synchronisations of the loop are here, at reports.
        report = Report(step=state.step, loss=float(loss), lr=lr, grad_norm=float(grad_norm),
                        tokens_seen=state.tokens_seen, preempted=todo.preempted, **window,
                        figures={k: float(v) for k, v in figures.items()},
                        **run_figures(joules=state.energy_j, gpu_seconds=state.gpu_s,
                                      gpu_hour_price=run.cfg.tracking.gpu_hour_price),
                        **run.reporting.constant, **run.reporting.state_memory,
                        clock=meter.clock(window_energy_j=window_energy))
        faults = run.trace.health.read()
        if faults:
            on_faults(run, faults, report)
        if todo.evaluate:
            t0 = time.perf_counter()
            report.figures.update(run.objective.evaluate(run.built, run.val_batches))
            meter.eval_s += time.perf_counter() - t0
            report.clock = meter.clock(window_energy_j=window_energy)
        metrics = report.to_metrics()
        if run.reporting.live is not None:
            run.reporting.live.record(metrics)
        # The last checkpoint and a preemption's are written before the loop goes on (to its
        # end, or to stopping the group); the others in the background.
        save_and_report(run, metrics, save=todo.save,
                        wait=todo.preempted or state.step >= t.steps, hold=verdict.busy)
        if todo.preempted:
            preemption.hand_over()
            notice = preemption.drain_notice()
            raise Preempted(
                f"a worker was asked to stop ({cause}{': ' + notice if notice else ''}); "
                f"checkpoint saved at step {state.step}, the run resumes from it")
        meter.window_reset()


def check_skips_kept(state: TrainState, skips: Skips) -> None:
    """The positions left out of the order before a checkpoint's data position must be those
    its run left out: other ranges would move what every later step trains."""
    was = Skips(state.skipped or [])
    trained_to = int(was.positions(np.array([state.data_position]))[0])
    if clip_ranges(was.ranges, trained_to) != clip_ranges(skips.ranges, trained_to):
        raise rundir.CheckpointError(
            f"the sample positions left out of the order below position {trained_to} "
            f"({clip_ranges(skips.ranges, trained_to)}) are not those the checkpoint at step "
            f"{state.step} trained without ({clip_ranges(was.ranges, trained_to)}); "
            f"train.skip_positions may only leave out positions the run has not reached, or "
            f"start a new run (run.name)")


def clip_ranges(ranges: list[list[int]], end: int) -> list[list[int]]:
    return [[a, min(b, end)] for a, b in ranges if a < end]


def compile_blocks(setting: bool | str, device: torch.device) -> bool:
    """``model.compile`` on this worker's device: ``auto`` compiles on CUDA only."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


@dataclass(frozen=True)
class Boundary:
    report: bool
    evaluate: bool
    save: bool
    preempted: bool


def at_boundary(step: int, *, cfg: Config, preempt_requested: bool) -> Boundary:
    """What happens after optimizer step ``step`` (1-based: steps done). A preemption saves at
    once and skips evaluation; at the last step the final save covers it."""
    last = step == cfg.train.steps
    preempted = preempt_requested and not last
    evaluate_now = (step % cfg.train.eval_every == 0 or last) and not preempted
    save = step % cfg.checkpoint.every == 0 or last or preempted
    report = step % cfg.train.log_every == 0 or evaluate_now or save
    return Boundary(report=report, evaluate=evaluate_now, save=save, preempted=preempted)


class StepMeter:
    """Times the loop: tokens/s and the share of time spent waiting for data, over the window
    since the last report and (data wait) over the whole run; and the GPUs' energy (see
    :mod:`raylm.workers.energy`).

    Energy windows follow one another without gaps (each starts where the last was read, so
    evaluation, checkpoints and setup count), while the throughput window restarts after each
    report. All ranks call :meth:`window` at the same steps (it all-reduces on GPUs)."""

    def __init__(self, *, flops_per_token: float, peak_flops: float | None, world_size: int,
                 device: torch.device, energy: EnergyCounter | None = None,
                 energy_since: tuple[float, float | None] | None = None,
                 spent: dict[str, float] | None = None) -> None:
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        # Seconds of the steps an objective spends apart from computing them, as it counts
        # them (GRPO: generate_s waiting for completions, transfer_s handing weights over).
        self.spent = spent if spent is not None else {}
        self.world_size, self.device = world_size, device
        self.run_t0 = time.perf_counter()
        self.busy_s = self.run_wait_s = 0.0
        # Seconds since the group was set up, for the goodput account (raylm.run.goodput).
        self.eval_s = self.checkpoint_s = 0.0
        self.energy = energy
        # (time, joules) where the first energy window starts: the group's setup by default.
        self.energy_t0, self.energy_j0 = energy_since or (
            time.perf_counter(), energy.read() if energy else None)
        self.window_reset()

    def window_reset(self) -> None:
        self.window_t0 = time.perf_counter()
        self.window_tokens = 0
        self.window_steps = 0
        self.window_wait_s = 0.0

    def step_begins(self) -> None:
        self.step_t0 = time.perf_counter()

    def fetch(self, batches: Iterator[dict[str, torch.Tensor]], n: int
              ) -> list[dict[str, torch.Tensor]]:
        """The next ``n`` micro-batches, timing the wait for each."""
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            out.append(next(batches))
            waited = time.perf_counter() - t0
            self.window_wait_s += waited
            self.run_wait_s += waited
        return out

    def step_ends(self, tokens: int) -> None:
        self.window_tokens += tokens
        self.window_steps += 1
        self.busy_s += time.perf_counter() - self.step_t0

    def clock(self, *, window_energy_j: float | None) -> dict[str, float | None]:
        """What a report tells the goodput account: this rank's wall time, and the seconds
        since the group was set up spent computing steps, waiting for data, what the objective
        spends apart (:attr:`spent`), evaluating and blocked on checkpoints (a report's own
        checkpoint adds its write when it is made:
        :meth:`raylm.workers.checkpoint.Checkpointer.save`); the window's joules."""
        apart = sum(self.spent.values())
        return {"t": time.time(), "compute_s": self.busy_s - self.run_wait_s - apart,
                "data_wait_s": self.run_wait_s, **self.spent, "eval_s": self.eval_s,
                "checkpoint_s": self.checkpoint_s, "energy_j": window_energy_j}

    def window(self) -> dict[str, float]:
        """The figures of the window since the last report."""
        if self.device.type == "cuda":
            # The host runs ahead of the GPU's queue by up to a step; without this the window
            # ended when its last step was queued, not done (measured on an H100 at the 1b
            # preset: 72.8k tokens/s reported against 67.3k done, 10-step windows). The
            # report reads the loss back right after, so this wait costs nothing.
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        elapsed = now - self.window_t0
        tok_s = self.window_tokens / elapsed
        return {
            "tokens_per_s": tok_s,
            "data_wait_fraction": self.window_wait_s / elapsed,
            "data_wait_fraction_run": self.run_wait_s / max(self.busy_s, 1e-9),
            "mfu": mfu(tok_s, self.flops_per_token, self.peak_flops, self.world_size),
            "elapsed_s": now - self.run_t0,
            "peak_memory_gb": peak_memory_bytes(self.device) / 2**30,
            **self._energy_window(now),
        }

    def _energy_window(self, now: float) -> dict[str, float | None]:
        """Joules drawn by every GPU since the last energy reading, GPU-seconds over the same
        span, and the window figures; None throughout on CPUs."""
        if self.device.type != "cuda":
            return {"energy_j": None, "gpu_s": None, **window_figures(
                joules=None, steps=0, tokens=0, seconds=0.0, gpus=0)}
        joules = self.energy.read() if self.energy else None
        mine = (torch.tensor([0.0, 1.0], dtype=torch.float64) if joules is None
                or self.energy_j0 is None else
                torch.tensor([joules - self.energy_j0, 0.0], dtype=torch.float64))
        if torch.distributed.is_initialized():
            mine = mine.to(self.device)
            torch.distributed.all_reduce(mine)
        total, missing = mine.tolist()
        seconds = now - self.energy_t0
        self.energy_t0, self.energy_j0 = now, joules
        total = None if missing else total  # one rank without a counter: no figure at all
        return {"energy_j": total, "gpu_s": seconds * self.world_size,
                **window_figures(joules=total, steps=self.window_steps,
                                 tokens=self.window_tokens, seconds=seconds,
                                 gpus=self.world_size)}


def state_memory(run: Setup) -> dict[str, float]:
    """GiB of parameters and of optimizer state on the rank that holds most of each (every
    rank calls it): what FSDP2, tensor and pipeline parallelism divide, unlike the peak,
    which activations dominate."""
    held = torch.tensor(state_memory_bytes(run.built.model, run.optimizer), dtype=torch.float64,
                        device=run.built.device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(held, op=torch.distributed.ReduceOp.MAX)
    params, optim = (float(x) / 2**30 for x in held.tolist())
    return {"param_memory_gb": params, "optimizer_memory_gb": optim}


def save_and_report(run: Setup, metrics: dict[str, Any], *, save: bool, wait: bool,
                    hold: bool = False) -> None:
    """Report ``metrics``, with a checkpoint if ``save``: written before this returns if
    ``wait``, else (when asynchronous) in the background. ``hold``: a report would wait for
    the controller (the vote says), so one without a checkpoint goes out with the next."""
    if not save:
        run.checkpointer.report(metrics, hold=hold)
        if not hold:
            run.reporting.vote.reported()
        return
    t0 = time.perf_counter()
    c = run.cfg.checkpoint
    with bounded(f"the checkpoint before step {run.state.step} to be written",
                 timeout_s=c.timeout_s, rank=run.rank, setting="checkpoint.timeout_s"):
        run.checkpointer.wait()
    samples = run.ledger.collect(run.built.device)
    # The report's clock ends after what it counts: the window it closes holds the wait.
    metrics["clock"]["checkpoint_s"] += time.perf_counter() - t0
    metrics["clock"]["t"] = time.time()
    run.state.clock = {**metrics["clock"], "group": metrics["group_started"]}
    run.state.skipped = run.trace.skips.ranges
    if run.rank == 0:  # a driver that lost its run to another writes no checkpoint into it
        check_lease(run.run_dir, run.lease)
    with bounded(f"the checkpoint of step {run.state.step} to be {'written' if wait else 'staged'}",
                 timeout_s=c.timeout_s, rank=run.rank, setting="checkpoint.timeout_s"):
        run.checkpointer.save(metrics, step=run.state.step, wait=wait, model=run.built.model,
                              optimizer=run.optimizer,
                              state=copy.deepcopy(run.state.state_dict()),
                              config=run.built.config, samples=samples,
                              extra=run.objective.saved(),
                              adapters=lora_settings(run.cfg.lora), identity=run.identity)
    run.reporting.vote.reported()
    run.reporting.meter.checkpoint_s += time.perf_counter() - t0


def on_faults(run: Setup, faults: list[Fault], report: Report) -> None:
    """Act on the numerical faults of the window this report closes (every rank alike, see
    :func:`raylm.workers.health.decide`): record them in the report; skipped steps' rows go
    into the ledger as withheld; a rewind writes the run's skipped_samples.json (rank 0) and
    a stop names the faults; both report, wait until the controller has the report and the
    checkpoint in flight is written, and raise."""
    t = run.cfg.train
    batches = dict(run.trace.recent)
    decision = decide(
        faults, policy={"nonfinite": t.on_nonfinite, "spike": t.on_spike},
        positions_of=lambda step: step_positions(step, global_batch=t.global_batch_size,
                                                 skips=run.trace.skips),
        rows_of=run.trace.order.rows, manifest=run.trace.manifest, max_rewinds=t.max_rewinds,
        resumed=run.trace.resumed,
        culprits_of=lambda step: culprits(run.built, batches[step],
                                          cross_document=run.cfg.data.across_documents),
        documents_of=run.trace.split.documents)
    report.numerical_faults = decision.records
    if decision.action == "skip":
        for r in decision.records:
            run.ledger.withhold(run.state.step - r["step"])
        return
    run.checkpointer.wait()
    if decision.manifest is not None and run.rank == 0:
        rundir.write_manifest(run.run_dir, decision.manifest)
    run.checkpointer.report(report.to_metrics())
    preemption.hand_over()
    raise (Rewind if decision.action == "rewind" else NumericalFault)(decision.message)


@torch.no_grad()
def culprits(built: Built, micro: list[dict[str, torch.Tensor]], *, cross_document: bool
             ) -> np.ndarray | None:
    """The global positions among a step's samples whose loss, each on its own, is not finite
    on the current weights, every rank's (all ranks call it: each runs its samples one by one
    in step with the others); None under pipeline parallelism, whose schedule runs whole
    micro-batches."""
    if built.pipeline is not None:
        return None
    built.model.eval()
    mine = []
    for batch in micro:
        for i in range(len(batch["input_ids"])):
            one = {k: v[i:i + 1] for k, v in batch.items()}
            with loss_context(built.plan):
                loss = plain(batch_loss(built, one, cross_document=cross_document))
            if not torch.isfinite(loss):
                mine.append(int(batch["sample_position"][i]))
    built.model.train()
    every = [mine]
    if torch.distributed.is_initialized():
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, mine)
    return np.array(sorted({p for part in every for p in part}), dtype=np.int64)


def setup(handoff: Handoff, *, group_started: float) -> Setup:
    """Open the training stream at the step of the run's latest checkpoint, build the model
    and restore that checkpoint while its reader starts, then wait for its first batch."""
    cfg = handoff.cfg
    quiet_libraries(cfg.run.verbose)
    ctx = ray.train.get_context()
    world, rank = ctx.get_world_size(), ctx.get_world_rank()
    device = worker_device(cfg)
    # Energy is counted from here: building, restoring and the first batch draw power too.
    energy = EnergyCounter(device)
    energy_since = (time.perf_counter(), energy.read())
    t, par = cfg.train, cfg.parallel
    plan = ParallelPlan(activation_checkpointing=cfg.model.activation_checkpointing,
                        compile=compile_blocks(cfg.model.compile, device) and par.context == 1,
                        tensor=par.tensor, pipeline=par.pipeline, context=par.context,
                        float8=cfg.model.float8, reduce_dtype=par.reduce_dtype,
                        prefetch=par.prefetch)
    # Data goes by data-parallel rank: the workers of a tensor- or context-parallel group, and
    # the stages of a pipeline, train on the same samples.
    lay = layout_of(rank, world, plan)
    # Under pipeline parallelism the accumulation steps are the schedule's micro-batches.
    micro_batch, accumulation = batch_plan(
        t.global_batch_size, t.micro_batch_size, lay.dp_size,
        splits=par.pipeline_microbatches if par.pipeline > 1 else 0)
    # The stream opens first, at the step of the checkpoint the restore below loads, so that
    # its reader starts while the model is built and restored.
    reading = dict(timeout_s=cfg.checkpoint.timeout_s, rank=rank, setting="checkpoint.timeout_s")
    with bounded(f"the checkpoints of {handoff.run_dir} to be listed and verified",
                 **reading):
        manifest = rundir.read_manifest(handoff.run_dir)
        found = rundir.latest_usable(handoff.run_dir, bad=manifest["bad_checkpoints"])
    skips = Skips(manifest["ranges"] + t.skip_positions)
    start_step = found[1].step if found is not None else 0
    phases = Phases()
    batches = open_stream(handoff, layout=lay, start_step=start_step,
                          micro_batch=micro_batch, device=device, skips=skips)
    fetching = FirstBatch(batches) if start_step < t.steps else None
    phases.done("stream_s")
    built, optimizer = build_model(handoff, device=device, plan=plan)
    # From the pretrained weights, before a checkpoint replaces them.
    zeros = kept_zeros(cfg, built, rank=rank)
    phases.done("build_s")
    with bounded(f"checkpoint {found and found[0]} to be read", **reading):
        state, ledger = restore(found, cfg, built=built, optimizer=optimizer, rank=rank,
                                layout=lay, skips=skips)
    phases.done("restore_s")
    assert state.step == start_step, (state.step, start_step)
    if rank == 0:
        announce(cfg, built, world=world, step=state.step, micro_batch=micro_batch,
                 accumulation=accumulation)
    monitor = (NodeMonitor(handoff.tracking, f"node{ctx.get_node_rank()}")
               if ctx.get_local_rank() == 0 else None)
    val_batches = validation_batches(handoff, layout=lay)
    phases.done("validation_s")
    # What starting the stream (actor, first blocks) still costs once the model is ready is a
    # one-off, reported on its own rather than folded into the steady-state data-wait fraction.
    t0 = time.perf_counter()
    if fetching is not None:
        reader = handoff.reader_resources
        first = fetching.wait(
            timeout_s=cfg.data.first_batch_timeout_s, keep_waiting=cfg.scaling.wait_for_nodes,
            waiting_for=lambda: reader_wait(reader, rank=rank), log=print)
        batches = itertools.chain([first], batches)
    phases.done("first_batch_s")
    constant = {
        "workers": world, "accumulation": accumulation, "micro_batch": micro_batch,
        # The layout as numbers: metrics that may change at a resize, unlike MLflow params.
        "data_parallel": lay.dp_size, "tensor_parallel": lay.tp_size,
        "pipeline_parallel": lay.pp_size,
        "trainable_params": trainable_params(built),
        "attention_backend": built.attention.backend, "precision": built.precision,
        "resumed_from_step": state.step if state.step else None,
        "group_started": group_started, "data_startup_s": time.perf_counter() - t0,
    }
    objective, batches = start_objective(handoff, rank=rank, built=built, step=state.step,
                                         batches=batches, accumulation=accumulation, found=found)
    meter = StepMeter(flops_per_token=objective.flops(built.config, cfg.data.seq_len),
                      peak_flops=listed_peak(built, rank=rank), world_size=world, device=device,
                      energy=energy, energy_since=energy_since,
                      spent=objective.spent)
    split = PackedSplit.load(handoff.prepared, "train")
    trace = FaultTrace(
        health=Health(device=device, start_step=state.step, report_every=t.log_every,
                      spikes=t.on_spike != "off", factor=t.spike_factor, window=t.spike_window,
                      spikes_from=cfg.optim.warmup_steps),
        skips=skips, manifest=manifest, split=split, recent=collections.deque(maxlen=t.log_every),
        order=SampleOrder(split.row_group_sizes, seed=t.seed, window=cfg.data.shuffle_window,
                          global_batch=t.global_batch_size),
        resumed=(storage.name(found[0]), state.step) if found is not None else None)
    reporting = Reporting(meter=meter, vote=preemption.Vote(device), constant=constant,
                          phases=phases.seconds, monitor=monitor,
                          live=LiveMetrics(storage.name(handoff.run_dir), rank=rank))
    return Setup(cfg=cfg, rank=rank, layout=lay, built=built, optimizer=optimizer,
                 objective=objective, state=state, ledger=ledger, accumulation=accumulation,
                 batches=batches, val_batches=val_batches,
                 checkpointer=ckpt.Checkpointer(cfg.checkpoint.asynchronous,
                                                cfg.checkpoint.writer, device=built.device,
                                                model=built.model),
                 identity=handoff.identity, run_dir=handoff.run_dir, lease=handoff.lease,
                 zeros=zeros, trace=trace, reporting=reporting)


class Phases:
    """Seconds spent on each part of a worker's set-up, one after another."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.mark = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase], self.mark = now - self.mark, now


def kept_zeros(cfg: Config, built: Built, *, rank: int
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The masks of a pruned ``model.path`` that full fine-tuning keeps (a LoRA base is frozen:
    its zeros stay, and the merge keeps them)."""
    if not sparsity.is_pruned(cfg.model.path) or adapter_args(cfg.lora):
        return []
    zeros = sparsity.zero_masks(built.model)
    if rank == 0:
        print(f"model.path {cfg.model.path} is pruned: its zero weights stay zero through "
              f"training ({len(zeros)} layers)")
    return zeros


def build_model(handoff: Handoff, *, device: torch.device, plan: ParallelPlan
                ) -> tuple[Built, torch.optim.Optimizer]:
    """The run's model, laid out by ``plan`` on ``device``, and its optimizer."""
    cfg = handoff.cfg
    built = ModelSpec.from_config(cfg, vocab_size=handoff.vocab_size,
                                  eos_id=handoff.eos_id).build(device, plan)
    o = cfg.optim
    optimizer = build_optimizer(built.model, lr=o.lr, weight_decay=o.weight_decay,
                                betas=(o.beta1, o.beta2), device_type=device.type)
    return built, optimizer


def objective_for(cfg: Config, *, handoff: Handoff, rank: int
                  ) -> Objective:
    """What the run trains toward: the step, validation figures and FLOPs per token of next-token
    training, of a preference loss (train.objective=dpo) or of GRPO (grpo)."""
    if cfg.train.objective == "dpo":
        return Preference(cfg.dpo, adapters=bool(cfg.lora.rank))
    if cfg.train.objective == "grpo":
        return Reinforce(cfg, prepared=handoff.prepared, eos_id=handoff.eos_id,
                         vocab_size=handoff.vocab_size, rank=rank, keeper=handoff.keeper)
    return NextToken(cross_document=cfg.data.across_documents)


def start_objective(handoff: Handoff, *, rank: int, built: Built, step: int,
                    batches: Iterator[dict[str, torch.Tensor]], accumulation: int,
                    found: tuple[str, Marker] | None
                    ) -> tuple[Objective, Iterator]:
    """The run's objective, begun where it has something to start (GRPO: the generators, with
    the weights and rollouts of the checkpoint ``found``), and the stream to train from."""
    objective = objective_for(handoff.cfg, handoff=handoff, rank=rank)
    batches = objective.begin(built, step=step, batches=batches, accumulation=accumulation,
                              resumed=found and found[0])
    return objective, batches


def worker_device(cfg: Config) -> torch.device:
    """This worker's device (its GPU, or the CPU with one intra-op thread per reserved CPU:
    workers sharing a node must not oversubscribe it)."""
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        torch.set_num_threads(max(1, int(cfg.scaling.cpus_per_worker)))
    return device


def open_stream(handoff: Handoff, *, layout: Layout, start_step: int, micro_batch: int,
                device: torch.device, skips: Skips) -> Iterator[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches from ``start_step`` on."""
    d, t = handoff.cfg.data, handoff.cfg.train
    train_ds = build_train_stream(
        handoff.prepared, rank=layout.dp_rank, world_size=layout.dp_size,
        start_step=start_step, num_steps=t.steps, seed=t.seed, window=d.shuffle_window,
        global_batch=t.global_batch_size, resources=handoff.reader_resources,
        skips=skips.ranges, reference=handoff.reference)
    # Batches stay on the host (the positions and rows are checked and logged there; in a
    # GPU worker Ray's default would move them to the GPU), pinned so that the step's copy
    # of the tokens to the GPU never waits for its queue.
    return iter(train_ds.iter_torch_batches(batch_size=micro_batch, device="cpu",
                                            pin_memory=device.type == "cuda",
                                            prefetch_batches=d.prefetch_batches))


def validation_batches(handoff: Handoff, *, layout: Layout) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's share of the validation blocks, in micro-batches."""
    mb = handoff.cfg.train.micro_batch_size
    val = {k: torch.from_numpy(v) for k, v in read_val_blocks(
        handoff.prepared, rank=layout.dp_rank, world_size=layout.dp_size,
        eval_samples=handoff.cfg.train.eval_batches * mb, reference=handoff.reference).items()}
    return [{k: v[i:i + mb] for k, v in val.items()}
            for i in range(0, len(val["input_ids"]), mb)]


def announce(cfg: Config, built: Built, *, world: int, step: int, micro_batch: int,
             accumulation: int) -> None:
    """What the first worker says once the group is set up: where it resumed, and choices
    the user did not make explicitly (a slower attention kernel, the pipeline's split)."""
    if step:
        print(f"raylm: {world} worker{'s' if world > 1 else ''} resuming from step {step}",
              flush=True)
    if built.attention.fallback:
        print(f"raylm: attention runs {built.attention.backend}: "
              f"{built.attention.fallback}", flush=True)
    par = cfg.parallel
    if par.context > 1:
        print(f"raylm: each sequence split over {par.context} workers (parallel.context): "
              f"{cfg.data.seq_len // par.context} tokens each, attention "
              f"{built.attention.backend}", flush=True)
    if par.pipeline > 1:
        print(f"raylm: {par.pipeline} pipeline stages ({par.pipeline_schedule}, "
              f"{accumulation} micro-batches of {micro_batch} per step): "
              f"{describe_split(built.config.num_hidden_layers, par.pipeline)}", flush=True)


def listed_peak(built: Built, *, rank: int) -> float | None:
    """The device's listed peak FLOP/s at the run's precision (None: MFU is not reported, and
    on a GPU the first worker says why)."""
    peak = peak_flops(built.device, built.precision)
    if peak is None and built.device.type == "cuda" and rank == 0:
        print(f"raylm: MFU is not reported: no {built.precision} peak is listed for "
              f"{torch.cuda.get_device_name(built.device)!r} "
              f"(raylm.workers.metrics.BF16_PEAK_FLOPS)", flush=True)
    return peak


def trainable_params(built: Built) -> int:
    """Trainable parameters of the whole model (every rank calls it): DTensor shards count at
    their full size, and pipeline stages add theirs up."""
    n = sum(p.numel() for p in built.model.parameters() if p.requires_grad)
    if built.pipeline is None:
        return n
    total = torch.tensor(n, dtype=torch.int64, device=built.device)
    torch.distributed.all_reduce(total, group=built.model.pp_group)
    return int(total)


def restore(found: tuple[str, Marker] | None, cfg: Config, *, built: Built,
            optimizer: torch.optim.Optimizer, rank: int, layout: Layout, skips: Skips
            ) -> tuple[TrainState, Ledger]:
    """The train state of ``found``, the run's latest verified checkpoint and its marker
    (loaded into model and optimizer), and the sample ledger continuing its own; a fresh
    state when there is none."""
    state = TrainState()
    if found is not None:
        state.load_state_dict(ckpt.load(found[0], model=built.model, optimizer=optimizer,
                                        config=built.config,
                                        adapters=lora_settings(cfg.lora)))
        batch = cfg.train.global_batch_size
        if state.data_position != state.step * batch:
            raise rundir.CheckpointError(
                f"checkpoint data position {state.data_position} is not step {state.step} x "
                f"train.global_batch_size={batch}; keep the global batch of the run.")
        check_skips_kept(state, skips)
    # The ledger continues the checkpoint's; every rank decides alike (saving gathers).
    history = rundir.load_samples(found[0]) if found is not None else np.zeros(
        (0, cfg.train.global_batch_size), np.int32)
    enabled = cfg.train.sample_ledger and history is not None
    return state, Ledger(enabled=enabled, history=history if rank == 0 else None,
                         data_ranks=layout.data_ranks())
