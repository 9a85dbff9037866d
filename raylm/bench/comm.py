"""What FSDP2 moves between data-parallel ranks in a training step, how long it takes, and how
much of it hides behind compute; for the default settings and for ``parallel.reduce_dtype`` and
``parallel.prefetch`` changed, with the loss each reaches on the same data.

Each setting runs as its own group of processes (gloo on CPUs; NCCL with one GPU per rank where
the machine has enough GPUs) that build the model through raylm's step core with the setting's
:class:`~raylm.model.parallelize.ParallelPlan`, train ``warmup`` steps, then ``steps`` steps
under ``torch.profiler``. From the profiler's trace, per rank and step:

- ``all_gather_bytes``: the gathered tensors FSDP2 asked for (``c10d::_allgather_base_``'s
  output), in the parameters' compute dtype;
- ``reduce_scatter_bytes``: the unsharded gradient buffers it reduced (``_reduce_scatter_base_``'s
  input), in ``reduce_dtype``. What crosses the wire is (world - 1) / world of each for a ring
  (NCCL); gloo, which has no reduce-scatter, all-reduces the whole buffer instead;
- ``all_reduces``: other collectives (the gradient norm's scalars), counted;
- ``collective_s``: time the collectives ran (gloo's worker threads on CPUs; NCCL's kernels on
  GPUs), as a union of intervals; ``overlapped_share``: the part of it during which the rank
  also computed (aten operators on the training thread on CPUs; other kernels on GPUs), and
  ``exposed_s`` the rest, which the step waited for;
- ``step_s``: the median wall time of a profiled step.

Every setting trains the same model from the same seed on the same batches, so ``loss`` (each
step's) against the default's shows what a setting changes in the numbers.

Written by hand: the profiler records the events, but no library reduces them to bytes and
overlap per FSDP2 step (Holistic Trace Analysis does overlap for CUDA traces only, and is not a
dependency). Needs torch and transformers only (no Ray).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from raylm.model.parallelize import ParallelPlan

VOCAB = 32768
# Bytes per element of the dtypes the profiler names in "Input type".
ELEMENT_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2,
                 "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}
SETTINGS = {"default": {}, "reduce_bf16": {"reduce_dtype": "bf16"},
            "prefetch1": {"prefetch": 1}, "prefetch2": {"prefetch": 2}}


def _numel(dims: Any) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Length of the overlap of two unions of intervals (each sorted, disjoint)."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def trace_figures(events: list[dict[str, Any]], *, steps: int) -> dict[str, float]:
    """Per-step communication figures of one rank's chrome trace events (see the module
    docstring); times in the trace's microseconds, returned in seconds."""
    complete = [e for e in events if e.get("ph") == "X"]
    gathered = scattered = reduces = 0
    main_threads = set()
    for e in complete:
        args = e.get("args", {})
        dims, types = args.get("Input Dims"), args.get("Input type")
        if e["name"] == "c10d::_allgather_base_":
            gathered += _numel(dims[0]) * ELEMENT_BYTES[types[0]]
            main_threads.add(e["tid"])
        elif e["name"] == "c10d::_reduce_scatter_base_":
            scattered += _numel(dims[1]) * ELEMENT_BYTES[types[1]]
            main_threads.add(e["tid"])
        elif e["name"] in ("c10d::allreduce_", "c10d::allreduce_coalesced_"):
            reduces += 1
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    if kernels:  # CUDA: NCCL's kernels against every other kernel
        comm = [e for e in kernels if "nccl" in e["name"].lower()]
        compute = [e for e in kernels if "nccl" not in e["name"].lower()]
    else:  # gloo's threads against the training thread's operators
        comm = [e for e in complete if e["name"].startswith("gloo:")]
        compute = [e for e in complete if e["tid"] in main_threads
                   and e["name"].startswith("aten::")]
    c = _union([(e["ts"], e["ts"] + e["dur"]) for e in comm])
    k = _union([(e["ts"], e["ts"] + e["dur"]) for e in compute])
    busy, hidden = _length(c), _intersection(c, k)
    return {"all_gather_bytes": gathered / steps, "reduce_scatter_bytes": scattered / steps,
            "all_reduces": reduces / steps, "collective_s": busy / 1e6 / steps,
            "overlapped_share": hidden / busy if busy else None,
            "exposed_s": (busy - hidden) / 1e6 / steps}


def train_and_profile(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """On an initialized process group: build, train ``spec["warmup"]`` steps, then profile
    ``spec["steps"]``; this rank's figures and every step's loss."""
    from torch.profiler import ProfilerActivity, profile

    from raylm.workers.optim import build_optimizer
    from raylm.workers.step import build_training_model, train_step

    cuda = spec["device"] == "cuda"
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    plan = ParallelPlan(**spec["plan"])
    built = build_training_model(preset=spec["preset"], path=None, vocab_size=spec["vocab"],
                                 eos_id=0, device=device, precision=spec["precision"],
                                 plan=plan, seed=0)
    opt = build_optimizer(built.model, lr=spec["lr"], weight_decay=0.1, betas=(0.9, 0.95),
                          device_type=device.type)
    share = spec["global_batch"] // world
    micro = min(spec["micro_batch"], share)
    # The same batches in every setting, four of them in turn (rank r's share of step s from
    # seed (s mod 4, r)): a model learns them within steps, so the losses move and show what
    # a setting changes; on fresh random tokens they stay at ln(vocab).
    def batches(step: int) -> list[dict[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(step % 4 * 1000 + rank)
        return [{"input_ids": torch.randint(1, spec["vocab"], (micro, spec["seq_len"] + 1),
                                            generator=gen).to(device)}
                for _ in range(share // micro)]

    def step(s: int) -> float:
        b = batches(s)
        return float(train_step(built, opt, b, accumulation=len(b), grad_clip=1.0)[0])

    losses = [step(s) for s in range(spec["warmup"])]
    times = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for s in range(spec["warmup"], spec["warmup"] + spec["steps"]):
            t0 = time.perf_counter()
            losses.append(step(s))  # float(): waits for the device
            times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    return {**trace_figures(events, steps=spec["steps"]),
            "step_s": statistics.median(times), "losses": losses}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, spec: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    Path(f"{out}.{rank}").write_text(json.dumps(train_and_profile(rank, world, spec)))
    dist.barrier()
    dist.destroy_process_group()


def measure(setting: str, spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    world = spec["workers"]
    out = workdir / f"{setting}.json"
    mp.spawn(_rank, args=(world, _free_port(), {**spec, "plan": SETTINGS[setting]}, str(out)),
             nprocs=world, join=True)
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    return {"plan": SETTINGS[setting], "losses": ranks[0].pop("losses"),
            "ranks": [{k: v for k, v in r.items() if k != "losses"} for r in ranks]}


def run(*, preset: str, workers: int, settings: list[str], seq_len: int, global_batch: int,
        micro_batch: int, warmup: int, steps: int, workdir: str | None) -> dict[str, Any]:
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise ValueError(f"--settings {','.join(unknown)}: choose from {', '.join(SETTINGS)}")
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < workers:
        raise ValueError(f"--workers {workers} needs that many GPUs; the machine has "
                         f"{torch.cuda.device_count()}")
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="raylm-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    spec = {"preset": preset, "workers": workers, "seq_len": seq_len, "vocab": VOCAB,
            "global_batch": global_batch, "micro_batch": micro_batch, "warmup": warmup,
            "steps": steps, "lr": 1e-3, "device": "cuda" if cuda else "cpu",
            "precision": "bf16-mixed" if cuda else "fp32"}
    results = {s: measure(s, spec, root) for s in ["default", *[s for s in settings
                                                               if s != "default"]]}
    base = results["default"]

    def mean(r: dict[str, Any], key: str) -> float | None:
        values = [x[key] for x in r["ranks"] if x[key] is not None]
        return sum(values) / len(values) if values else None

    ratio = {}
    for name, r in results.items():
        if name == "default":
            continue
        ratio[name] = {k: (mean(r, k) / mean(base, k) if mean(base, k) else None)
                       for k in ("all_gather_bytes", "reduce_scatter_bytes", "collective_s",
                                 "exposed_s", "step_s")}
        ratio[name]["max_loss_difference"] = max(
            abs(a - b) for a, b in zip(r["losses"], base["losses"], strict=True))
    return {"benchmark": "comm", "preset": preset, "workers": workers, "vocab_size": VOCAB,
            "seq_len": seq_len, "global_batch": global_batch, "micro_batch": micro_batch,
            "warmup": warmup, "steps": steps, "precision": spec["precision"],
            "backend": "nccl" if cuda else "gloo",
            "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "cpus": os.cpu_count(), "torch": torch.__version__,
            "results": results, "ratio": ratio}
