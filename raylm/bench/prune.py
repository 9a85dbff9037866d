"""What pruning costs a trained model, and what a short fine-tune gives back.

One ``raylm train`` run (``--preset``, ``--steps`` on the built-in corpus with a tokenizer of
``--vocab-size`` tokens, one worker: a small vocabulary so that the decoder layers, which
pruning touches, hold most of the tiny preset's weights rather than its embeddings), then
``raylm prune`` of its final checkpoint by each method at each sparsity: validation loss
before and after on the run's own validation blocks, the share of the model zeroed, size on
disk (dense: safetensors stores the zeros) and as a sparse format would store it (computed:
a bitmask and the kept values; 2:4 as sparse tensor cores read it). Then the heal: the
Wanda-pruned model of ``--heal-sparsity`` fine-tuned ``--heal-steps`` steps on the same data,
with full fine-tuning and with LoRA, each exported merged (its zeros kept), and its loss on
the same blocks; beside them the unpruned model fine-tuned the same steps, since more training
lowers the loss of any model.

The baseline each row compares with is the unpruned model's loss in the same run
(``val_loss_before``). On a GPU the 2:4 rows would also time a forward pass through torch's
semi-structured sparse kernels; on a CPU there are none, and the rows say so.
"""

from __future__ import annotations

import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import ray
import torch

from raylm.after.prune import prune_source
from raylm.config import load_config
from raylm.formats.exporter import export, model_losses, validation_batches
from raylm.run.launch import train


def run(*, preset: str, steps: int, vocab_size: int, sparsities: list[str],
        methods: list[str], heal_steps: int, heal_sparsity: str,
        workdir: str | None) -> dict[str, Any]:
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="raylm-bench-"))
    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False)
    common = [f"--run.storage_path={root}/runs", f"--run.cache_dir={root}/cache",
              "--data.seq_len=256", f"--tokenizer.vocab_size={vocab_size}",
              "--train.precision=fp32",
              "--train.global_batch_size=16", "--train.micro_batch_size=8",
              "--train.log_every=50", "--tracking.enabled=false", "--scaling.num_workers=1",
              f"--scaling.cpus_per_worker={max(1, (os.cpu_count() or 2) - 1)}"]
    base = train(load_config(None, [*common, "--run.name=base", f"--model.preset={preset}",
                                    f"--train.steps={steps}", f"--train.eval_every={steps}"]),
                 log=lambda m: None)
    run_dir = root / "runs" / "base"
    rows = []
    for sparsity in sparsities:
        for method in methods:
            out = root / "pruned" / f"{method}-{sparsity.replace(':', 'of')}"
            report = prune_source(run_dir, out, sparsity_text=sparsity, method=method,
                                  log=lambda m: None)
            rows.append({k: report[k] for k in (
                "method", "sparsity", "layer_sparsity", "model_sparsity", "val_loss_before",
                "val_loss", "bytes", "compressed_bytes", "seconds")}
                | {"loss_increase": round(report["val_loss"] - report["val_loss_before"], 4)})
    heal = _heal(root, run_dir, common, sparsity=heal_sparsity, steps=heal_steps)
    ray.shutdown()
    return {
        "benchmark": "prune",
        "metric": "validation loss on the run's own validation blocks, before and after "
                  "pruning, and after a short fine-tune of the pruned model",
        "preset": preset, "steps": steps, "vocab_size": vocab_size,
        "base_val_loss": base["val_loss"],
        "rows": rows, "heal": heal,
        "semi_structured_speedup": "not measured: torch has semi-structured sparse kernels "
                                   "for CUDA GPUs only" if not torch.cuda.is_available()
                                   else "not measured by this benchmark yet",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
    }


def _heal(root: Path, run_dir: Path, common: list[str], *, sparsity: str,
          steps: int) -> dict[str, Any]:
    """The Wanda-pruned model at ``sparsity`` fine-tuned on the same data, fully and with
    LoRA (rank 16), each exported merged and scored on the run's validation blocks; and the
    unpruned model fine-tuned fully as they were."""
    from transformers import AutoModelForCausalLM

    pruned = root / "pruned" / f"wanda-{sparsity.replace(':', 'of')}-heal"
    report = prune_source(run_dir, pruned, sparsity_text=sparsity, method="wanda",
                          log=lambda m: None)
    batches, cross = validation_batches(run_dir, log=lambda m: None)
    out: dict[str, Any] = {"sparsity": sparsity, "steps": steps,
                           "pruned_val_loss": report["val_loss"],
                           "val_loss_before": report["val_loss_before"]}
    dense = export(run_dir, root / "dense", log=lambda m: None)
    sides = {"full": (pruned, ["--optim.lr=3e-4"]),
             "lora": (pruned, ["--lora.rank=16", "--lora.alpha=32", "--optim.lr=1e-3"]),
             "unpruned_full": (dense, ["--optim.lr=3e-4"])}
    for name, (start, extra) in sides.items():
        summary = train(load_config(None, [
            *common, f"--run.name=heal-{name}", f"--model.path={start}",
            "--tokenizer.path=null", f"--train.steps={steps}", f"--train.eval_every={steps}",
            "--optim.warmup_steps=5", *extra]), log=lambda m: None)
        merged = export(root / "runs" / f"heal-{name}", root / "healed" / name, merge=True,
                        log=lambda m: None)
        model = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
        zero = [float((p == 0).float().mean()) for n, p in model.named_parameters()
                if n.endswith("proj.weight")]
        out[name] = {"training_val_loss": summary["val_loss"],
                     "exported_val_loss": model_losses([model], batches, cross)[0],
                     "min_layer_sparsity": round(min(zero), 6)}
    return out

