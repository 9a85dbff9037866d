"""Context parallelism (parallel.context=2): two gloo ranks, each holding half of every
sequence, against one process holding them whole (fp32, CPU, no Ray): the gradients of one
backward and the losses of AdamW steps, on packed blocks of several documents (a document
across the shards' boundary included) with per-document attention and without, blocks with
a loss mask (chat rows), evaluation and the first batch's check of pretrained weights; for
the tiny Llama, a grouped-query Llama whose two key/value heads split over the ranks, one
whose single key/value head must be repeated, and a Qwen3 (its query/key norms)."""

from __future__ import annotations

import pytest
import torch

from raylm.model.parallelize import DATA_PARALLEL, ParallelPlan, layout_of
from tests.distributed.shared import BATCH, SEQ, VOCAB, data, masked_data, whole, worker
from tests.ranks import free_port, run_ranks

STEPS = 3
CP2 = ParallelPlan(context=2)
# Each row's documents start here (a block of SEQ tokens; the shards' boundary is at 16).
STARTS = [[0, 5, 20], [0, 14, 19, 30], [0], [0, 16]]


def packed(step: int) -> dict[str, torch.Tensor]:
    batch = data(step)
    positions = torch.stack([torch.tensor(
        [t - max(s for s in starts if s <= t) for t in range(SEQ)]) for starts in STARTS])
    return {**batch, "position_ids": positions}


def save_models(root) -> dict[str, str]:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                 tie_word_embeddings=False)
    shapes = {"llama-kv2": LlamaConfig(num_key_value_heads=2, **shape),
              "llama-kv1": LlamaConfig(num_key_value_heads=1, **shape),
              "qwen3": Qwen3Config(num_key_value_heads=2, head_dim=16, **shape)}
    paths = {}
    for name, config in shapes.items():
        torch.manual_seed(0)
        paths[name] = str(root / name)
        AutoModelForCausalLM.from_config(config).save_pretrained(paths[name])
    return paths


def run(world: int, rank: int, out: dict, models: dict[str, str]) -> None:
    from raylm.model.assemble import build_training_model, evaluate, logit_spread
    from raylm.workers.optim import build_optimizer
    from raylm.workers.step import train_step

    plan = CP2 if world > 1 else DATA_PARALLEL
    for name, path in [("tiny", None), *models.items()]:
        for across in (False, True):
            built = build_training_model(
                preset="tiny" if path is None else None, path=path, vocab_size=VOCAB,
                eos_id=0, device=torch.device("cpu"), precision="fp32", seed=0, plan=plan,
                cross_document=across)
            got = out[name, across] = {"backend": built.attention.backend}
            step = dict(accumulation=1, cross_document=across)
            # One SGD step at lr 1 with no clipping: the change of each parameter is its
            # gradient.
            sgd = torch.optim.SGD(built.model.parameters(), lr=1.0)
            before = {n: whole(p) for n, p in built.model.named_parameters()}
            got["first"] = [float(train_step(built, sgd, [packed(0)], grad_clip=0.0,
                                             **step)[0])]
            got["grads"] = {n: before[n] - whole(p) for n, p in built.model.named_parameters()}
            opt = build_optimizer(built.model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95),
                                  device_type="cpu")
            got["losses"] = [float(x) for s in range(STEPS) for x in train_step(
                built, opt, [packed(s + 1)], grad_clip=1.0, **step)]
            chat = {**masked_data(), "position_ids": packed(0)["position_ids"]}
            got["masked"] = [float(x) for x in train_step(built, opt, [chat], grad_clip=1.0,
                                                          **step)]
            got["val"] = [evaluate(built, [packed(9)], cross_document=across),
                          evaluate(built, [chat], cross_document=across),
                          # The first batch's check that pretrained weights loaded.
                          logit_spread(built, packed(0), cross_document=across)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    models = save_models(root)
    path = str(root / "rank0.pt")
    run_ranks(worker, args=(2, free_port(), path, models, run), world=2)
    reference: dict = {}
    torch.set_num_threads(1)
    run(1, 0, reference, models)
    return torch.load(path), reference


def test_layout_puts_a_sequence_on_consecutive_ranks():
    # Row-major over (pp, dp, cp, tp): ranks 0,1 hold the halves of data slice 0's sequences.
    lay = [layout_of(r, 4, CP2) for r in range(4)]
    assert [(x.dp_rank, x.cp_rank) for x in lay] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert lay[3].dp_size == 2 and lay[3].data_ranks() == [0, 2]
    with pytest.raises(ValueError, match="parallel.context=2 groups"):
        layout_of(0, 3, CP2)


def test_sharded_sequences_train_as_whole_ones(results):
    two, one = results
    assert set(two) == set(one)
    for key, got in two.items():
        ref = one[key]
        assert got["backend"] == "all-to-all+sdpa-flash-cpu", key
        # Losses and gradient norms within four ulps of a loss near 5 (the shards' gradients
        # are summed in another order, and AdamW carries that into the next steps).
        for what in ("first", "losses", "masked", "val"):
            assert got[what] == pytest.approx(ref[what], abs=2e-6), (key, what)
        for n, g in got["grads"].items():
            torch.testing.assert_close(g, ref["grads"][n], atol=1e-6, rtol=0, msg=str((key, n)))
    # Per-document attention changes the losses: the documents were kept apart on both.
    assert two["tiny", False]["losses"] != two["tiny", True]["losses"]


def test_the_shards_positions_are_the_blocks():
    from raylm.model.context import Context

    batch = packed(0)
    halves = [Context(None, 2, r).shard(batch, cross_document=False) for r in (0, 1)]
    # Each half holds 16 targets and the token before them; the tokens meet at position 16.
    assert [h["input_ids"].shape for h in halves] == [torch.Size([BATCH, 17])] * 2
    assert torch.equal(halves[0]["input_ids"][:, -1], halves[1]["input_ids"][:, 0])
    assert halves[1]["position_ids"][1].tolist()[:4] == [2, 3, 4, 0]  # 14 and 19 start docs
    across = Context(None, 2, 1).shard(batch, cross_document=True)
    assert across["position_ids"][0].tolist() == list(range(16, 33))
    with pytest.raises(ValueError, match="does not divide the blocks' 32 tokens"):
        Context(None, 3, 0).shard(batch, cross_document=True)


def test_attention_that_does_not_split_is_refused_before_ray_starts():
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen3Config

    from raylm.model.context import check

    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                 num_hidden_layers=2, intermediate_size=128)
    check(LlamaConfig(**shape), context=4)
    check(Qwen3Config(**shape), context=2)  # a window it does not use
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        check(LlamaConfig(**shape), context=3)
    for config in (Gemma3TextConfig(**shape), MistralConfig(sliding_window=16, **shape)):
        with pytest.raises(ValueError, match="sliding windows or soft-capped logits"):
            check(config, context=2)
