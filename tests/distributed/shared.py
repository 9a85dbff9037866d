"""What the distributed tests share: the small Llama and the batches their ranks train on
(the recorded losses, tests/losses.json, are computed from these), and a rank's frame."""

from __future__ import annotations

import os

import torch

from raylm.model.parallelize import ParallelPlan, layout_of

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


def whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient, gathered to the full tensor where it is sharded or split."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def run_composed(world: int, rank: int, plan: ParallelPlan, out: dict, pretrained: str
                 ) -> None:
    """Pipeline stages that are themselves split (tensor parallelism) or sharded (FSDP2 over
    data-parallel ranks): losses and gradient norms of AdamW steps, masked steps and
    evaluation, for the tiny model and for LoRA on a pretrained base."""
    from raylm.model.assemble import build_training_model, evaluate
    from raylm.workers.optim import build_optimizer
    from raylm.workers.step import train_step

    lay = layout_of(rank, world, plan)
    per = BATCH // lay.dp_size

    def mine(batch):
        rows = {k: v[lay.dp_rank * per:(lay.dp_rank + 1) * per] for k, v in batch.items()}
        half = per // 2
        return [{k: v[i:i + half] for k, v in rows.items()} for i in (0, half)]

    for name, kw in (("full", dict(preset="tiny", path=None)),
                     ("lora", dict(preset=None, path=pretrained, lora=LORA))):
        built = build_training_model(vocab_size=VOCAB, eos_id=0, device=torch.device("cpu"),
                                     precision="fp32", seed=0, plan=plan, **kw)
        opt = build_optimizer(built.model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95),
                              device_type="cpu")
        out[name] = [float(x) for batch in (data(0), data(1), masked_data())
                     for x in train_step(built, opt, mine(batch), accumulation=2,
                                         grad_clip=1.0)]
        out[name].append(evaluate(built, mine(masked_data())))


def reload(world: int, rank: int, plan: ParallelPlan, directory: str
           ) -> dict[str, torch.Tensor]:
    """The parameters of a tiny model laid out by ``plan`` once ``directory`` is loaded into
    it (with its optimizer state), whole: every stage's, gathered to full tensors."""
    import torch.distributed as dist

    from raylm.model.assemble import build_training_model
    from raylm.workers import checkpoint
    from raylm.workers.optim import build_optimizer

    built = build_training_model(preset="tiny", path=None, vocab_size=VOCAB, eos_id=0,
                                 device=torch.device("cpu"), precision="fp32", seed=5,
                                 plan=plan)
    opt = build_optimizer(built.model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95),
                          device_type="cpu")
    checkpoint.load(directory, model=built.model, optimizer=opt, config=built.config)
    mine = {n: whole(p) for n, p in built.model.named_parameters()}
    if plan.pipeline == 1:
        return mine
    parts: list = [None] * world
    dist.all_gather_object(parts, mine)
    return {n: t for part in parts for n, t in part.items()}
