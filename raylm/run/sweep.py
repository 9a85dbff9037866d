"""Learning-rate schedule sweeps: ``raylm tune``.

Each Ray Tune trial is a whole raylm training run: a Tune function trainable that builds and
fits its own TorchTrainer (Ray Train V2's way of running Train inside Tune), so a trial can be
a multi-worker FSDP2 run with its own restarts. The trial's Train controller hands its reports
to Tune (:mod:`raylm.run.trial`), where ASHA stops the trials whose validation loss trails.
Search: random, grid, or Optuna's TPE through Tune's ``OptunaSearch``; nothing here is a
hand-written searcher or scheduler.

Every report of a trial carries ``val_loss`` (Tune refuses results without the metric it
optimizes), so trials report, evaluate and checkpoint at the same steps: ``train.eval_every``.

Layout: ``RUN_DIR`` is storage path / run name. Trial ``ID`` trains in ``RUN_DIR/trials/ID``
(its checkpoints, summary.json, MLflow run nested under the sweep's);
``RUN_DIR/tune_summary.json``, ``best.yaml`` and ``val_loss.png`` are written at the end.
Tune's own experiment (its state, ``tuner.pkl``, its per-trial results) is ``RUN_DIR/tune``,
a folder of its own: when Tune restores an experiment it copies every top-level ``.json`` of
the experiment folder into its staging folder and uploads the staging folder back at each
later sync, which in the run directory itself wrote the restore-time copies of the sweep's
lease and ``tune_summary.json`` over the current ones. Running ``raylm tune`` again with the
same name resumes the sweep (also one whose Tune experiment is ``RUN_DIR`` itself, as raylm
laid sweeps out before).
"""

from __future__ import annotations

import functools
import math
import shlex
import tempfile
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import tune
from ray.tune.schedulers import ASHAScheduler

from raylm import rundir, storage
from raylm.config import Config, EvalConfig, config_from_dict, run_dir
from raylm.console import quiet_libraries, tune_verbosity
from raylm.contracts import TUNE_EXPERIMENT
from raylm.contracts.summary import SweepSummary, Trial
from raylm.data.preparation import prepared_dir
from raylm.run import benchmarks, tracking
from raylm.run.launch import reference_before_trials, train
from raylm.run.lease import hold
from raylm.run.objectives import objective_of
from raylm.run.preflight import Checked, preflight
from raylm.run.resources import ResourcePlan, choose_device, plan_resources
from raylm.run.tracking import Tracker
from raylm.run.trial import METRIC, ToTune, TrialReporter


def ranking(cfg: Config) -> tuple[str, str]:
    """The figure trials are ranked by, and ``min`` or ``max``: tune.metric's benchmark score
    when set (its direction lm-eval's); else the objective's own (the validation loss; DPO's
    held-out preference accuracy; GRPO's held-out reward: :mod:`raylm.run.objectives`)."""
    if cfg.tune.metric is not None:
        return cfg.tune.metric, _direction(cfg.eval.include_path, tuple(cfg.eval.tasks),
                                           cfg.tune.metric)
    objective = objective_of(cfg)
    return objective.metric, objective.mode


@functools.lru_cache(maxsize=8)
def _direction(include_path: str | None, tasks: tuple[str, ...], metric: str) -> str:
    ev = EvalConfig(tasks=list(tasks), include_path=include_path)
    return "max" if benchmarks.higher_is_better(ev, metric) else "min"


def search_space(cfg: Config) -> dict[str, Any]:
    """The Tune param space, keyed by config key (``optim.lr``, ...)."""
    tu, o = cfg.tune, cfg.optim
    choices = {"optim.schedule": tu.schedules,
               "optim.warmup_steps": tu.warmup_steps or [o.warmup_steps],
               "optim.weight_decay": tu.weight_decays or [o.weight_decay],
               "lora.rank": tu.lora_ranks or [cfg.lora.rank],
               "lora.alpha": tu.lora_alphas or [cfg.lora.alpha]}
    choices.update(objective_of(cfg).sweep_choices(cfg))
    choices.update(tu.choices)
    if tu.search == "grid":
        n = tu.lr_points
        # Largest first, so that ASHA has records to compare the smallest (slowest) against.
        lrs = [tu.lr_max * (tu.lr_min / tu.lr_max) ** (i / max(1, n - 1)) for i in range(n)]
        space = {"optim.lr": tune.grid_search(lrs if n > 1 else [tu.lr_max])}
        space.update({k: tune.grid_search(list(v)) for k, v in choices.items()})
        return space
    space = {"optim.lr": tune.loguniform(tu.lr_min, tu.lr_max)}
    space.update({k: tune.choice(list(v)) for k, v in choices.items()})
    return space


def trial_config(base: dict[str, dict[str, Any]], params: dict[str, Any], *, trials_dir: str,
                 trial_id: str, prepared: str) -> Config:
    """The raylm config of one trial: the sweep's, with the trial's parameters."""
    tree = {section: dict(values) for section, values in base.items()}
    for key, value in params.items():
        section, name = key.split(".", 1)
        tree[section][name] = value
    every = tree["train"].get("eval_every", 100)
    tree["train"]["log_every"] = every
    tree["checkpoint"]["every"] = every
    tree["run"].update(name=trial_id, storage_path=trials_dir)
    tree["data"]["source"] = prepared
    return config_from_dict(tree)


def run_trial(params: dict[str, Any], *, base: dict, trials_dir: str, prepared: str,
              parent: Tracker, checked: Checked) -> None:
    """The Tune function trainable: one raylm training run (checked by the sweep's
    preflight)."""
    trial_id = tune.get_context().get_trial_id()
    cfg = trial_config(base, params, trials_dir=trials_dir, trial_id=trial_id,
                       prepared=prepared)
    to_tune = ToTune()
    try:
        # A trial Tune restarts (its node lost) is named when it watches its earlier lease.
        train(cfg, callbacks=[TrialReporter(to_tune.queue,
                                            by_benchmark=cfg.tune.metric is not None)],
              tracking_parent=parent, checked=checked.for_trial(cfg),
              lease_owner=f"trial {trial_id} of {trials_dir}")
    finally:
        to_tune.close()


def trial_resources(cfg: Config, plan: ResourcePlan) -> dict[str, float]:
    """What one trial needs at most: its workers and their readers at the largest worker
    count, and what the objective places beside them at its most (a GRPO run's generators;
    its own process asks for no CPU, its Train controller for none)."""
    workers = cfg.scaling.worker_range[1]
    need = {name: workers * amount for name, amount in plan.per_worker().items()}
    for name, amount in objective_of(cfg).beside_trainers(cfg, most=True)[0].items():
        need[name] = need.get(name, 0.0) + amount
    return need


def concurrent_trials(cfg: Config, capacity: dict[str, float]) -> int:
    """How many trials the cluster holds at once (``tune.max_concurrent`` caps it)."""
    if cfg.scaling.wait_for_nodes:
        # Tune queues the trials that do not fit yet; the autoscaler grows the cluster for them.
        return cfg.tune.max_concurrent or cfg.tune.num_samples
    need = trial_resources(cfg, plan_resources(cfg, capacity))
    fit = min(int(capacity.get(k, 0.0) // v) for k, v in need.items() if v > 0)
    if fit < 1:
        have = ", ".join(f"{k} {capacity.get(k, 0):g}" for k in need)
        want = ", ".join(f"{k} {v:g}" for k, v in need.items())
        raise ValueError(f"Not even one trial fits the cluster: a trial needs {want}, the "
                         f"cluster has {have}; lower scaling.num_workers or "
                         f"scaling.cpus_per_worker, or add nodes.")
    return min(fit, cfg.tune.max_concurrent) if cfg.tune.max_concurrent else fit


def sweep(cfg: Config, *, log=print, checked: Checked | None = None) -> dict[str, Any]:
    """Run (or resume) the sweep; write tune_summary.json, best.yaml and val_loss.png.
    Needs ``ray.init``. ``checked``: the preflight of ``cfg``, when the caller ran it."""
    checked = checked or preflight(cfg, sweep=True)
    with hold(run_dir(checked.cfg)):
        return _sweep(checked, log=log)


def _sweep(checked: Checked, *, log) -> dict[str, Any]:
    """:func:`sweep`, once checked and its lease held."""
    quiet_libraries(checked.cfg.run.verbose)
    capacity = ray.cluster_resources()
    cfg, device = choose_device(checked.cfg, capacity)
    checked = checked.for_trial(cfg)
    log(f"raylm: {device}")
    concurrent = concurrent_trials(cfg, capacity)
    rd = run_dir(cfg)
    # Prepared once here, rather than by every trial at once.
    prepared = str(prepared_dir(cfg, log=log))
    reference_before_trials(cfg, prepared, log=log)
    parent = tracking.start(cfg, log=log)
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, base=cfg.to_dict(), trials_dir=storage.join(rd, "trials"),
                             prepared=prepared, parent=parent, checked=checked),
        # The trial's own process only drives its TorchTrainer, so it asks for no CPU: one
        # byte of memory, as Tune refuses an empty request. Any CPU share it held would be
        # missing to its own workers: 0.01 CPU left a 2-worker trial on a 2-CPU cluster
        # waiting forever for its second worker. The workers hold the CPUs, and
        # max_concurrent_trials counts them.
        {"memory": 1})
    t = cfg.train
    # max_t one past the last step: ASHA stops a trial that reaches max_t, which would end a
    # finished trial before it writes its summary and closes its MLflow run.
    # A benchmark's first score comes with the first scored checkpoint.
    first = t.eval_every * (cfg.eval.every if cfg.tune.metric is not None else 1)
    scheduler = ASHAScheduler(time_attr="step", max_t=t.steps + 1, grace_period=min(first, t.steps),
                              reduction_factor=2)
    searcher = None
    if cfg.tune.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        searcher = OptunaSearch(seed=t.seed)
    metric, mode = ranking(cfg)
    experiment = rundir.tune_experiment(rd)
    if experiment is not None:
        log(f"raylm: resuming the sweep in {rd}")
        tuner = tune.Tuner.restore(experiment, trainable, resume_errored=True)
    else:
        log(f"raylm: sweep of {cfg.tune.search} search, up to {concurrent} trials at a time, "
            f"in {rd}")
        tuner = tune.Tuner(
            trainable,
            param_space=search_space(cfg),
            tune_config=tune.TuneConfig(
                metric=metric, mode=mode, scheduler=scheduler, search_alg=searcher,
                num_samples=1 if cfg.tune.search == "grid" else cfg.tune.num_samples,
                max_concurrent_trials=concurrent),
            run_config=tune.RunConfig(name=TUNE_EXPERIMENT, storage_path=rd,
                                      verbose=tune_verbosity(cfg.run.verbose)),
        )
    failed = True
    try:
        results = tuner.fit()
        summary = summarize(results, cfg, parent)
        with tempfile.TemporaryDirectory(prefix="raylm-sweep-") as tmp:
            png = Path(tmp) / "val_loss.png"
            write_outputs(summary, cfg, log=log, plot_path=png)
            parent.log_sweep(summary, png)
        failed = False
    finally:
        parent.finish(failed=failed)
    return summary.to_dict()


def curve(df, name: str) -> list[list[float]]:
    """A trial's ``[step, value]`` points of ``name`` from its metrics dataframe."""
    return [] if df is None or name not in df else [
        [int(s), float(v)] for s, v in zip(df["step"], df[name], strict=True)
        if not math.isnan(v)]


def summarize(results, cfg: Config, parent: Tracker) -> SweepSummary:
    rd = run_dir(cfg)
    trials = []
    metric, mode = ranking(cfg)
    better = min if mode == "min" else max
    for r in results:
        history, ranked = (curve(r.metrics_dataframe, name) for name in (METRIC, metric))
        # A GRPO trial reports no validation loss: its curve is its held-out reward's.
        history = history or ranked
        steps = max((s for s, _ in history), default=0)
        trial_id = r.metrics.get("trial_id")  # Tune adds it to every result
        found = rundir.latest_verified(storage.join(rd, "trials", str(trial_id)),
                                       warn=lambda m: None)
        trials.append(Trial(
            trial_id=trial_id, config=dict(r.config),
            val_loss=min((v for _, v in curve(r.metrics_dataframe, METRIC)), default=None),
            ranked=better((v for _, v in ranked), default=None), steps=steps,
            stopped_early=r.error is None and steps < cfg.train.steps,
            error=str(r.error).splitlines()[0] if r.error else None,
            checkpoint_path=str(found[0]) if found else None, history=history,
            # A benchmark's [step, score] points, which the plot then draws.
            scores=ranked if metric.startswith("eval/") else None))
    done = [t for t in trials if t.ranked is not None]
    best = better(done, key=lambda t: t.ranked) if done else None
    return SweepSummary(trials=trials, metric=metric, best_trial=best and best.trial_id,
                        mlflow_parent_run_id=parent.run_id, mlflow_tracking_uri=parent.uri,
                        trials_dir=storage.join(rd, "trials"))


def write_outputs(summary: SweepSummary, cfg: Config, *, log=print,
                  plot_path: Path | None = None) -> None:
    """tune_summary.json, best.yaml and val_loss.png into RUN_DIR (the plot is drawn at
    ``plot_path`` first, when given, and copied)."""
    rd = run_dir(cfg)
    storage.write_text(storage.join(rd, SweepSummary.FILE), summary.to_json())
    if (best := summary.best) is not None:
        tree = cfg.to_dict()
        for key, value in best.config.items():
            section, name = key.split(".", 1)
            tree[section][name] = value
        tree["run"]["name"] = f"{cfg.run.name}-best"
        storage.write_text(
            storage.join(rd, "best.yaml"),
            f"# Best trial {best.trial_id} of sweep {cfg.run.name}: {summary.metric} "
            f"{best.ranked:.4f}\n" + yaml.safe_dump(tree, sort_keys=False))
    with tempfile.TemporaryDirectory(prefix="raylm-plot-") as tmp:
        drawn = plot_path or Path(tmp) / "val_loss.png"
        plot(summary, drawn, total_steps=cfg.train.steps)
        storage.write_bytes(storage.join(rd, "val_loss.png"), drawn.read_bytes())
    log(table(summary))
    best_yaml = storage.join(rd, "best.yaml")
    log(f"raylm: sweep done: {storage.join(rd, SweepSummary.FILE)}, "
        f"{best_yaml if best else 'no best.yaml (no trial was ranked)'}, "
        f"{storage.join(rd, 'val_loss.png')}")
    if best is not None:
        log(f"raylm: next: train with the best trial's settings as a run of their own: "
            f"raylm train --config {shlex.quote(best_yaml)}")


def table(summary: SweepSummary) -> str:
    trials, metric = summary.trials, summary.metric
    keys = sorted({k for t in trials for k in t.config})
    # The validation loss, where any trial has one, beside the metric.
    losses = metric != METRIC and any(t.val_loss is not None for t in trials)
    head = ["trial", *[k.split(".")[1] for k in keys], *[METRIC] * losses, metric, "steps",
            "stopped"]
    rows = []
    sign = -1 if metric != METRIC else 1  # the best first: a higher accuracy, a lower loss
    for t in sorted(trials, key=lambda t: (t.ranked is None, sign * (t.ranked or 0))):
        cells = [str(t.trial_id)]
        for k in keys:
            v = t.config.get(k)
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        cells += [f"{v:.4f}" if v is not None else "-"
                  for v in [*[t.val_loss] * losses, t.ranked]]
        cells += [str(t.steps), "early" if t.stopped_early else ""]
        rows.append(cells)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                     for r in [head, *rows])


def plot(summary: SweepSummary, path: Path, *, total_steps: int) -> None:
    # A Figure of its own, outside pyplot: a file needs no backend, and switching the
    # process's backend would stop a notebook's own plots from showing.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    best, metric, trials = summary.best_trial, summary.metric, summary.trials
    # Beside LR and schedule, the label names the other settings the trials differ in.
    keys = sorted({k for t in trials for k in t.config} - {"optim.lr", "optim.schedule"})
    varied = [k for k in keys if len({str(t.config.get(k)) for t in trials}) > 1]
    for t in trials:
        points = t.scores if t.scores is not None else t.history
        if not points:
            continue
        steps, losses = zip(*points, strict=True)
        lr, c = t.config.get("optim.lr"), t.config
        label = " ".join([f"{t.trial_id}: lr {lr:.2g} {c.get('optim.schedule', '')}",
                          *(f"{k.split('.', 1)[1]} {c.get(k)}" for k in varied)])
        ax.plot(steps, losses, marker="o", lw=2.5 if t.trial_id == best else 1.2,
                label=label + (" (best)" if t.trial_id == best else ""))
    ax.set_xlabel("step")
    # The curves drawn: a benchmark's scores, a GRPO trial's held-out reward, else the loss.
    ax.set_ylabel(metric if metric.startswith("eval/") else "held-out reward"
                  if metric == "val_reward" else "validation loss (nats)")
    ax.set_xlim(0, total_steps)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
