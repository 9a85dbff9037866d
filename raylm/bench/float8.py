"""Float8 against bf16 on one GPU: raylm's step core with ``model.float8`` off, tensorwise and
rowwise, at each preset, on the same tokens from the same initial weights.

    python -m raylm.bench float8 --output runs/bench-float8.json [--presets 1b,3b]
        [--recipes tensorwise,rowwise] [--seq-len 2048] [--steps 40]

Needs torch, transformers and torchao (no Ray). Every side is
:func:`raylm.bench.mfu.raylm_side` (bf16-mixed, blocks compiled, fused AdamW, clipping, the
schedule, the preemption vote) with only the plan's ``float8`` changed. Speed: tokens/s over
``--steps`` steps after the warm-up, ``speedup`` = tokens/s over the bf16 side's; MFU counts the
model's FLOPs against the device's dense bf16 peak (so a float8 side can pass the bf16 side's
MFU without doing more work). Loss: random tokens teach a model nothing, so the tokens here
are learnable: each row repeats a 256-token phrase drawn from a Zipf distribution over the
vocabulary (unigram frequencies and in-context copying to learn); ``loss_rel_diff`` is the
float8 side's loss at the last step both sides logged, relative to bf16's there. The micro
batch is the largest (from ``--micro-batch``, halving) at which the bf16 side fits; float8
sides use the same. The JSON is rewritten after each side.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch

from raylm.bench.mfu import VOCAB, _free, _sync, raylm_side
from raylm.model.parallelize import ParallelPlan
from raylm.workers.metrics import bf16_peak, flops_per_token

PHRASE = 256


def learnable_batches(n: int, *, micro_batch: int, seq_len: int, seed: int = 0
                      ) -> list[dict[str, torch.Tensor]]:
    """``n`` micro-batches of rows that repeat a Zipf-distributed phrase (pinned memory)."""
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, VOCAB, dtype=torch.float64) ** 1.1
    repeats = -(-(seq_len + 1) // PHRASE)
    out = []
    for _ in range(n):
        phrase = torch.multinomial(weights, micro_batch * PHRASE, replacement=True,
                                   generator=gen).view(micro_batch, PHRASE) + 1
        rows = phrase.repeat(1, repeats)[:, :seq_len + 1]
        out.append({"input_ids": rows.contiguous().pin_memory()})
    return out


def side(preset: str, recipe: str, *, micro_batch: int, seq_len: int, warmup: int, steps: int,
         log_every: int, batches: list) -> dict[str, Any]:
    r = raylm_side(preset, micro_batch=micro_batch, seq_len=seq_len,
                   plan=ParallelPlan(compile=True, float8=recipe), warmup=warmup, steps=steps,
                   log_every=log_every, batches=batches)
    r["float8_linears"] = sum(type(m).__name__ == "Float8Linear"
                              for m in r["built"].model.modules())
    r["config"] = r["built"].config
    del r["built"], r["optimizer"]
    _free()
    return r


def one_preset(preset: str, *, recipes: list[str], seq_len: int, micro_batch: int, warmup: int,
               steps: int, log_every: int, write) -> dict[str, Any]:
    peak = bf16_peak(torch.cuda.get_device_name())
    out: dict[str, Any] = {"preset": preset, "seq_len": seq_len}
    mb = micro_batch
    while True:
        batches = learnable_batches(16, micro_batch=mb, seq_len=seq_len)
        try:
            _free()
            base = side(preset, "off", micro_batch=mb, seq_len=seq_len, warmup=warmup,
                        steps=steps, log_every=log_every, batches=batches)
            break
        except torch.OutOfMemoryError:
            _free()
            if mb == 1:
                raise
            mb //= 2
    config = base.pop("config")
    fpt = flops_per_token(config, seq_len)
    tokens = steps * mb * seq_len
    out |= {"micro_batch": mb, "params": base["params"], "flops_per_token": fpt}

    def figures(r: dict[str, Any]) -> dict[str, Any]:
        tok_s = tokens / r["seconds"]
        return {"tokens_per_s": round(tok_s),
                "mfu_bf16_peak": None if peak is None else round(tok_s * fpt / peak, 4),
                "step_ms": round(1000 * r["seconds"] / steps, 1),
                "peak_memory_gb": round(r["peak_memory_gb"], 2),
                "joules_per_token": (None if r["joules"] is None
                                     else round(r["joules"] / tokens, 5)),
                "breakdown_ms": r["breakdown_ms"], "loss_at_step": r["loss_at_step"],
                "float8_linears": r["float8_linears"]}

    out["bf16"] = figures(base)
    write(out)
    for recipe in recipes:
        try:
            r = side(preset, recipe, micro_batch=mb, seq_len=seq_len, warmup=warmup,
                     steps=steps, log_every=log_every, batches=batches)
            r.pop("config")
            f = figures(r)
            f["speedup"] = round(f["tokens_per_s"] / out["bf16"]["tokens_per_s"], 3)
            common = sorted(set(f["loss_at_step"]) & set(out["bf16"]["loss_at_step"]))
            if common:
                last = common[-1]
                ref = out["bf16"]["loss_at_step"][last]
                f["loss_step"] = last
                f["loss_rel_diff"] = round((f["loss_at_step"][last] - ref) / ref, 5)
        except Exception as e:  # noqa: BLE001 (a recipe that fails here is a finding)
            _free()
            f = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        out[recipe] = f
        write(out)
    return out


def run(*, presets: list[str], recipes: list[str], seq_len: int, micro_batch: int, warmup: int,
        steps: int, log_every: int, output: str) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("python -m raylm.bench float8 needs a CUDA GPU (compute capability "
                         "8.9+).")
    name = torch.cuda.get_device_name()
    doc: dict[str, Any] = {
        "benchmark": "float8",
        "metric": "training tokens/s and loss, one GPU, raylm step, bf16-mixed vs float8 "
                  "linears (torchao), blocks compiled",
        "device": name, "bf16_peak_flops": bf16_peak(name), "seq_len": seq_len,
        "warmup": warmup, "steps": steps, "results": [],
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "cuda": torch.version.cuda, "torchao": _version("torchao")},
    }

    def write(partial: dict[str, Any]) -> None:
        current = [r for r in doc["results"] if r is not partial] + [partial]
        Path(output).write_text(json.dumps(doc | {"results": current}, indent=1,
                                           default=str) + "\n")

    for preset in presets:
        try:
            r = one_preset(preset, recipes=recipes, seq_len=seq_len, micro_batch=micro_batch,
                           warmup=warmup, steps=steps, log_every=log_every, write=write)
        except Exception as e:  # noqa: BLE001 (reported, the other presets still run)
            r = {"preset": preset, "error": f"{type(e).__name__}: {str(e)[:500]}"}
        doc["results"].append(r)
        write(r)
        print(_line(r, recipes), flush=True)
    _sync()
    return doc


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _line(r: dict[str, Any], recipes: list[str]) -> str:
    if "error" in r:
        return f"{r['preset']:>4} error {r['error'][:200]}"
    b = r["bf16"]
    parts = [f"{r['preset']:>4} mb {r['micro_batch']:>2} bf16 {b['tokens_per_s']:>7,} tok/s "
             f"MFU {b['mfu_bf16_peak']} {b['peak_memory_gb']} GB"]
    for recipe in recipes:
        f = r.get(recipe, {})
        if "error" in f:
            parts.append(f"{recipe} error {f['error'][:160]}")
        elif f:
            parts.append(f"{recipe} {f['tokens_per_s']:>7,} tok/s x{f['speedup']} "
                         f"{f['peak_memory_gb']} GB loss {f.get('loss_rel_diff')}")
    return " | ".join(parts)
