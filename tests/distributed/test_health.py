"""A planted non-finite gradient on one of 2 FSDP2 gloo ranks is kept from the weights on
both, without reading anything back from the device at each step (fused AdamW takes the
check's flag as its ``found_inf``), and the run then holds what a run that never saw that
step holds. No Ray."""

from __future__ import annotations

import os

import torch

from tests.ranks import free_port, run_ranks

VOCAB, SEQ, BATCH, STEPS, BAD_STEP, POISON = 300, 17, 4, 4, 2, 299
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


def batch(step: int, *, poisoned: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(1, POISON, (BATCH, SEQ), generator=gen)
    if poisoned:
        ids[-1, 5] = POISON  # in the last row: rank 1's share
    return {"input_ids": ids, "position_ids": torch.arange(SEQ).expand(BATCH, SEQ)}


def save_poisoned(path: str) -> None:
    """A small Llama (untied head) whose embedding of one token is NaN: a block holding it
    has a NaN loss and NaN gradients; blocks without it are untouched by that row."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
        tie_word_embeddings=False))
    with torch.no_grad():
        model.model.embed_tokens.weight[POISON] = float("nan")
    model.save_pretrained(path)


class Reads:
    """Counts calls that bring a tensor's value to the host."""

    def __init__(self) -> None:
        self.count = 0
        self.saved = {name: getattr(torch.Tensor, name) for name in READS}

    def __enter__(self) -> Reads:
        for name, fn in self.saved.items():
            def counted(*args, _fn=fn, **kwargs):
                self.count += 1
                return _fn(*args, **kwargs)
            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, fn)


def train(rank: int, world: int, path: str, *, fused: bool, schedule: list[int], guard: bool
          ) -> tuple[list, int, dict]:
    from raylm.model.assemble import build_training_model
    from raylm.workers.health import Health
    from raylm.workers.optim import param_groups
    from raylm.workers.step import train_step

    built = build_training_model(preset=None, path=path, vocab_size=VOCAB, eos_id=0,
                                 device=torch.device("cpu"), precision="fp32")
    opt = torch.optim.AdamW(param_groups(built.model, 0.1), lr=1e-2, fused=fused,
                            foreach=None if fused else True)
    health = Health(device=torch.device("cpu"), start_step=0, report_every=STEPS + 1) if guard \
        else None
    per = BATCH // world
    losses = []
    with Reads() as reads:
        for step in schedule:
            mine = {k: v[rank * per:(rank + 1) * per]
                    for k, v in batch(step, poisoned=step == BAD_STEP).items()}
            losses.append(train_step(built, opt, [mine], accumulation=1, grad_clip=1.0,
                                     health=health)[0])
    faults = health.read() if health else []
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in built.model.named_parameters()}
    return [(f.step, f.cause) for f in faults], reads.count, params


def ranks(rank: int, world: int, port: int, path: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        clean = list(range(STEPS + 1))
        clean.remove(BAD_STEP)
        got = {}
        for fused in (True, False):
            got[fused] = {
                "guarded": train(rank, world, path, fused=fused,
                                 schedule=list(range(STEPS + 1)), guard=True),
                # The same steps without the check, and without the poisoned one.
                "never_saw_it": train(rank, world, path, fused=fused, schedule=clean,
                                      guard=False)}
        torch.save(got, f"{out}-{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_a_non_finite_gradient_on_one_rank_is_skipped_on_both_without_a_read_per_step(
        tmp_path):
    path = str(tmp_path / "poisoned")
    save_poisoned(path)
    out = str(tmp_path / "out")
    run_ranks(ranks, args=(2, free_port(), path, out), world=2)
    for rank in (0, 1):
        got = torch.load(f"{out}-{rank}.pt", weights_only=False)
        for fused in (True, False):
            faults, reads, params = got[fused]["guarded"]
            _, plain_reads, reference = got[fused]["never_saw_it"]
            # Both ranks found the fault rank 1's data planted (step BAD_STEP is the third).
            assert faults == [(BAD_STEP + 1, "nonfinite")], (rank, fused)
            if fused:
                # No host read beyond what the steps make without the check (the guarded run
                # has one step more than the reference). (The foreach AdamW reads its step
                # counts itself; raylm uses it on CPUs, where a read waits for nothing.)
                assert reads * STEPS == plain_reads * (STEPS + 1), (rank, reads, plain_reads)
            # The skipped step left weights and AdamW's moments and step count as they were
            # (the poisoned token's embedding is NaN in both).
            for name, value in reference.items():
                torch.testing.assert_close(params[name], value, rtol=0, atol=0,
                                           equal_nan=True, msg=f"{rank} {fused} {name}")
