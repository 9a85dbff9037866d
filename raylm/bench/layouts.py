"""Per-rank memory and step time of one model under each parallel layout, side by side.

Each layout runs as its own group of processes (gloo on CPUs; NCCL with one GPU per rank where
the machine has enough GPUs, else the layout is skipped and says so) that build the model
through raylm's own step core (:func:`raylm.model.assemble.build_training_model`: FSDP2 over ``dp``,
tensor parallelism over ``tp``, pipeline stages over ``pp``), then take ``steps`` AdamW steps
on random tokens, every layout with the same global batch. Per layout, on the rank that holds
most: parameter and optimizer-state memory (what the layouts divide), peak memory (CUDA
allocator peak; peak RSS on CPUs, which counts the libraries too) and the median step time
after the first. The baseline, measured in the same run, is one process holding the whole
model (``whole``); ``ratio`` is each layout's figure over the baseline's.

Needs torch and transformers only (no Ray): it runs on the GPU machines as they are.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from raylm.model.parallelize import ParallelPlan, layout_of

# The vocabulary raylm's GPU configs train for the 125m preset and up.
VOCAB = 32768
_DEGREE = re.compile(r"^(dp|tp|pp)(\d+)$")


def parse_layout(name: str) -> dict[str, int]:
    """``dp2xtp2`` -> {"dp": 2, "tp": 2, "pp": 1}; ``whole`` is one process."""
    degrees = {"dp": 1, "tp": 1, "pp": 1}
    if name == "whole":
        return degrees
    for part in name.split("x"):
        m = _DEGREE.match(part)
        if not m:
            raise ValueError(f"layout {name!r}: write degrees as dp2, tp2, pp2 joined by x "
                             f"(dp2xtp2), or 'whole'")
        degrees[m[1]] = int(m[2])
    return degrees


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rank(rank: int, world: int, port: int, device_type: str) -> torch.device:
    """This benchmark process's device (GPU ``rank`` on CUDA), its share of the CPU threads,
    and, with other ranks, its process group (NCCL on CUDA, else gloo) on loopback."""
    import torch.distributed as dist

    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    return torch.device(f"cuda:{rank}" if cuda else "cpu")


def _rank(rank: int, world: int, port: int, spec: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    from raylm.model.assemble import build_training_model
    from raylm.workers.metrics import peak_memory_bytes, state_memory_bytes
    from raylm.workers.optim import build_optimizer
    from raylm.workers.step import train_step

    device = start_rank(rank, world, port, spec["device"])
    plan = ParallelPlan(tensor=spec["tp"], pipeline=spec["pp"])
    lay = layout_of(rank, world, plan)
    built = build_training_model(preset=spec["preset"], path=None, vocab_size=VOCAB, eos_id=0,
                                 device=device, precision=spec["precision"], plan=plan,
                                 seed=0)
    opt = build_optimizer(built.model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95),
                          device_type=device.type)
    share = spec["global_batch"] // lay.dp_size
    micro = min(spec["micro_batch"], share // lay.pp_size)
    gen = torch.Generator().manual_seed(lay.dp_rank)
    times = []
    for _ in range(spec["steps"]):
        batches = [{"input_ids": torch.randint(1, VOCAB, (micro, spec["seq_len"] + 1),
                                               generator=gen)}
                   for _ in range(share // micro)]
        t0 = time.perf_counter()
        loss, _ = train_step(built, opt, batches, accumulation=len(batches), grad_clip=1.0)
        float(loss)  # waits for the device
        times.append(time.perf_counter() - t0)
    held = torch.tensor([*state_memory_bytes(built.model, opt), peak_memory_bytes(device)],
                        dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
    if rank == 0:
        params, optim, peak = (float(x) / 2**30 for x in held.tolist())
        step_s = statistics.median(times[1:] or times)
        Path(out).write_text(json.dumps({
            "workers": world, "param_gb": params, "optimizer_gb": optim, "peak_gb": peak,
            "step_s": step_s,
            "tokens_per_s": spec["global_batch"] * spec["seq_len"] / step_s}))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def measure(name: str, spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    degrees = parse_layout(name)
    world = degrees["dp"] * degrees["tp"] * degrees["pp"]
    if spec["device"] == "cuda" and torch.cuda.device_count() < world:
        return {"skipped": f"needs {world} GPUs, the machine has {torch.cuda.device_count()}"}
    out = workdir / f"{name}.json"
    args = (world, _free_port(), {**spec, **degrees}, str(out))
    # A process of its own even alone: Linux keeps a parent's peak RSS in its children's
    # figures (ru_maxrss survives fork and exec), so the parent must build no model.
    mp.spawn(_rank, args=args, nprocs=world, join=True)
    return json.loads(out.read_text())


def run(*, preset: str, layouts: list[str], seq_len: int, global_batch: int,
        micro_batch: int, steps: int, workdir: str | None) -> dict[str, Any]:
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="raylm-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    spec = {"preset": preset, "seq_len": seq_len, "global_batch": global_batch,
            "micro_batch": micro_batch, "steps": steps, "device": "cuda" if cuda else "cpu",
            "precision": "bf16-mixed" if cuda else "fp32"}
    results = {name: measure(name, spec, root) for name in ["whole", *layouts]}
    whole = results["whole"]
    ratio = {name: {k: r[k] / whole[k] for k in ("param_gb", "optimizer_gb", "peak_gb",
                                                 "step_s")}
             for name, r in results.items() if name != "whole" and "skipped" not in r}
    return {"benchmark": "layouts", "preset": preset, "vocab_size": VOCAB,
            "seq_len": seq_len, "global_batch": global_batch, "micro_batch": micro_batch,
            "steps": steps, "precision": spec["precision"],
            "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "cpus": os.cpu_count(), "torch": torch.__version__,
            "results": results, "ratio": ratio}
