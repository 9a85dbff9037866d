"""Colocated GRPO (rl.generators=0) on two gloo ranks against one: rank 0 reads every rank's
prompt rows and hands each its prompts, each samples its share with its FSDP2-sharded model
gathered whole, and the step's groups, losses and tokens are the one rank's. No Ray."""

from __future__ import annotations

import datetime
import os

import torch

from tests.ranks import free_port, run_ranks

STEPS, BATCH = 2, 4


def _rank(rank: int, world: int, port: int, prepared: str, tokenizer: str, out: str) -> None:
    import torch.distributed as dist

    from raylm.config import load_config
    from raylm.model.spec import ModelSpec
    from raylm.workers.grpo import PromptRows, Reinforce
    from tests.conftest import tokenizer_vocab
    from tests.unit.workers.test_colocated import micro_batch

    if world > 1:  # a rank left waiting in a collective fails in two minutes, not thirty
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    cfg = load_config(None, [
        "--model.preset=tiny", "--train.precision=fp32", "--train.objective=grpo",
        "--data.format=prompt", "--rl.reward=exact_match", "--rl.generators=0",
        "--rl.group_size=4", "--rl.max_completion_tokens=6",
        f"--train.global_batch_size={BATCH}", f"--train.micro_batch_size={BATCH // world}",
        f"--train.steps={STEPS}", "--optim.lr=0.05"])
    vocab = tokenizer_vocab(__import__("pathlib").Path(tokenizer))
    built = ModelSpec.from_config(cfg, vocab_size=vocab, eos_id=0).build(torch.device("cpu"))
    optimizer = torch.optim.AdamW(built.model.parameters(), lr=cfg.optim.lr, foreach=False)
    rl = Reinforce(cfg, prepared=prepared, eos_id=0, vocab_size=vocab, rank=rank)
    split = PromptRows(prepared, "train", prompt_field="prompt").split
    share = BATCH // world
    steps = [[micro_batch(split, [BATCH * s + share * rank + k for k in range(share)])]
             for s in range(STEPS)]
    stream = rl.begin(built, step=0, batches=iter([m for s in steps for m in s]),
                      accumulation=1, resumed=None)
    seen = []
    for micro in steps:
        assert next(stream)["row"].tolist() == micro[0]["row"].tolist()
        loss, _, figures = rl.step(built, optimizer, micro, accumulation=1, grad_clip=1.0)
        seen.append((float(loss), rl.tokens, {k: float(v) for k, v in figures.items()
                                               if k in ("rl_reward", "rl_completion_len")}))
    completions = [g.completions for g in rl.groups(steps[0], rl.sampling, "train")[0]]
    logits = gathered_forwards(built.model, forwards=1 + 2 * rank) if world > 1 else None
    torch.save({"seen": seen, "completions": completions, "logits": logits},
               os.path.join(out, f"{world}-{rank}.pt"))
    if world > 1:
        dist.destroy_process_group()


def gathered_forwards(model: torch.nn.Module, *, forwards: int) -> torch.Tensor:
    """The logits of one input after ``forwards`` passes inside ``gathered`` (ranks run
    different numbers, as generations of different lengths do: a collective in any pass would
    leave one rank waiting), checking the shards are given back and training mode restored."""
    from torch.distributed.tensor import DTensor

    from raylm.model.parallelize import gathered

    def sharded() -> bool:
        return all(isinstance(p, DTensor) for p in model.parameters())

    assert sharded() and model.training
    with torch.no_grad(), gathered(model):
        assert not model.training and not any(isinstance(p, DTensor)
                                              for p in model.parameters())
        for _ in range(forwards):
            logits = model(input_ids=torch.arange(5, 13)[None]).logits
    assert sharded() and model.training
    return logits


def test_two_colocated_ranks_sample_and_train_as_one(tmp_path, tokenizer_dir):
    from tests.unit.workers.test_colocated import prompt_set

    prompt_set(tmp_path / "prepared", tokenizer_dir)
    for world in (1, 2):
        run_ranks(_rank, args=(world, free_port(), str(tmp_path / "prepared"),
                               str(tokenizer_dir), str(tmp_path)), world=world)
    one = torch.load(tmp_path / "1-0.pt")
    two = [torch.load(tmp_path / f"2-{r}.pt") for r in (0, 1)]
    # Each rank sampled its half of the step's groups, as the one rank sampled them.
    assert two[0]["completions"] + two[1]["completions"] == one["completions"]
    for (loss, tokens, figures), *theirs in zip(one["seen"], two[0]["seen"], two[1]["seen"],
                                                strict=True):
        for their_loss, their_tokens, _ in theirs:
            assert abs(their_loss - loss) < 1e-5 and their_tokens == tokens
        assert theirs[0][2] == figures  # rank 0's figures are of every rank's groups
    # Gathered whole, both ranks compute with the same weights.
    assert torch.equal(two[0]["logits"], two[1]["logits"])
