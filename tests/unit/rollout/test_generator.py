"""The generator (raylm.rollout.generator) in this process: completions that depend on the
weights, the prompt and its position alone, their log-probabilities, rewards and versions."""

from __future__ import annotations

import math

import pytest
import torch

from raylm.rollout.generator import Generator, Prompt, Sampling
from tests.conftest import save_tiny_llama, tokenizer_vocab


@pytest.fixture(scope="module")
def make(tokenizer_dir):
    tokenizer_json = (tokenizer_dir / "tokenizer.json").read_text()
    vocab = tokenizer_vocab(tokenizer_dir)

    def make(reward: str = "exact_match", seed: int = 0, **sections) -> Generator:
        cfg = {"model": {"preset": "tiny"}, "train": {"precision": "fp32", "seed": seed},
               **sections}
        return Generator(config=cfg, vocab_size=vocab, eos_id=0,
                         tokenizer_json=tokenizer_json, reward=reward)
    return make


def prompt(position: int, answer: str = "x") -> Prompt:
    return Prompt(position, [5, 17, 23, 42], "say x", {"answer": answer})


SAMPLING = Sampling(group_size=4, temperature=1.0, max_tokens=6)


def test_a_group_depends_on_its_position_not_on_its_batch_or_generator(make):
    a, b = make(), make()
    alone = b.generate([prompt(7)], SAMPLING, version=0)[0]
    batch = a.generate([prompt(3), prompt(7), prompt(9)], SAMPLING, version=0)
    assert batch[1].completions == alone.completions
    assert batch[0].completions != batch[1].completions  # positions seed differently
    group = batch[1]
    assert len(group.completions) == 4 and group.version == 0 and group.position == 7
    assert all(len(c) <= 6 for c in group.completions)
    assert group.truncated == [c[-1] != 0 for c in group.completions]


def test_log_probabilities_are_the_sampling_weights_teacher_forced(make):
    gen = make()
    group = gen.generate([prompt(1)], Sampling(group_size=2, temperature=0.7, max_tokens=5),
                         version=0)[0]
    for completion, logps in zip(group.completions, group.logps, strict=True):
        ids = torch.tensor([prompt(1).ids + completion])
        with torch.no_grad():
            logits = gen.built.model(input_ids=ids).logits[0].float() / 0.7
        want = torch.log_softmax(logits[3:-1], -1).gather(
            -1, ids[0, 4:, None]).squeeze(-1)
        assert logps == pytest.approx(want.tolist(), abs=1e-5)
        assert all(v <= 0 and math.isfinite(v) for v in logps)


def test_loaded_weights_change_the_version_and_the_completions(make):
    gen = make()
    before = gen.generate([prompt(2)], SAMPLING, version=0)[0]
    trained = {n: p.detach() + 0.5 * torch.randn_like(p)
               for n, p in gen.built.model.named_parameters() if p.requires_grad}
    assert gen.load(1, trained) == 1
    after = gen.generate([prompt(2)], SAMPLING, version=1)[0]
    assert after.version == 1 and after.completions != before.completions
    with pytest.raises(RuntimeError, match="holds version 1"):
        gen.generate([prompt(2)], SAMPLING, version=0)
    with pytest.raises(ValueError, match="weights of version 2 name 1 tensors"):
        gen.load(2, {"model.norm.weight": torch.ones(64)})


def test_rewards_score_each_completion(make):
    gen = make("final_number")
    group = gen.generate([prompt(4, answer="3")], SAMPLING, version=0)[0]
    texts = [gen.tokenizer.decode(c, skip_special_tokens=True) for c in group.completions]
    from raylm.rollout.rewards import final_number
    assert group.rewards == [final_number("", t, answer="3") for t in texts]
    assert group.parts == {"reward": group.rewards} and group.failed == 0
    assert set(group.seconds) == {"generate_s", "reward_s"}


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_the_kl_reference_is_the_starting_model_whatever_weights_are_loaded(make, lora,
                                                                             tmp_path,
                                                                             tokenizer_dir):
    """With rl.kl_coef each completion carries its tokens' log-probabilities under the starting
    model: a frozen copy of it (full fine-tuning) or the base with the adapters off (LoRA)."""
    path = save_tiny_llama(tmp_path / "base", vocab_size=tokenizer_vocab(tokenizer_dir))
    sections = {"rl": {"kl_coef": 0.1}, "lora": {"rank": lora},
                "model": {"path": str(path)}}
    gen, start = make(**sections), make(**sections)
    first = gen.generate([prompt(5)], SAMPLING, version=0)[0]
    for ref, logps in zip(first.ref_logps, first.logps, strict=True):
        assert ref == pytest.approx(logps, abs=1e-6)
    torch.manual_seed(1)
    trained = {n: p.detach() + 0.5 * torch.randn_like(p)
               for n, p in gen.built.model.named_parameters() if p.requires_grad}
    gen.load(1, trained)
    group = gen.generate([prompt(5)], SAMPLING, version=1)[0]
    for completion, ref, logps in zip(group.completions, group.ref_logps, group.logps,
                                      strict=True):
        ids = torch.tensor([prompt(5).ids + completion])
        with torch.no_grad():
            want = start.logps(ids, 4, [completion], SAMPLING.temperature)[0]
        assert ref == pytest.approx(want, abs=1e-5)
        assert ref != pytest.approx(logps, abs=1e-3)
    assert make().generate([prompt(5)], SAMPLING, version=0)[0].ref_logps is None
