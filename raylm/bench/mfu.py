"""Training throughput and MFU on one GPU: raylm's step core against a bare PyTorch loop.

    python -m raylm.bench mfu --output runs/bench-mfu.json [--presets 125m,350m,1b]
        [--seq-len 2048] [--compile off,on] [--profile 1b]

Needs torch and transformers only (no Ray, MLflow or datasets), so it runs on any machine with
a CUDA GPU. For each preset and each compile setting, in one process and on the same random
tokens (blocks of ``seq_len + 1``, pinned host memory, as a data loader delivers them):

- raylm: :func:`raylm.model.assemble.build_training_model` (bf16-mixed, the attention kernel raylm
  pins, its initialization), :func:`raylm.workers.optim.build_optimizer` (fused AdamW), and per step
  what a worker does besides fetching data: the learning rate from the schedule,
  :func:`raylm.workers.step.train_step` (clipping included), the preemption vote, and the loss read
  back every ``--log-every`` steps.
- bare: the same architecture from ``transformers`` on the GPU, fp32 weights under bf16
  autocast, the same SDPA kernel pinned, fused AdamW, the same per-block compile, and
  ``loss.backward(); clip; step; zero_grad`` in a ``for`` loop that never reads a value back.

Both are timed over ``--steps`` steps after ``--warmup`` steps and at least 3 s (compilation,
the allocator's growth and the GPU's clock ramp happen there). ``ratio`` = raylm / bare tokens
per second. MFU counts the model's FLOPs (:func:`raylm.workers.metrics.flops_per_token`) against the
device's dense bf16 peak. The micro batch starts at ``--micro-batch`` and halves while the
raylm side runs out of memory; both sides use the one that fits. Energy per token is read from
NVML over the timed steps (:mod:`raylm.workers.energy`).
``breakdown`` times forward, backward and the optimizer of the raylm
side separately (synchronising between them, so their sum exceeds a free-running step).
"""

from __future__ import annotations

import gc
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from raylm.config import OptimConfig
from raylm.model.assemble import Built, batch_loss, build_training_model
from raylm.model.parallelize import ParallelPlan
from raylm.schedule import lr_at
from raylm.workers import preemption
from raylm.workers.energy import EnergyCounter
from raylm.workers.metrics import bf16_peak, flops_per_token
from raylm.workers.optim import build_optimizer, set_lr
from raylm.workers.step import clip_grad_norm, train_step

# The bench's schedule: cosine from 3e-4 after 10 warmup steps, down to 0.
SCHEDULE = OptimConfig(lr=3e-4, warmup_steps=10, min_lr_ratio=0.0)

VOCAB = 32000  # a Llama-2-sized vocabulary (padded to 32,000: already a multiple of 64)
MICRO_BATCH = {"tiny": 8, "125m": 16, "350m": 16, "1b": 8}


def _sync() -> None:
    torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def make_batches(n: int, *, micro_batch: int, seq_len: int, seed: int = 0
                 ) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, VOCAB, (micro_batch, seq_len + 1),
                                        generator=gen).pin_memory()} for _ in range(n)]


WARMUP_S = 3.0  # an idle GPU takes a second or two to reach its full clock


def timed(step: Callable[[int], None], *, warmup: int, steps: int, device: torch.device
          ) -> dict[str, float]:
    """Run ``step(i)`` for at least ``warmup`` iterations and ``WARMUP_S`` seconds, then time
    and meter ``steps`` more."""
    i, t0 = 0, time.perf_counter()
    while i < warmup or time.perf_counter() - t0 < WARMUP_S:
        step(i)
        i += 1
        if i >= warmup:
            _sync()
    warmup = i
    energy = EnergyCounter(device)
    j0 = energy.read()
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    _sync()
    seconds = time.perf_counter() - t0
    j1 = energy.read()
    return {"seconds": seconds, "joules": None if j0 is None or j1 is None else j1 - j0}


def raylm_side(preset: str, *, micro_batch: int, seq_len: int, plan: ParallelPlan,
               warmup: int, steps: int, log_every: int, batches: list,
               sync_every_step: bool = False) -> dict[str, Any]:
    device = torch.device("cuda")
    built = build_training_model(preset=preset, path=None, vocab_size=VOCAB, eos_id=0,
                                 device=device, precision="bf16-mixed", plan=plan)
    opt = build_optimizer(built.model, lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95),
                          device_type="cuda")
    vote = preemption.Vote(device)
    total = warmup + steps
    losses: list[float] = []
    loss_at: dict[int, float] = {}

    def step(i: int) -> None:
        set_lr(opt, lr_at(i, SCHEDULE, total=total))
        loss, norm = train_step(built, opt, [batches[i % len(batches)]], accumulation=1,
                                grad_clip=1.0)
        vote()
        if sync_every_step:  # what the loop did before: loss and norm as floats each step
            float(loss), float(norm)
        if (i + 1) % log_every == 0:
            losses.append(float(loss))
            loss_at[i + 1] = losses[-1]

    out = timed(step, warmup=warmup, steps=steps, device=device)
    out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    out["params"] = sum(p.numel() for p in built.model.parameters())
    out["attention_backend"] = built.attention.backend
    out["losses"] = [round(v, 4) for v in losses]
    out["loss_at_step"] = {k: round(v, 5) for k, v in loss_at.items()}
    out["breakdown_ms"] = breakdown(built, opt, batches)
    return out | {"built": built, "optimizer": opt}


def breakdown(built: Built, opt: torch.optim.Optimizer, batches: list, n: int = 3
              ) -> dict[str, float]:
    """Forward, backward and optimizer time of the raylm step, each synchronised (ms)."""
    parts = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    for i in range(n):
        _sync()
        t0 = time.perf_counter()
        loss = batch_loss(built, batches[i], cross_document=True)
        _sync()
        t1 = time.perf_counter()
        loss.backward()
        _sync()
        t2 = time.perf_counter()
        clip_grad_norm(built.model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync()
        t3 = time.perf_counter()
        parts["forward"] += t1 - t0
        parts["backward"] += t2 - t1
        parts["optimizer"] += t3 - t2
    return {k: round(1000 * v / n, 2) for k, v in parts.items()}


def bare_side(config, *, compile_blocks: bool, sdpa_context: Callable, warmup: int,
              steps: int, batches: list) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda")
    with device:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()
    if compile_blocks:
        for layer in model.model.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                            weight_decay=0.1, fused=True)

    def step(i: int) -> None:
        tokens = batches[i % len(batches)]["input_ids"].to(device, non_blocking=True)
        with sdpa_context(), torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                               tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = timed(step, warmup=warmup, steps=steps, device=device)
    out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def _figures(side: dict[str, Any], *, tokens: int, flops_token: float, peak: float | None
             ) -> dict[str, Any]:
    tok_s = tokens / side["seconds"]
    keep = {k: v for k, v in side.items() if k not in ("built", "optimizer", "seconds",
                                                       "joules")}
    return {
        "tokens_per_s": round(tok_s),
        "mfu": None if peak is None else round(tok_s * flops_token / peak, 4),
        "joules_per_token": (None if side["joules"] is None
                             else round(side["joules"] / tokens, 5)),
        "watts": (None if side["joules"] is None
                  else round(side["joules"] / side["seconds"], 1)),
        **keep,
    }


def one_preset(preset: str, *, seq_len: int, compile_blocks: bool, micro_batch: int,
               warmup: int, steps: int, log_every: int, synced: bool = False
               ) -> dict[str, Any]:
    peak = bf16_peak(torch.cuda.get_device_name())
    plan = ParallelPlan(compile=compile_blocks)
    mb = micro_batch
    while True:
        batches = make_batches(8, micro_batch=mb, seq_len=seq_len)
        try:
            _free()
            ours = raylm_side(preset, micro_batch=mb, seq_len=seq_len, plan=plan,
                              warmup=warmup, steps=steps, log_every=log_every,
                              batches=batches)
            break
        except torch.OutOfMemoryError:
            if mb == 1:
                raise
            mb //= 2
    config = ours["built"].config
    context = ours["built"].attention.context
    del ours["built"], ours["optimizer"]
    _free()
    bare = bare_side(config, compile_blocks=compile_blocks, sdpa_context=context,
                     warmup=warmup, steps=steps, batches=batches)
    _free()
    fpt = flops_per_token(config, seq_len)
    tokens = steps * mb * seq_len
    a = _figures(ours, tokens=tokens, flops_token=fpt, peak=peak)
    b = _figures(bare, tokens=tokens, flops_token=fpt, peak=peak)
    for side, raw in ((a, ours), (b, bare)):
        side["step_ms"] = round(1000 * raw["seconds"] / steps, 1)
    params = a.pop("params")
    out = {"preset": preset, "compile": compile_blocks, "micro_batch": mb,
           "seq_len": seq_len, "params": params, "flops_per_token": fpt,
           "raylm": a, "bare": b, "ratio": round(a["tokens_per_s"] / b["tokens_per_s"], 3)}
    if synced:
        # The same raylm step reading loss and gradient norm back at every step.
        s = raylm_side(preset, micro_batch=mb, seq_len=seq_len, plan=plan, warmup=warmup,
                       steps=steps, log_every=log_every, batches=batches,
                       sync_every_step=True)
        del s["built"], s["optimizer"]
        _free()
        tok_s = tokens / s["seconds"]
        out["raylm_synced_each_step"] = {"tokens_per_s": round(tok_s),
                                         "ratio_to_bare": round(tok_s / b["tokens_per_s"], 3)}
    return out


def per_document(preset: str, *, seq_len: int, micro_batch: int, warmup: int, steps: int,
                 mean_doc: int = 512) -> dict[str, Any]:
    """Per-document attention (cross_document false) with each kernel raylm can use without
    flash-attn: tokens/s and peak memory of the raylm step."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(8):
        ids = torch.randint(1, VOCAB, (micro_batch, seq_len + 1), generator=gen)
        pos = torch.empty_like(ids)
        for r in range(micro_batch):
            cuts = torch.randint(1, mean_doc * 2, (seq_len,), generator=gen).cumsum(0)
            starts = torch.cat([torch.zeros(1, dtype=torch.long), cuts[cuts < seq_len + 1]])
            idx = torch.arange(seq_len + 1)
            doc_start = starts[torch.searchsorted(starts, idx, right=True) - 1]
            pos[r] = idx - doc_start
        batches.append({"input_ids": ids.pin_memory(), "position_ids": pos.pin_memory()})
    out: dict[str, Any] = {"preset": preset, "seq_len": seq_len, "micro_batch": micro_batch,
                           "mean_document_tokens": mean_doc}
    for attention in ("sdpa", "flex_attention"):
        _free()
        try:
            built = build_training_model(preset=preset, path=None, vocab_size=VOCAB, eos_id=0,
                                         device=device, precision="bf16-mixed",
                                         attention=attention, cross_document=False)
            opt = build_optimizer(built.model, lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95),
                                  device_type="cuda")

            def step(i: int, built=built, opt=opt) -> None:
                train_step(built, opt, [batches[i % len(batches)]], accumulation=1,
                           grad_clip=1.0, cross_document=False)

            r = timed(step, warmup=warmup, steps=steps, device=device)
            out[built.attention.backend] = {
                "tokens_per_s": round(steps * micro_batch * seq_len / r["seconds"]),
                "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
            del built, opt
        except Exception as e:  # noqa: BLE001 (a kernel that fails here is a finding)
            out[attention] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


def profile(preset: str, *, seq_len: int, micro_batch: int, compile_blocks: bool,
            top: int = 25) -> list[dict[str, Any]]:
    """The raylm step's CUDA kernels by total time over 3 steps, after 5 warm-up steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    _free()
    device = torch.device("cuda")
    built = build_training_model(preset=preset, path=None, vocab_size=VOCAB, eos_id=0,
                                 device=device, precision="bf16-mixed",
                                 plan=ParallelPlan(compile=compile_blocks))
    opt = build_optimizer(built.model, lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95),
                          device_type="cuda")
    batches = make_batches(4, micro_batch=micro_batch, seq_len=seq_len)
    vote = preemption.Vote(device)
    for i in range(5):
        train_step(built, opt, [batches[i % 4]], accumulation=1, grad_clip=1.0)
        vote()
    _sync()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            train_step(built, opt, [batches[i % 4]], accumulation=1, grad_clip=1.0)
            vote()
        _sync()
    # Kernels only: operator-level rows (aten::mm) would count the same GPU time twice.
    # Nor the GPU-side ranges of annotations ("Optimizer.step#AdamW.step").
    kernels = [e for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total
               and "#" not in e.key and not getattr(e, "is_user_annotation", False)]
    rows = sorted(({"name": e.key[:120], "ms_per_step": round(e.self_device_time_total / 3e3, 3),
                    "calls_per_step": e.count / 3} for e in kernels),
                  key=lambda r: -r["ms_per_step"])
    total = sum(r["ms_per_step"] for r in rows)
    shares: dict[str, float] = {}
    for r in rows:
        kind = kernel_kind(r["name"])
        shares[kind] = shares.get(kind, 0.0) + r["ms_per_step"]
    del built, opt
    return {"kernel_ms_per_step": round(total, 2),
            "share": {k: round(v / total, 3) for k, v in sorted(shares.items(),
                                                                key=lambda kv: -kv[1])},
            "top": rows[:top]}


def kernel_kind(name: str) -> str:
    """A CUDA kernel's role, from its name (cuBLAS/cuBLASLt matmuls are nvjet, sm90_xmma or
    cutlass kernels; Triton kernels are what torch.compile fused)."""
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if any(k in n for k in ("nvjet", "gemm", "xmma", "cutlass", "sm90_")):
        return "matmul"
    if "multi_tensor_apply" in n or "adam" in n:
        return "optimizer"
    if n.startswith("triton"):
        return "fused elementwise (triton)"
    if "nll" in n or "softmax" in n or "cross_entropy" in n:
        return "loss"
    return "other elementwise"


def run(*, presets: list[str], seq_len: int, compile_modes: list[bool], micro_batch: int,
        warmup: int, steps: int, log_every: int, profile_preset: str | None,
        per_document_preset: str | None, synced: bool = False) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("python -m raylm.bench mfu needs a CUDA GPU.")
    name = torch.cuda.get_device_name()
    results = []
    for preset in presets:
        for c in compile_modes:
            mb = micro_batch or MICRO_BATCH.get(preset, 8)
            try:
                r = one_preset(preset, seq_len=seq_len, compile_blocks=c, micro_batch=mb,
                               warmup=warmup, steps=steps, log_every=log_every,
                               synced=synced)
            except Exception as e:  # noqa: BLE001 (reported, the other presets still run)
                r = {"preset": preset, "compile": c,
                     "error": f"{type(e).__name__}: {str(e)[:500]}"}
            results.append(r)
            print(_line(r), flush=True)
            print(json.dumps(r), flush=True)  # the whole record, should a later one not end
    out: dict[str, Any] = {
        "benchmark": "mfu",
        "metric": "training tokens/s and MFU, one GPU, bf16-mixed, raylm step vs bare loop",
        "device": name, "bf16_peak_flops": bf16_peak(name), "seq_len": seq_len,
        "warmup": warmup, "steps": steps, "results": results,
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "cuda": torch.version.cuda},
    }
    if per_document_preset:
        out["per_document"] = per_document(per_document_preset, seq_len=seq_len,
                                           micro_batch=MICRO_BATCH.get(per_document_preset, 8),
                                           warmup=warmup, steps=steps)
        print(out["per_document"], flush=True)
    if profile_preset:
        out["profile"] = {"preset": profile_preset, "compile": compile_modes[-1],
                          "kernels": profile(profile_preset, seq_len=seq_len,
                                             micro_batch=MICRO_BATCH.get(profile_preset, 8),
                                             compile_blocks=compile_modes[-1])}
    return out


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['preset']:>5} compile={r['compile']!s:5} error {r['error'][:200]}"
    a, b = r["raylm"], r["bare"]
    return (f"{r['preset']:>5} compile={r['compile']!s:5} mb {r['micro_batch']:>2}  "
            f"raylm {a['tokens_per_s']:>7,} tok/s MFU {a['mfu']}  "
            f"bare {b['tokens_per_s']:>7,} tok/s MFU {b['mfu']}  ratio {r['ratio']}  "
            f"mem {a['peak_memory_gb']:.1f}/{b['peak_memory_gb']:.1f} GB  "
            f"J/tok {a['joules_per_token']}")
