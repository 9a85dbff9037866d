"""raylm's single-worker training throughput against a bare PyTorch loop on the same model.

Both sides train the same architecture (``--preset``) with the same micro batch, sequence
length, precision (fp32 on CPU, bf16-mixed on CUDA), AdamW and intra-op threads, on the same
packed data:

- raylm: ``raylm train`` with one Ray Train worker: Ray Data streaming the blocks in the global
  order, FSDP2 (world size 1), the pinned SDPA kernel, clipping, metrics and reports. Throughput
  is the steady-state window (the second half of the steps; the first half warms up).
- bare: the same model from ``transformers``, the blocks preloaded as one tensor, and
  ``loss.backward(); optimizer.step()`` in a ``for`` loop, timed over the same second half.

``ratio`` = raylm / bare tokens per second (1.0 = no overhead).
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from raylm.config import load_config
from raylm.contracts import PREPARED_MANIFEST
from raylm.data.tokenizer import load_backend
from raylm.model.spec import ModelSpec
from raylm.run.launch import train


def bare_loop(prepared: Path, *, preset: str, vocab_size: int, eos_id: int, steps: int,
              micro_batch: int, seq_len: int, threads: int, device: str) -> float:
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM


    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = ModelSpec(preset=preset, vocab_size=vocab_size, eos_id=eos_id).transformers_config()
    model = AutoModelForCausalLM.from_config(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device == "cuda")
    ids = pq.read_table(prepared / "train").column("input_ids").combine_chunks()
    blocks = torch.from_numpy(ids.values.to_numpy().reshape(-1, seq_len + 1).astype("int64"))
    dtype = torch.bfloat16 if device == "cuda" else None
    half = steps // 2
    t0 = None
    for step in range(steps):
        if step == half:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        i = (step * micro_batch) % (len(blocks) - micro_batch)
        batch = blocks[i:i + micro_batch].to(device)
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                               batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    return (steps - half) * micro_batch * seq_len / (time.perf_counter() - t0)


def run(*, preset: str, steps: int, micro_batch: int, seq_len: int,
        workdir: str | None) -> dict[str, Any]:
    import json

    import ray


    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="raylm-bench-"))
    use_gpu = torch.cuda.is_available()
    device = "cuda" if use_gpu else "cpu"
    threads = 1
    # Three logical CPUs on a 2-core machine: the worker's one, and room for the data stream's
    # reader and the controller, which mostly wait.
    ray.init(num_cpus=max(3, os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False)
    half = steps // 2
    cfg = load_config(None, [
        f"--run.storage_path={root}/runs", f"--run.cache_dir={root}/cache",
        "--run.name=overhead", "--data.builtin_packages=[peft, datasets]",
        f"--data.seq_len={seq_len}", f"--model.preset={preset}", f"--train.steps={steps}",
        f"--train.global_batch_size={micro_batch}", f"--train.micro_batch_size={micro_batch}",
        f"--train.log_every={half}", f"--train.eval_every={steps}",
        f"--checkpoint.every={steps}", "--train.eval_batches=1",
        f"--scaling.use_gpu={str(use_gpu).lower()}", f"--scaling.cpus_per_worker={threads}",
        "--tracking.enabled=false", "--optim.warmup_steps=1"])
    summary = train(cfg, log=lambda m: None)
    ray.shutdown()
    prepared = Path(sorted((root / "cache" / "prepared").iterdir())[0])
    manifest = json.loads((prepared / PREPARED_MANIFEST).read_text())
    backend, eos = load_backend(manifest["tokenizer_path"])
    bare = bare_loop(prepared, preset=preset, vocab_size=backend.get_vocab_size(), eos_id=eos,
                     steps=steps, micro_batch=micro_batch, seq_len=seq_len, threads=threads,
                     device=device)
    ours = summary["tokens_per_s"]
    return {
        "benchmark": "overhead",
        "metric": "training tokens/s, steady state (second half of the steps), one worker",
        "preset": preset, "steps": steps, "micro_batch": micro_batch, "seq_len": seq_len,
        "precision": summary["precision"], "threads": threads, "device": device,
        "raylm": {"tokens_per_s": round(ours), "data_wait_fraction":
                  summary["data_wait_fraction"], "attention_backend":
                  summary["attention_backend"], "wall_s": summary["wall_s"]},
        "bare": {"tokens_per_s": round(bare)},
        "ratio": round(ours / bare, 3),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
    }
