"""Colocated GRPO (rl.generators=0) in this process: the trainer samples its own groups with
its own model, which are the groups an actor's generator (the same class, built as an actor
builds it) samples from the same weights, token for token, step after step; and sampling
leaves the trainer's random state and training mode as they were."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from raylm.config import ConfigError, load_config
from raylm.contracts import LAYOUT, PREPARED_MANIFEST
from raylm.data.preparation import BlockWriter
from raylm.model.spec import ModelSpec
from raylm.rollout.generator import Generator
from raylm.workers.grpo import PromptRows, Reinforce, prompt_items, trainable_weights
from tests.conftest import tokenizer_vocab

L = 12  # a block: the prompt (8 tokens), then padding as a document of its own
GROUP = 8


def prompt_set(root, tokenizer_dir, *, rows: int = 24) -> None:
    """A prepared prompt set as `raylm prepare` lays one out: blocks of one prompt each, every
    prompt row kept beside its tokens."""
    layout = {"block_length": L, "eos_id": 0, "seq_len": L - 1, "loss_mask": False,
              "sources": [], "prompt_rows": True, "splits": {}}
    rng = np.random.default_rng(0)
    for split, n in (("train", rows), ("val", GROUP)):
        w = BlockWriter(root / split, block_length=L, group_rows=GROUP, prompt_rows=True)
        blocks = np.zeros((n, L), dtype=np.int32)
        blocks[:, :8] = rng.integers(5, 200, size=(n, 8))
        w.add(blocks, [np.array([0, 8], dtype=np.int32)] * n,
              [np.zeros(2, dtype=np.int64)] * n,
              rows=[json.dumps({"prompt": f"q{i}", "answer": "a"}) for i in range(n)])
        w.close()
        layout["splits"][split] = {"blocks": n, "tail_tokens_dropped": 0, "files": w.files,
                                   "row_group_sizes": w.group_sizes,
                                   "file_groups": w.file_groups}
    (root / LAYOUT).write_text(json.dumps(layout))
    (root / PREPARED_MANIFEST).write_text(json.dumps({"tokenizer_path": str(tokenizer_dir)}))


def micro_batch(split, rows: list[int]) -> dict[str, torch.Tensor]:
    """Stored rows as the training stream hands them to the step."""
    ids = torch.tensor([split.column_of_group(r // GROUP, "input_ids")[r % GROUP]
                        for r in rows])
    positions = torch.cat([torch.arange(8).expand(len(rows), 8),
                           torch.arange(L - 8).expand(len(rows), L - 8)], dim=1)
    return {"input_ids": ids, "position_ids": positions, "row": torch.tensor(rows),
            "sample_position": torch.tensor(rows)}


def test_colocated_groups_are_an_actors_token_for_token_and_leave_the_rng(tmp_path,
                                                                           tokenizer_dir):
    vocab = tokenizer_vocab(tokenizer_dir)
    prompt_set(tmp_path / "prepared", tokenizer_dir)
    cfg = load_config(None, [
        "--model.preset=tiny", "--train.precision=fp32", "--train.objective=grpo",
        "--data.format=prompt", "--rl.reward=exact_match", "--rl.generators=0",
        "--rl.group_size=4", "--rl.max_completion_tokens=6", "--train.global_batch_size=4",
        "--train.micro_batch_size=4", "--train.steps=3", "--optim.lr=0.05",
        "--rl.kl_coef=0.05"])
    prepared = str(tmp_path / "prepared")
    built = ModelSpec.from_config(cfg, vocab_size=vocab, eos_id=0).build(torch.device("cpu"))
    optimizer = torch.optim.AdamW(built.model.parameters(), lr=cfg.optim.lr)
    rl = Reinforce(cfg, prepared=prepared, eos_id=0, vocab_size=vocab, rank=0)
    split = PromptRows(prepared, "train", prompt_field="prompt")
    steps = [[micro_batch(split.split, [4 * s + k for k in range(4)])] for s in range(3)]
    stream = rl.begin(built, step=0, batches=iter([m for s in steps for m in s]),
                      accumulation=1, resumed=None)
    assert rl.pool is None and rl.local is not None
    # An actor's generator: built as the pool builds one (its own threads, its own device).
    actor = Generator(config=cfg.to_dict(), vocab_size=vocab, eos_id=0,
                      tokenizer_json=(tokenizer_dir / "tokenizer.json").read_text(),
                      reward="exact_match")
    for s, micro in enumerate(steps):
        assert next(stream)["row"].tolist() == micro[0]["row"].tolist()
        actor.load(s, trainable_weights(built.model))
        prompts = [split.prompt(*item) for item in prompt_items(micro)]
        expected = actor.generate(prompts, rl.sampling, version=s)
        torch.manual_seed(123)
        state = torch.random.get_rng_state()
        mine, every = rl.groups(micro, rl.sampling, "train")
        assert torch.equal(torch.random.get_rng_state(), state)
        assert [g.completions for g in mine] == [g.completions for g in expected]
        assert [g.logps for g in mine] == [g.logps for g in expected]
        # The full fine-tune's KL reference: the starting weights, frozen, here built anew.
        assert [g.ref_logps for g in mine] == [g.ref_logps for g in expected]
        assert (s == 0) == ([g.ref_logps for g in mine] == [g.logps for g in mine])
        assert [g.position for g in every] == [g.position for g in expected]
        loss, norm, figures = rl.step(built, optimizer, micro, accumulation=1, grad_clip=1.0)
        assert torch.isfinite(loss) and figures["rl_generators"] == 0
        assert figures["rl_staleness_max"] == 0 and rl.tokens > 0
    # The trainer's generator samples with the trainer's model itself (no copy, no weights
    # handed over), which is back in training mode once it has.
    assert rl.local.built is built and built.model.training
    assert 0.0 <= rl.evaluate(built, [micro_batch(PromptRows(prepared, "val",
                                                             prompt_field="prompt").split,
                                                  list(range(4)))])["val_reward"] <= 1.0


def test_colocation_samples_on_policy_only():
    with pytest.raises(ConfigError, match="rl.max_staleness.*0 with rl.generators=0"):
        load_config(None, ["--rl.generators=0", "--rl.max_staleness=1"])
    with pytest.raises(ConfigError, match="rl.generators"):
        load_config(None, ["--rl.generators=[0, 2]"])
