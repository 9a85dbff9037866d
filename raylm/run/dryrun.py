"""``raylm train --dry-run`` and ``raylm tune --dry-run``: the whole preflight, then what the run
would do and where, said without starting Ray.

Everything here reads the config, the local files and the run directory; nothing joins or
starts a cluster, so a dry run answers in seconds on a laptop for a job meant for a cluster.
What only the cluster can say (how many GPUs it has, whether the workers fit) is said as the
rule the run will apply. The docs test (tests/unit/test_docs.py) runs every documented
``raylm train`` and ``raylm tune`` command through it.
"""

from __future__ import annotations

import os

from raylm import rundir, storage
from raylm.config import Config, batch_plan, model_parallel_group, run_dir
from raylm.contracts import PREPARED_MANIFEST
from raylm.data.corpus import is_prepared_dir, resolve_sources
from raylm.data.preparation import cached_prepared_dir
from raylm.data.streams import READER_CPUS
from raylm.run import cluster
from raylm.run.objectives import objective_of
from raylm.run.preflight import preflight


def describe(cfg: Config, *, sweep: bool = False) -> tuple[Config, list[str]]:
    """The preflight of ``cfg`` (a refusal raises, as the run would): the config it checked
    (hub ids resolved, a sweep's name), and one line each for the cluster, the device, the
    workers, the data, the run directory and the tracking."""
    checked = preflight(cfg, sweep=sweep)
    cfg = checked.cfg
    lines = [_cluster(cfg), _device(cfg), _workers(cfg), _data(cfg), _run(cfg, sweep=sweep)]
    if cfg.parallel.context > 1:
        lines.append(_context(cfg))
    lines += objective_of(cfg).described(cfg)
    if sweep:
        t = cfg.tune
        trials = "every combination once" if t.search == "grid" else f"{t.num_samples} trials"
        lines.append(f"sweep: {t.search} search, {trials}, each a run of {cfg.train.steps} "
                     f"steps")
    lines.append(_tracking(cfg))
    return cfg, lines


def _cluster(cfg: Config) -> str:
    choice = cluster.choose(cfg.run.ray_address, timeout_s=cfg.run.connect_timeout_s)
    if choice.address is None:
        note = f" ({choice.note})" if choice.note else ""
        return f"cluster: a new local Ray cluster on this machine{note}"
    return f"cluster: joins the Ray cluster at {choice.address} ({choice.origin})"


def _device(cfg: Config) -> str:
    use = cfg.scaling.use_gpu
    if use != "auto":
        return (f"device: workers on {'GPUs' if use else 'CPUs'} (scaling.use_gpu="
                f"{str(use).lower()})")
    import torch

    here = torch.cuda.device_count()
    return (f"device: workers on GPUs if the cluster has any, else on CPUs (scaling.use_gpu="
            f"auto; this machine has {here or 'no'} CUDA GPU{'s' if here != 1 else ''})")


def _workers(cfg: Config) -> str:
    sc, t = cfg.scaling, cfg.train
    fewest, most = sc.worker_range
    count = f"{fewest}" if fewest == most else f"{fewest} to {most}"
    group, named = model_parallel_group(cfg)
    micro, accumulation = batch_plan(t.global_batch_size, t.micro_batch_size, most // group)
    layout = f", {named}" if group > 1 else ""
    reader = (f"{cfg.data.reader_cpus:g}" if cfg.data.reader_cpus is not None
              else f"{READER_CPUS:g} (0 where the CPUs are short)")
    gpu = {True: " + 1 GPU", False: "", "auto": " (+ 1 GPU on GPUs)"}[sc.use_gpu]
    return (f"workers: {count} x {sc.cpus_per_worker:g} CPU{gpu}{layout}, each with a data "
            f"reader of {reader} CPU; global batch {t.global_batch_size} sequences of "
            f"{cfg.data.seq_len} tokens ({micro} x {accumulation} accumulation per "
            f"data-parallel rank at {most} worker{'s' if most > 1 else ''})")


def _context(cfg: Config) -> str:
    """How a sequence splits over a context-parallel group, and what attention holds."""
    from raylm.model.build import Shape
    from raylm.model.spec import ModelSpec

    n, length = cfg.parallel.context, cfg.data.seq_len
    shape = Shape.of(ModelSpec.from_config(cfg, vocab_size=1, eos_id=0)
                     .transformers_config("eager"))
    width = 4 if cfg.train.precision == "fp32" else 2
    # q and the output for heads / n, k and v for as many key/value heads (repeated to one
    # per head where they do not split), over the whole sequence.
    kv = shape.kv_heads if shape.kv_heads % n == 0 else shape.heads
    held = length * shape.head_dim * (2 * shape.heads + 2 * kv) // n * width
    return (f"context: each sequence's {length} tokens over {n} workers (parallel.context="
            f"{n}), {length // n} each; inside attention each holds the whole sequence for "
            f"{shape.heads // n} of {shape.heads} heads: q, k, v and the output "
            f"{held / 2**20:.1f} MB per block and sequence, exchanged (all-to-all) twice "
            f"forward and twice backward")


def _data(cfg: Config) -> str:
    d = cfg.data
    if is_prepared_dir(d.source):
        return f"data: the prepared directory {d.source}"
    sources = [d.source] if isinstance(d.source, str) else d.source
    if any(str(s).startswith("hf:") for s in sources):
        return (f"data: {', '.join(map(str, sources))} ({d.format}), fetched from the Hugging "
                f"Face hub when the run prepares it")
    files = resolve_sources(d.source, builtin_packages=d.builtin_packages, hf_split=d.hf_split)
    size = sum(os.path.getsize(f.path) for f in files)
    target = cached_prepared_dir(cfg, files)
    done = ((target / PREPARED_MANIFEST).is_file() and f"prepared already in {target}"
            or f"prepared into {target} when the run starts (Ray tasks)")
    return (f"data: {len(files):,} file{'s' if len(files) != 1 else ''} of {d.format}, "
            f"{size / 1e6:.1f} MB; {done}")


def _run(cfg: Config, *, sweep: bool) -> str:
    rd = run_dir(cfg)
    where = storage.redact(rd)
    if sweep:
        if rundir.tune_experiment(rd) is not None:
            return f"run: resumes the sweep in {where}"
        return f"run: a new sweep in {where}"
    from raylm.run.launch import base_model_identity, finished

    rundir.check_ray_state(rd)
    found = rundir.latest_usable(rd, bad=rundir.read_manifest(rd)["bad_checkpoints"],
                                 warn=lambda m: None)
    if found is None:
        return f"run: a new run in {where} (run.name={cfg.run.name})"
    path, marker = found
    step = marker.step
    # The base model is the one part of a run's identity known before the data is prepared;
    # the rest is compared when the run starts.
    if marker.identity:
        rundir.check_same_run(marker, {**marker.identity,
                                       "base_model": base_model_identity(cfg)},
                              str(path), accept=cfg.checkpoint.accept_changes)
    if finished(cfg, found) is not None:
        return (f"run: {where} has trained its {step} steps already: nothing to do (raise "
                f"train.steps to train on)")
    return f"run: resumes {where} from step {step} of {cfg.train.steps}"


def _tracking(cfg: Config) -> str:
    if not cfg.tracking.enabled:
        return "tracking: off (tracking.enabled=false)"
    from raylm.run.tracking import resolve_uri

    return (f"tracking: MLflow at {storage.redact(resolve_uri(cfg))}, experiment "
            f"{cfg.tracking.experiment}")
