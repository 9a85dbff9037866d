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

The ``ddp_*`` settings are pure data parallelism without sharding (torch's
DistributedDataParallel, every rank holding the whole model), where gradient compression hooks
exist: the fp32 all-reduce (``ddp_fp32``, their baseline), a bf16 all-reduce (what torch's
``bf16_compress_hook`` does, which runs on NCCL only), and PowerSGD (Vogels et al. 2019;
torch's hook, ranks 1 and 4, error feedback, after 2 uncompressed steps). Their
``all_reduce_bytes`` are the buffers all-reduced (gloo's or NCCL's own record of each call),
which is what PowerSGD shrinks; the same batches, so their losses compare with the fp32
all-reduce's. raylm trains every multi-worker run with FSDP2, whose reduce-scatter no PowerSGD
hook exists for: this side says what compression would give, to decide whether to build it.

Written by hand: the profiler records the events, but no library reduces them to bytes and
overlap per FSDP2 step (Holistic Trace Analysis does overlap for CUDA traces only, and is not a
dependency). Needs torch and transformers only (no Ray).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from raylm.bench.layouts import VOCAB, _free_port
from raylm.model.parallelize import ParallelPlan

# Bytes per element of the dtypes the profiler names: in "Input type" (operators, gloo), and
# as NCCL's record_param_comms spells them in "dtype" (not yet seen on a GPU by this project).
ELEMENT_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2,
                 "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
                 "Float": 4, "Double": 8, "BFloat16": 2, "Half": 2}
SETTINGS = {"default": {}, "reduce_bf16": {"reduce_dtype": "bf16"},
            "prefetch1": {"prefetch": 1}, "prefetch2": {"prefetch": 2},
            "ddp_fp32": {"ddp": None}, "ddp_bf16": {"ddp": "bf16"},
            "ddp_powersgd1": {"ddp": "powersgd1"}, "ddp_powersgd4": {"ddp": "powersgd4"}}


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


def allreduce_bytes(events: list[dict[str, Any]]) -> int:
    """Bytes of every all-reduce in a trace, from the backend's own record of each call: gloo's
    ``gloo:all_reduce`` (its buffer's dims and type), NCCL's ``record_param_comms``."""
    total = 0
    for e in events:
        args = e.get("args", {})
        if e.get("ph") != "X":
            continue
        if e["name"] == "gloo:all_reduce":
            total += _numel(args["Input Dims"][0]) * ELEMENT_BYTES[args["Input type"][0]]
        elif (e["name"] == "record_param_comms"
              and args.get("Collective name") in ("allreduce", "allreduce_coalesced")):
            total += args["In msg nelems"] * ELEMENT_BYTES.get(args.get("dtype"), 0)
    return total


def _profiled(step, *, first: int, steps: int, cuda: bool) -> tuple[list[float], list[float],
                                                                     list[dict[str, Any]]]:
    """``step(s)`` for s in [first, first + steps) under the profiler: losses, wall times and
    the trace's events."""
    from torch.profiler import ProfilerActivity, profile

    losses, times = [], []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for s in range(first, first + steps):
            t0 = time.perf_counter()
            losses.append(step(s))  # float(): waits for the device
            times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    return losses, times, events


def _batches(spec: dict[str, Any], *, rank: int, world: int, device: torch.device):
    """Rank ``rank``'s micro-batches of step s, the same in every setting: four fixed global
    batches in turn (seed (s mod 4, r)). A model learns them within steps, so the losses move
    and show what a setting changes; on fresh random tokens they stay at ln(vocab)."""
    share = spec["global_batch"] // world
    micro = min(spec["micro_batch"], share)

    def batches(step: int) -> list[dict[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(step % 4 * 1000 + rank)
        return [{"input_ids": torch.randint(1, spec["vocab"], (micro, spec["seq_len"] + 1),
                                            generator=gen).to(device)}
                for _ in range(share // micro)]
    return batches


def train_and_profile(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """On an initialized process group: build, train ``spec["warmup"]`` steps, then profile
    ``spec["steps"]``; this rank's figures and every step's loss."""
    from raylm.model.assemble import build_training_model
    from raylm.workers.optim import build_optimizer
    from raylm.workers.step import train_step

    cuda = spec["device"] == "cuda"
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    built = build_training_model(preset=spec["preset"], path=None, vocab_size=spec["vocab"],
                                 eos_id=0, device=device, precision=spec["precision"],
                                 plan=ParallelPlan(**spec["plan"]), seed=0)
    opt = build_optimizer(built.model, lr=spec["lr"], weight_decay=0.1, betas=(0.9, 0.95),
                          device_type=device.type)
    batches = _batches(spec, rank=rank, world=world, device=device)

    def step(s: int) -> float:
        b = batches(s)
        return float(train_step(built, opt, b, accumulation=len(b), grad_clip=1.0)[0])

    losses = [step(s) for s in range(spec["warmup"])]
    more, times, events = _profiled(step, first=spec["warmup"], steps=spec["steps"], cuda=cuda)
    return {**trace_figures(events, steps=spec["steps"]),
            "step_s": statistics.median(times), "losses": losses + more}


def _bf16_allreduce(group, bucket):
    """DDP's bucket averaged in bf16: torch's ``bf16_compress_hook`` does the same but refuses
    to run outside NCCL, and gloo sums bf16 too."""
    import torch.distributed as dist

    flat = bucket.buffer()
    half = flat.to(torch.bfloat16).div_(dist.get_world_size(group))
    done = dist.all_reduce(half, group=group, async_op=True).get_future()

    def unpack(fut):
        flat.copy_(fut.value()[0])
        return flat
    return done.then(unpack)


def ddp_and_profile(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """As :func:`train_and_profile`, for the whole model under DistributedDataParallel with
    ``spec["hook"]``'s gradient compression (None: fp32 all-reduce)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel

    from raylm.model.build import build_meta_model, init_weights, materialize
    from raylm.model.spec import ModelSpec

    cuda = spec["device"] == "cuda"
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    config = ModelSpec(preset=spec["preset"], vocab_size=spec["vocab"], eos_id=0
                       ).transformers_config()
    model = materialize(build_meta_model(config), device)
    init_weights(model, seed=0, num_layers=config.num_hidden_layers)
    # One bucket: PowerSGD chains each bucket's all-reduces through futures, and with several
    # buckets gloo ran them in different orders on different ranks (a size mismatch abort).
    # Every DDP setting gets the same bucketing, so they compare; none overlaps its reduce.
    ddp = DistributedDataParallel(model, device_ids=[rank] if cuda else None,
                                  bucket_cap_mb=2**16)
    hook, state = spec["hook"], None
    if hook == "bf16":
        ddp.register_comm_hook(dist.group.WORLD, _bf16_allreduce)
    elif hook is not None:  # "powersgd<rank>"
        state = powersgd.PowerSGDState(process_group=None,
                                       matrix_approximation_rank=int(hook[len("powersgd"):]),
                                       start_powerSGD_iter=2, use_error_feedback=True,
                                       warm_start=True, random_seed=0)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.1,
                            betas=(0.9, 0.95))
    batches = _batches(spec, rank=rank, world=world, device=device)

    def step(s: int) -> float:
        micro = batches(s)
        total = torch.zeros((), device=device)
        for i, b in enumerate(micro):
            ids = b["input_ids"]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                logits = ddp(input_ids=ids[:, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
            # Gradients are all-reduced at the last micro-batch's backward only.
            if i < len(micro) - 1:
                with ddp.no_sync():
                    (loss / len(micro)).backward()
            else:
                (loss / len(micro)).backward()
            total += loss.detach() / len(micro)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        return float(total) / world

    losses = [step(s) for s in range(spec["warmup"])]
    more, times, events = _profiled(step, first=spec["warmup"], steps=spec["steps"], cuda=cuda)
    figures = {k: v for k, v in trace_figures(events, steps=spec["steps"]).items()
               if k in ("collective_s", "overlapped_share", "exposed_s")}
    sent = allreduce_bytes(events) / spec["steps"]
    if state is not None:
        # PowerSGD all-reduces each bucket's P and Q from its futures' callbacks, on threads
        # the profiler does not follow: their bytes are the factors it keeps (warm start), its
        # collective time is not seen, and only the step's wall time says what it costs.
        sent += sum(t.numel() * t.element_size() for memory in (state.p_memory_dict,
                                                                 state.q_memory_dict)
                    for t in memory.values())
        figures = {k: None for k in figures}
    return {"all_reduce_bytes": sent, **figures, "step_s": statistics.median(times),
            "losses": losses + more}


def _rank(rank: int, world: int, port: int, spec: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    if "ddp" in spec["plan"]:
        figures = ddp_and_profile(rank, world, {**spec, "hook": spec["plan"]["ddp"]})
    else:
        figures = train_and_profile(rank, world, spec)
    Path(f"{out}.{rank}").write_text(json.dumps(figures))
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
    wanted = list(dict.fromkeys(
        (["default"] if any("ddp" not in SETTINGS[s] for s in settings) else [])
        + (["ddp_fp32"] if any("ddp" in SETTINGS[s] for s in settings) else []) + settings))
    results = {s: measure(s, spec, root) for s in wanted}

    def mean(r: dict[str, Any], key: str) -> float | None:
        values = [x[key] for x in r["ranks"] if x.get(key) is not None]
        return sum(values) / len(values) if values else None

    ratio = {}
    for name, r in results.items():
        # Each side against its own baseline: FSDP2's defaults, or DDP's fp32 all-reduce.
        base = results["ddp_fp32" if "ddp" in SETTINGS[name] else "default"]
        if r is base:
            continue
        ratio[name] = {k: (mean(r, k) / mean(base, k)
                           if mean(base, k) and mean(r, k) is not None else None)
                       for k in ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes",
                                 "collective_s", "exposed_s", "step_s")
                       if mean(base, k) is not None}
        ratio[name]["max_loss_difference"] = max(
            abs(a - b) for a, b in zip(r["losses"], base["losses"], strict=True))
    return {"benchmark": "comm", "preset": preset, "workers": workers, "vocab_size": VOCAB,
            "seq_len": seq_len, "global_batch": global_batch, "micro_batch": micro_batch,
            "warmup": warmup, "steps": steps, "precision": spec["precision"],
            "backend": "nccl" if cuda else "gloo",
            "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "cpus": os.cpu_count(), "torch": torch.__version__,
            "results": results, "ratio": ratio}
