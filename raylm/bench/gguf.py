"""What each GGUF tensor type costs a trained run, in llama.cpp itself.

The run (``--run``, a finished run directory whose prepared data is on this machine) is
exported once as a Hugging Face directory, the baseline: transformers' validation loss on the
blocks the run's own evaluations read. Then once per type (``raylm export --format gguf
--quantize TYPE``): the file's size (and its ratio to the baseline's safetensors), the
export's seconds, the tensors of each type in it, and the validation loss llama.cpp computes
on the same blocks (its own kernels, through llama-cpp-python), with its difference from the
baseline. Needs the ``gguf`` and ``llamacpp`` extras.
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch


def llama_cpp_loss(path: str | Path, blocks: list[list[int]]) -> float:
    """The mean over ``blocks`` (lists of token ids) of the next-token cross-entropy that
    llama.cpp computes with the GGUF file ``path``."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=max(map(len, blocks)), logits_all=True,
                          verbose=False, n_threads=2)
    try:
        losses = []
        for block in blocks:
            llm.reset()
            llm.eval(block[:-1])
            logits = torch.from_numpy(np.array(llm.scores[:len(block) - 1]))
            losses.append(torch.nn.functional.cross_entropy(
                logits, torch.tensor(block[1:])).item())
    finally:
        llm.close()
    return float(np.mean(losses))


def run(*, run_dir: str, types: list[str]) -> dict[str, Any]:
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    from raylm.formats.exporter import export, model_losses, validation_batches

    found = validation_batches(run_dir, log=print)
    if found is None:
        raise SystemExit(f"{run_dir}: its prepared data is not on this machine")
    batches, cross = found
    blocks = [row.tolist() for b in batches for row in b["input_ids"]]
    with tempfile.TemporaryDirectory(prefix="raylm-bench-gguf-") as tmp:
        hf = export(run_dir, Path(tmp) / "hf", log=lambda line: None)
        baseline = model_losses([AutoModelForCausalLM.from_pretrained(str(hf)).eval()],
                                batches, cross)[0]
        safetensors = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
        rows = []
        for kind in types:
            start = time.perf_counter()
            out = export(run_dir, Path(tmp) / f"{kind}.gguf", format="gguf", quantize=kind,
                         log=lambda line: None)
            seconds = time.perf_counter() - start
            tensors = Counter(t.tensor_type.name.lower() for t in GGUFReader(out).tensors)
            loss = llama_cpp_loss(out, blocks)
            rows.append({"type": kind, "bytes": out.stat().st_size,
                         "size_vs_safetensors": round(out.stat().st_size / safetensors, 4),
                         "export_s": round(seconds, 2), "tensors": dict(tensors),
                         "val_loss": round(loss, 5),
                         "val_loss_vs_transformers": round(loss - baseline, 5)})
            print(rows[-1], flush=True)
    return {"bench": "gguf", "run": run_dir, "blocks": len(blocks),
            "transformers_val_loss": round(baseline, 5), "safetensors_bytes": safetensors,
            "types": rows}
