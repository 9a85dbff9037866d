"""What LoRA and QLoRA save against full fine-tuning of the same pretrained model, side by side.

Every side fine-tunes the same model directory, built from a config and saved with
``save_pretrained`` (memory and cost do not depend on the weights' values): ``--preset``'s Llama
architecture with a 32,768-token vocabulary, or ``--family``, a published model's shape from its own
``transformers`` config class (its vocabulary and tied embeddings included), on the same generated
chat data (:mod:`raylm.examples.reverse_words`), with the same workers, batch, precision and steps,
through ``raylm train``. Per side: trainable parameters, the newest checkpoint's size on disk, the
peak memory of a worker (rank 0's peak RSS on CPU, the CUDA allocator's peak on GPUs) and
steady-state tokens/s. ``ratio``: LoRA / full for each figure (``ratio_qlora``: QLoRA / full).
The side ``full_plain_loss`` fine-tunes fully with the plain output head and cross-entropy
(``train.fused_loss: false``), against the chunked head loss that every other side uses
(``ratio_full_plain_loss``: plain / chunked). The JSON is rewritten after each side, so a
run cut short keeps what it measured; ``--sides`` runs some of them (a full fine-tune of a 2B
model and its checkpoint take minutes of their own).
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

from raylm import rundir
from raylm.config import load_config
from raylm.console import quiet_torchao
from raylm.data.tokenizer import EOS_TOKEN, save_hf_tokenizer, train_bpe
from raylm.examples.reverse_words import pretraining_text, write
from raylm.model.spec import ModelSpec
from raylm.run.launch import train

# The vocabulary raylm's GPU configs train for the 125m preset and up.
VOCAB = 32768


def family_config(family: str):
    """A published model's architecture from its family's ``transformers`` config class (the
    shapes of their config.json files; "-tiny": the same family at a test size)."""
    import transformers as T

    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=4096)
    configs = {
        # Qwen3-1.7B: 2.03 B parameters stored, tied embeddings of 151,936 tokens.
        "qwen3-1.7b": lambda: T.Qwen3Config(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True),
        # Gemma 3 1B: tied embeddings of 262,144 tokens, sliding-window layers.
        "gemma3-1b": lambda: T.Gemma3TextConfig(
            vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
            num_attention_heads=4, num_key_value_heads=1, head_dim=256,
            max_position_embeddings=32768, sliding_window=512),
        "qwen3-tiny": lambda: T.Qwen3Config(**tiny, tie_word_embeddings=True),
        "gemma3-tiny": lambda: T.Gemma3TextConfig(**tiny),
    }
    if family not in configs:
        raise ValueError(f"--family {family!r}: choose one of {', '.join(configs)}")
    return configs[family]()


def make_model(directory: Path, *, preset: str, family: str | None, texts: list[str],
               vocab_size: int) -> Path:
    """``family``'s architecture, or else ``preset``'s with ``vocab_size`` embeddings (what its
    configs train), saved as a pretrained model directory is, in bf16 where the model will
    train on a GPU; its tokenizer, trained on ``texts``, uses fewer ids than the embeddings
    hold."""
    quiet_torchao()
    from transformers import AutoModelForCausalLM

    tok = train_bpe(iter(texts), vocab_size=2048)
    if family:
        config = family_config(family)
    else:
        config = ModelSpec(preset=preset, vocab_size=vocab_size,
                           eos_id=tok.token_to_id(EOS_TOKEN)).transformers_config()
    torch.manual_seed(0)
    # Built on the GPU where there is one: initializing a billion parameters on the host's
    # cores takes longer than the fine-tunes measured.
    cuda = torch.cuda.is_available()
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16 if cuda else torch.float32)
    model.save_pretrained(str(directory))
    del model
    save_hf_tokenizer(tok, directory)
    return directory


def dir_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


SIDES = ("full", "lora", "qlora", "full_plain_loss")


def run(*, preset: str, family: str | None, rank: int, qlora: bool, steps: int, workers: int,
        micro_batch: int, seq_len: int, compile: str, output: Path,
        workdir: str | None, sides: tuple[str, ...] = ("full", "lora")) -> dict[str, Any]:
    """``sides``: which of :data:`SIDES` run, in that order (``qlora`` adds its side); the
    ratios need the full side."""
    import ray

    use_gpu = torch.cuda.is_available()
    chosen = [name for name in SIDES if name in sides or (name == "qlora" and qlora)]
    unknown = set(sides) - set(SIDES)
    if unknown or not chosen:
        raise SystemExit(f"--sides: {', '.join(sorted(unknown)) or 'none given'}; choose from "
                         f"{', '.join(SIDES)}")
    if "qlora" in chosen and not use_gpu:
        raise SystemExit("--qlora: NF4 bases train on CUDA only; run it on a GPU machine or "
                         "leave --qlora out.")
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="raylm-bench-"))
    # Enough conversations (about 40 tokens each) that no side trains an example twice.
    data = write(root / "task", heldout=10, pretrain=0,
                 train=max(2000, steps * micro_batch * workers * seq_len // 20))
    model = make_model(root / "model", preset=preset, family=family,
                       texts=pretraining_text(2000), vocab_size=VOCAB)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=False)
    else:
        ray.init(num_cpus=max(workers + 1, os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=False)
    result = {
        "benchmark": "lora",
        "metric": "LoRA (and QLoRA) against full fine-tuning of the same model: trainable "
                  "parameters, checkpoint size, peak memory per worker, steady-state tokens/s",
        "model": family or f"preset {preset}", "lora_rank": rank, "steps": steps,
        "workers": workers, "micro_batch": micro_batch, "seq_len": seq_len,
        "compile": compile,
        "device": torch.cuda.get_device_name() if use_gpu else "cpu",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
    }
    # full_plain_loss: full fine-tuning with the plain output head and cross-entropy, against
    # the chunked head loss (train.fused_loss) every other side uses.
    settings = {"full": (0, "none"), "lora": (rank, "none"), "qlora": (rank, "nf4"),
                "full_plain_loss": (0, "none")}
    for name in chosen:
        lora_rank, quant = settings[name]
        cfg = load_config(None, [
            f"--run.storage_path={root}/runs", f"--run.cache_dir={root}/cache",
            f"--run.name={name}", f"--data.source={data['train']}", "--data.format=chat",
            f"--data.seq_len={seq_len}", f"--model.path={model}", f"--lora.rank={lora_rank}",
            f"--lora.base_quantization={quant}", f"--model.compile={compile}",
            f"--lora.alpha={2 * max(lora_rank, 1)}", f"--train.steps={steps}",
            f"--train.global_batch_size={micro_batch * workers}",
            f"--train.micro_batch_size={micro_batch}", f"--train.log_every={steps // 2}",
            f"--train.eval_every={steps}", f"--checkpoint.every={steps}",
            "--train.eval_batches=1", f"--scaling.num_workers={workers}",
            f"--scaling.use_gpu={str(use_gpu).lower()}", "--tracking.enabled=false",
            "--optim.warmup_steps=1", "--optim.lr=1e-4",
            f"--train.fused_loss={str(name != 'full_plain_loss').lower()}"])
        summary = train(cfg, log=lambda m: None)
        found = rundir.latest_verified(str(root / "runs" / name))
        result[name] = {
            "trainable_params": summary["trainable_params"],
            "checkpoint_bytes": dir_bytes(str(found[0])),
            "peak_memory_gb_per_worker": round(summary["peak_memory_gb"], 3),
            "tokens_per_s": round(summary["tokens_per_s"]),
            "train_loss": summary["train_loss"],
            "precision": summary["precision"],
        }
        if name != "full" and "full" in result:
            key = "ratio" if name == "lora" else f"ratio_{name}"  # against the full side
            result[key] = {k: round(result[name][k] / result["full"][k], 4)
                           for k in ("trainable_params", "checkpoint_bytes",
                                     "peak_memory_gb_per_worker", "tokens_per_s")}
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2))
    ray.shutdown()
    return result
