"""Pretrained models as users bring them: what raylm builds, materializes, loads and shards
computes what ``transformers`` computes, with tied and untied embeddings, full and LoRA, on one
process and on 2 gloo ranks (FSDP2), before training and after a checkpoint's resume.

The models are tiny random-weight ones built here from ``transformers``' config classes and
saved with ``save_pretrained`` (nothing is downloaded); a tied model's file stores the shared
weight once, as published tied models do.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.distributed.test_fsdp_parity import exit_now
from tests.ranks import free_port, run_ranks

VOCAB = 384
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def save_family(out: Path, family: str, *, tied: bool) -> Path:
    """A tiny random-weight model of ``family``, saved as a pretrained directory."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                 tie_word_embeddings=tied)
    # Gemma 3 also scales its embeddings by a buffer no checkpoint holds, and keeps rotary
    # frequencies per layer type.
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config,
              "gemma3": lambda **kw: Gemma3TextConfig(head_dim=16, **kw)}[family](**shape)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    # Norm weights start at 1; others at random: a load that skips a tensor shows.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(str(out))
    return out


def inputs() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))


def reference_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=inputs()).logits


def built_logits(built) -> torch.Tensor:
    built.model.eval()
    with torch.no_grad():
        out = built.model(input_ids=inputs()).logits
    built.model.train()
    return out.full_tensor() if hasattr(out, "full_tensor") else out


def build(path: Path, lora: dict | None):
    from raylm.step import build_training_model

    return build_training_model(preset=None, path=str(path), vocab_size=VOCAB, eos_id=0,
                                device=torch.device("cpu"), precision="fp32", seed=0,
                                lora=lora)


def tied_parameters(model) -> list[str]:
    return [n for n, _ in model.named_parameters() if "embed_tokens" in n or "lm_head" in n]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_a_loaded_model_computes_what_transformers_computes(tmp_path, family, tied, lora):
    path = save_family(tmp_path / family, family, tied=tied)
    built = build(path, lora)
    got, want = built_logits(built), reference_logits(path)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # A tied model keeps one tensor: an untied copy would train apart from the embeddings.
    names = [n.split(".")[-2] for n in tied_parameters(built.model)]
    assert names == (["embed_tokens"] if tied else ["embed_tokens", "lm_head"])


def ranks_worker(rank: int, world: int, port: int, path: str, out: str, lora: bool) -> None:
    """On 2 ranks: logits of the loaded, sharded model; one step; a checkpoint; the logits of
    a fresh model resumed from it against the trained one's."""
    import torch.distributed as dist

    from raylm import checkpoint
    from raylm.optim import build_optimizer
    from raylm.step import train_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        adapters = LORA if lora else None
        built = build(Path(path), adapters)
        # Before any forward, as a worker does: FSDP2 leaves the root's parameters gathered
        # after a forward that no backward follows, and an optimizer built then would hold
        # those instead of the shards.
        opt = build_optimizer(built.model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95),
                              device_type="cpu")
        loaded = built_logits(built)
        batch = {"input_ids": inputs()[rank:rank + 1]}
        loss = float(train_step(built, opt, [batch], accumulation=1, grad_clip=1.0)[0])
        trained = built_logits(built)
        ckpt = f"{out}.ckpt"
        checkpoint.save(ckpt, model=built.model, optimizer=opt, config=built.config,
                        state={"step": 1, "tokens_seen": 0, "data_position": 2})
        fresh = build(Path(path), adapters)
        checkpoint.load(ckpt, model=fresh.model, optimizer=None, config=fresh.config)
        resumed = built_logits(fresh)
        if rank == 0:
            torch.save({"loaded": loaded, "trained": trained, "resumed": resumed,
                        "loss": loss, "params": tied_parameters(built.model)}, out)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_now()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_tied_model_on_two_ranks_loads_trains_and_resumes_as_one_tensor(tmp_path, lora):
    path = save_family(tmp_path / "model", "qwen2", tied=True)
    out = str(tmp_path / "result.pt")
    run_ranks(ranks_worker, args=(2, free_port(), str(path), out, lora), world=2)
    r = torch.load(out)
    want = reference_logits(path)
    assert torch.allclose(r["loaded"], want, atol=1e-5), (r["loaded"] - want).abs().max()
    assert not torch.allclose(r["trained"], r["loaded"], atol=1e-4)  # the step changed it
    assert torch.allclose(r["resumed"], r["trained"], atol=1e-5)
    assert [n.split(".")[-2] for n in r["params"]] == ["embed_tokens"]
