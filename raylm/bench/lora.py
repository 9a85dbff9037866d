"""What LoRA saves against full fine-tuning of the same pretrained model, side by side.

Both sides fine-tune the same model directory (``--preset``'s architecture with a 32,768-token
vocabulary, built from its config and saved with ``save_pretrained``: memory and cost do not
depend on the weights' values) on the same generated chat data (:mod:`raylm.tasks`), with the
same workers, batch, precision and steps, through ``raylm train``. Per side: trainable
parameters, the newest checkpoint's size on disk, the peak memory of a worker (rank 0's peak
RSS on CPU, the CUDA allocator's peak on GPUs) and steady-state tokens/s. ``ratio``: LoRA /
full for each figure.
"""

from __future__ import annotations

import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

from raylm import checkpoint
from raylm.config import load_config
from raylm.console import quiet_torchao
from raylm.launch import train
from raylm.model import build_config
from raylm.tasks import pretraining_text, write
from raylm.tokenizer import EOS_TOKEN, save_hf_tokenizer, train_bpe

# The vocabulary raylm's GPU configs train for the 125m preset and up.
VOCAB = 32768


def make_model(directory: Path, *, preset: str, texts: list[str], vocab_size: int) -> Path:
    """``preset``'s architecture with ``vocab_size`` embeddings (what its configs train, though
    the tokenizer trained on ``texts`` uses fewer), saved as a pretrained model directory is."""
    quiet_torchao()
    from transformers import AutoModelForCausalLM

    tok = train_bpe(iter(texts), vocab_size=2048)
    config = build_config(preset=preset, path=None, vocab_size=vocab_size,
                          eos_id=tok.token_to_id(EOS_TOKEN), attn_implementation="sdpa")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    save_hf_tokenizer(tok, directory)
    return directory


def dir_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def run(*, preset: str, rank: int, steps: int, workers: int, micro_batch: int,
        workdir: str | None) -> dict[str, Any]:
    import ray

    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="raylm-bench-"))
    use_gpu = torch.cuda.is_available()
    data = write(root / "task", train=2000, heldout=10, pretrain=0)
    model = make_model(root / "model", preset=preset, texts=pretraining_text(2000),
                       vocab_size=VOCAB)
    ray.init(num_cpus=max(workers + 1, os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False)
    sides = {}
    for name, lora_rank in (("full", 0), ("lora", rank)):
        cfg = load_config(None, [
            f"--run.storage_path={root}/runs", f"--run.cache_dir={root}/cache",
            f"--run.name={name}", f"--data.source={data['train']}", "--data.format=chat",
            "--data.seq_len=127", f"--model.path={model}", f"--lora.rank={lora_rank}",
            f"--lora.alpha={2 * max(lora_rank, 1)}", f"--train.steps={steps}",
            f"--train.global_batch_size={micro_batch * workers}",
            f"--train.micro_batch_size={micro_batch}", f"--train.log_every={steps // 2}",
            f"--train.eval_every={steps}", f"--checkpoint.every={steps}",
            "--train.eval_batches=1", f"--scaling.num_workers={workers}",
            f"--scaling.use_gpu={str(use_gpu).lower()}", "--tracking.enabled=false",
            "--optim.warmup_steps=1", "--optim.lr=1e-4"])
        summary = train(cfg, log=lambda m: None)
        found = checkpoint.latest_verified(str(root / "runs" / name))
        sides[name] = {
            "trainable_params": summary["trainable_params"],
            "checkpoint_bytes": dir_bytes(str(found[0])),
            "peak_memory_gb_per_worker": round(summary["peak_memory_gb"], 3),
            "tokens_per_s": round(summary["tokens_per_s"]),
            "train_loss": summary["train_loss"],
            "precision": summary["precision"],
        }
    ray.shutdown()
    ratio = {k: round(sides["lora"][k] / sides["full"][k], 4)
             for k in ("trainable_params", "checkpoint_bytes", "peak_memory_gb_per_worker",
                       "tokens_per_s")}
    return {
        "benchmark": "lora",
        "metric": "LoRA against full fine-tuning of the same model: trainable parameters, "
                  "checkpoint size, peak memory per worker, steady-state tokens/s",
        "preset": preset, "lora_rank": rank, "steps": steps, "workers": workers,
        "micro_batch": micro_batch, "seq_len": 127, "vocab_size": VOCAB,
        "device": "cuda" if use_gpu else "cpu",
        "full": sides["full"], "lora": sides["lora"], "ratio": ratio,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
    }
