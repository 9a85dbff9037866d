"""Long sequences split over ranks (``parallel.context``): tokens/s, peak memory per rank and
the all-to-all's bytes and time, at each sequence length and degree.

    python -m raylm.bench context --output runs/bench-context.json [--presets tiny,125m]
        [--lengths tiny:2048,8192,32768;125m:2048,4096] [--contexts 1,2] [--steps 3]
        [--cap-gb 2] [--documents packed] [--checkpointing on]

For each preset, length and degree N, N gloo processes (NCCL with a GPU each where the
machine has them) build the model through raylm's step core, with activation checkpointing
unless ``--checkpointing off``, and take ``steps`` AdamW steps on one sequence of random
tokens: ``packed``, four documents of random lengths attending within themselves
(per-document attention, as packed training runs); ``whole``, one document. N = 1 is the
baseline, measured in the same run. Per entry, on the rank that holds most: the step's
median seconds after the first and tokens/s; the peak memory the steps added to what the
built model held (CUDA allocator peak; peak RSS on CPUs); the bytes of the tensors its
forward saved for backward (``saved_gb``, each storage once: without checkpointing all of
them are held when the forward ends, so this is the activations' memory, free of the
allocator's and the libraries' share); and, for N > 1, the bytes each rank sent through a
step's all-to-alls and their seconds. ``longest``: per degree, the longest length whose peak
stayed within ``--cap-gb``.

Needs torch and transformers only (no Ray). Written by hand: no library measures a
context-parallel step by length on any backend.
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

from raylm.bench.layouts import VOCAB, _free_port, start_rank


def _rank(rank: int, world: int, port: int, spec: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    from raylm.model import context
    from raylm.model.assemble import build_training_model
    from raylm.model.parallelize import ParallelPlan
    from raylm.workers.metrics import peak_memory_bytes
    from raylm.workers.optim import build_optimizer
    from raylm.workers.step import train_step

    device = start_rank(rank, world, port, spec["device"])
    cuda = device.type == "cuda"
    plan = ParallelPlan(context=world, activation_checkpointing=spec["checkpointing"])
    across = spec["documents"] == "whole"
    built = build_training_model(preset=spec["preset"], path=None, vocab_size=VOCAB, eos_id=0,
                                 device=device, precision=spec["precision"], plan=plan,
                                 seed=0, cross_document=across)
    opt = build_optimizer(built.model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95),
                          device_type=device.type)
    length = spec["length"]
    gen = torch.Generator().manual_seed(0)  # every rank the same sequence
    starts = [0] if across else sorted({0, *torch.randint(1, length, (3,), generator=gen)
                                        .tolist()})
    positions = torch.tensor([t - max(s for s in starts if s <= t) for t in range(length + 1)])
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    before = peak_memory_bytes(device) if cuda else _rss()
    times, exchanged = [], []
    # The activations the forward keeps for backward: each storage once, by its address.
    saved: dict[int, int] = {}

    def saving(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    for _ in range(spec["steps"]):
        batch = {"input_ids": torch.randint(1, VOCAB, (1, length + 1), generator=gen),
                 "position_ids": positions[None]}
        context.EXCHANGED.update(bytes=0, seconds=0.0)
        saved.clear()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saving, lambda t: t):
            loss, _ = train_step(built, opt, [batch], accumulation=1, grad_clip=1.0,
                                 cross_document=across)
        float(loss)  # waits for the device
        times.append(time.perf_counter() - t0)
        exchanged.append(dict(context.EXCHANGED))
    held = torch.tensor([peak_memory_bytes(device) - before, sum(saved.values())],
                        dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
    if rank == 0:
        step_s = statistics.median(times[1:] or times)
        Path(out).write_text(json.dumps({
            "context": world, "length": length, "step_s": step_s,
            "tokens_per_s": length / step_s, "peak_gb": float(held[0]) / 2**30,
            "saved_gb": float(held[1]) / 2**30,
            "exchanged_mb": exchanged[-1]["bytes"] / 2**20 if world > 1 else 0.0,
            "exchange_s": exchanged[-1]["seconds"] if world > 1 else 0.0}))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _rss() -> int:
    """This process's resident memory now (the steps' peak RSS is measured from it)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    world = spec["context"]
    if spec["device"] == "cuda" and torch.cuda.device_count() < world:
        return {"skipped": f"needs {world} GPUs, the machine has {torch.cuda.device_count()}"}
    out = workdir / f"{spec['preset']}-{spec['length']}-{world}.json"
    # A process of its own even alone, as in raylm.bench.layouts: a parent's peak RSS would
    # reach its children's figures.
    mp.spawn(_rank, args=(world, _free_port(), spec, str(out)), nprocs=world, join=True)
    return json.loads(out.read_text())


def parse_lengths(text: str, presets: list[str]) -> dict[str, list[int]]:
    """``tiny:2048,8192;125m:2048`` -> lengths per preset (one list for all without names)."""
    if ":" not in text:
        return {p: [int(x) for x in text.split(",")] for p in presets}
    named = dict(part.split(":", 1) for part in text.split(";"))
    return {p: [int(x) for x in named[p].split(",")] for p in presets}


def run(*, presets: list[str], lengths: dict[str, list[int]], contexts: list[int],
        steps: int, cap_gb: float, documents: str, checkpointing: bool,
        workdir: str | None) -> dict[str, Any]:
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="raylm-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    results: dict[str, list[dict[str, Any]]] = {}
    for preset in presets:
        results[preset] = []
        for length in lengths[preset]:
            for n in contexts:
                spec = {"preset": preset, "length": length, "context": n, "steps": steps,
                        "documents": documents, "checkpointing": checkpointing,
                        "device": "cuda" if cuda else "cpu",
                        "precision": "bf16-mixed" if cuda else "fp32"}
                got = measure(spec, root)
                base = next((r for r in results[preset] if r.get("length") == length
                             and r.get("context") == contexts[0]), None)
                if base is not None and "skipped" not in got:
                    got["ratio"] = {k: got[k] / base[k] for k in ("tokens_per_s", "peak_gb",
                                                                  "saved_gb")}
                results[preset].append(got)
                print(json.dumps({"preset": preset, **got}), flush=True)
    longest = {preset: {n: max((r["length"] for r in rows if r.get("context") == n
                                and r["peak_gb"] <= cap_gb), default=None)
                        for n in contexts}
               for preset, rows in results.items()}
    return {"benchmark": "context", "vocab_size": VOCAB, "documents": documents,
            "activation_checkpointing": checkpointing, "steps": steps, "cap_gb": cap_gb,
            "precision": "bf16-mixed" if cuda else "fp32",
            "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "cpus": os.cpu_count(), "torch": torch.__version__, "results": results,
            "longest": longest}


def from_args(args) -> dict[str, Any]:
    """:func:`run` with ``python -m raylm.bench context``'s arguments."""
    presets = args.presets.split(",")
    return run(presets=presets, lengths=parse_lengths(args.lengths, presets),
               contexts=[int(x) for x in args.contexts.split(",")], steps=args.steps,
               cap_gb=args.cap_gb, documents=args.documents,
               checkpointing=args.checkpointing == "on", workdir=args.workdir)
