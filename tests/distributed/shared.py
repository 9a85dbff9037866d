"""What the distributed tests share: the small Llama and the batches their ranks train on
(the recorded losses, tests/losses.json, are computed from these), and a rank's frame."""

from __future__ import annotations

import os

import torch

VOCAB, SEQ, BATCH = 300, 33, 4


def data(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "position_ids": torch.arange(SEQ).expand(BATCH, SEQ)}


def masked_data() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    share = torch.tensor([0.8, 0.8, 0.1, 0.1])[:, None]
    mask = (torch.rand(BATCH, SEQ, generator=gen) < share).to(torch.uint8)
    return {**data(1), "loss_mask": mask}


LORA = {"rank": 8, "alpha": 16, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"]}


def save_pretrained(path: str) -> None:
    """A small Llama whose linear layers hold whole NF4 blocks on each of 2 ranks."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
        tie_word_embeddings=False)).save_pretrained(path)


def worker(rank: int, world: int, port: int, path: str, pretrained: str, body) -> None:
    """One gloo rank running ``body(world, rank, out, pretrained)``; rank 0 saves ``out`` to
    ``path``."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out: dict = {}
        body(world, rank, out, pretrained)
        if rank == 0:
            torch.save(out, path)
        # Leave together: the store lives in rank 0 and must outlive every rank's last call.
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_now()


def exit_now() -> None:
    """End a rank that finished cleanly, skipping gloo and interpreter teardown.

    Tearing down gloo's and the store's threads (destroy_process_group, C++ destructors at
    exit) rarely aborts a rank after all its work succeeded ("terminate called without an
    active exception", seen in CI). The OS closes the sockets. Ranks that fail raise before
    reaching this, so their errors still surface through run_ranks.
    """
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
