"""What a run places on the cluster, decided on the driver before any worker starts: the
device its workers train on (``scaling.use_gpu=auto`` against the cluster), each training
worker's resources and its data reader's, beside an RL run's fewest generators, and the
benchmark evaluations'; each checked against what the cluster has, and refused with the
arithmetic and the settings that would fit. A Tune sweep plans its trials with the same
(:mod:`raylm.run.sweep`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from raylm.config import Config, ConfigError, validate
from raylm.data.streams import READER_CPUS
from raylm.run.objectives import objective_of


def choose_device(cfg: Config, capacity: dict[str, float]) -> tuple[Config, str]:
    """``cfg`` with ``scaling.use_gpu`` decided against the cluster's ``capacity`` (auto: GPU
    workers when it has a GPU), and the line that says which and why. A setting that needs
    GPU workers (an NF4 base, float8) on a cluster auto found none in is refused here, before
    any worker starts."""
    sc = cfg.scaling
    gpus = capacity.get("GPU", 0.0)
    has = f"the cluster has {gpus:g} GPU{'s' if gpus != 1 else ''}" if gpus else \
        "the cluster has no GPU"
    if sc.use_gpu == "auto":
        if not gpus and sc.wait_for_nodes:
            raise ConfigError(
                "scaling.use_gpu=auto cannot choose: the cluster has no GPU now but autoscales "
                "(scaling.wait_for_nodes=true), so GPU nodes may come; set scaling.use_gpu="
                "true to wait for GPU nodes, or false to train on CPUs.")
        use, why = gpus >= 1, f"scaling.use_gpu=auto and {has}"
    else:
        use, why = sc.use_gpu, f"scaling.use_gpu={str(sc.use_gpu).lower()}; {has}"
    chosen = dataclasses.replace(cfg, scaling=dataclasses.replace(sc, use_gpu=use))
    try:
        validate(chosen)
    except ConfigError as e:
        raise ConfigError(f"{e} (the workers would run on CPUs: {why})") from None
    hint = " (a cluster with GPUs gets GPU workers)" if sc.use_gpu == "auto" and not use else ""
    return chosen, f"workers on {'GPUs' if use else 'CPUs'}: {why}{hint}"


@dataclass(frozen=True)
class ResourcePlan:
    """What a run places on the cluster, per training worker: the worker itself, and the Ray
    Data actor that reads its stream (:func:`raylm.data.streams.build_train_stream`). The Train
    controller asks for no resources, the validation blocks are read in the worker, and a
    Tune trial's own process asks for no CPU (:mod:`raylm.run.sweep`)."""

    worker: dict[str, float]
    reader: dict[str, float]
    note: str | None = None
    """What raylm chose for the user, to say in one line."""

    @property
    def reader_cpus(self) -> float:
        return self.reader.get("CPU", 0.0)

    def per_worker(self) -> dict[str, float]:
        out = dict(self.worker)
        for name, amount in self.reader.items():
            out[name] = out.get(name, 0.0) + amount
        return out


def plan_resources(cfg: Config, capacity: dict[str, float] | None) -> ResourcePlan:
    """The resources of every worker and reader, checked against the cluster's ``capacity``
    (``None``: an autoscaling cluster, checked by nobody but the autoscaler).

    ``data.reader_cpus`` unset: each reader asks for :data:`READER_CPUS`, or for no CPU when the
    cluster's CPUs cannot hold the workers and that share beside them (two 1-CPU workers on 2
    CPUs): reading cached row groups is light next to a training step, so the reader then
    shares its worker's CPUs rather than waiting forever for a CPU nobody will free. Refused,
    with the arithmetic and the settings that fit, when the fewest workers do not fit."""
    sc, d = cfg.scaling, cfg.data
    assert sc.use_gpu != "auto", "choose_device decides it first"
    if capacity is not None:
        capacity = beside_trainers(cfg, capacity)
    fewest, most = sc.worker_range
    worker = {"CPU": sc.cpus_per_worker, **sc.worker_resources}
    if sc.use_gpu:
        worker["GPU"] = 1.0
    note = None
    if d.reader_cpus is not None:
        reader_cpus = d.reader_cpus
    elif capacity is None or most * (sc.cpus_per_worker + READER_CPUS) <= capacity.get("CPU", 0):
        reader_cpus = READER_CPUS
    else:
        reader_cpus = 0.0
        note = (f"{most} training workers of {sc.cpus_per_worker:g} CPU each leave less than "
                f"{READER_CPUS:g} CPU per data reader on the cluster's "
                f"{capacity.get('CPU', 0):g} CPUs; the readers ask for no CPU of their own "
                f"(data.reader_cpus=0)")
    reader = {"CPU": reader_cpus, **sc.data_resources}
    plan = ResourcePlan(worker=worker, reader=reader, note=note)
    if capacity is not None:
        _check_fits(cfg, plan, capacity)
    return plan


def beside_trainers(cfg: Config, capacity: dict[str, float]) -> dict[str, float]:
    """What the cluster's ``capacity`` leaves for training once what the objective places
    beside the trainers at its fewest (train.objective=grpo: rl.generators x
    rl.generator_resources) is placed; refused, with the arithmetic, when that does not fit at
    all. Generators beyond the fewest take what the training workers leave free, when they
    find it."""
    need, what = objective_of(cfg).beside_trainers(cfg)
    left = dict(capacity)
    for name, amount in need.items():
        if amount > capacity.get(name, 0.0) + 1e-9:
            raise ValueError(
                f"{what} need {amount:g} {name}, but the cluster has "
                f"{capacity.get(name, 0):g}; fewer generators or smaller ones would fit, or set "
                f"scaling.wait_for_nodes=true if the cluster autoscales.")
        left[name] = capacity.get(name, 0.0) - amount
    return left


def _check_fits(cfg: Config, plan: ResourcePlan, capacity: dict[str, float]) -> None:
    sc = cfg.scaling
    fewest = sc.worker_range[0]
    for name, amount in plan.per_worker().items():
        have = capacity.get(name, 0.0)
        need = fewest * amount
        if amount <= 0 or need <= have + 1e-9:
            continue
        parts = [f"{plan.worker.get(name, 0):g} for the worker"]
        if plan.reader.get(name):
            parts.append(f"{plan.reader[name]:g} for its data reader")
        fits = int(have // amount + 1e-9)
        fixes = [f"scaling.num_workers={fits}" if fits else "add nodes"]
        if name == "CPU" and not sc.use_gpu:
            room = math.floor((have / fewest - plan.reader_cpus) * 100) / 100
            if room > 0:
                fixes.append(f"scaling.cpus_per_worker={room:g}")
            if plan.reader_cpus and fewest * sc.cpus_per_worker <= have:
                fixes.append("data.reader_cpus=0")
        raise ValueError(
            f"the run needs {need:g} {name}: scaling.num_workers={sc.num_workers} starts "
            f"{fewest} workers x ({' + '.join(parts)}), but the cluster has {have:g}; "
            f"{' or '.join(fixes)} would fit, or set scaling.wait_for_nodes=true if the "
            f"cluster autoscales.")


def plan_benchmarks(cfg: Config, plan: ResourcePlan, capacity: dict[str, float] | None
                    ) -> str | None:
    """The benchmark evaluations' resources (eval.resources) against the cluster's
    ``capacity`` (None: autoscaling): refused when the cluster could never place one, said
    when one cannot be placed beside the training workers (it then waits for them)."""
    if not cfg.eval.tasks or capacity is None:
        return None
    need = cfg.eval.resources
    short = {k: v for k, v in need.items() if v > capacity.get(k, 0.0) + 1e-9}
    if short:
        has = ", ".join(f"{capacity.get(k, 0):g} {k}" for k in short)
        raise ValueError(
            f"eval.resources={need}: the cluster has {has}, so no benchmark evaluation could "
            f"ever start; ask for what a node has, or set scaling.wait_for_nodes=true if the "
            f"cluster autoscales.")
    most = cfg.scaling.worker_range[1]
    training = {k: most * v for k, v in plan.per_worker().items()}
    if any(v + training.get(k, 0.0) > capacity.get(k, 0.0) + 1e-9 for k, v in need.items()):
        return (f"benchmark evaluations (eval.resources={need}) do not fit beside "
                f"{most} training worker(s) on this cluster: each waits for room (at the latest, "
                f"the end of training) while training goes on")
    return None
