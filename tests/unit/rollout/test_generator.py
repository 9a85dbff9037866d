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


def test_a_qlora_generator_samples_from_the_nf4_base_the_trainers_score(tmp_path,
                                                                        tokenizer_dir):
    """The generators build the trainers' model from the same spec: under QLoRA, the NF4 base
    and the mixed precision, so the first step's importance ratio (the trainers' probability of
    each sampled token over the generator's) is 1 within float noise (1e-3). An unquantized
    base, what the generators built before, is off by the quantization's error (up to 0.1
    here)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from raylm.config import config_from_dict
    from raylm.model.assemble import answer_rows, row_logps
    from raylm.model.spec import ModelSpec
    from raylm.workers.grpo import rollout_batch

    vocab = tokenizer_vocab(tokenizer_dir)
    torch.manual_seed(0)  # NF4 splits 256-wide weights into whole blocks; the tiny preset's do not
    AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=64)
    ).save_pretrained(str(tmp_path / "base"))
    sections = {"model": {"path": str(tmp_path / "base")},
                "train": {"precision": "bf16-mixed", "seed": 0},
                "data": {"cross_document_attention": False},
                "lora": {"rank": 4, "alpha": 8, "target_modules": "auto"}}
    sampling = Sampling(group_size=3, temperature=1.0, max_tokens=5)

    def ratios(base_quantization: str) -> torch.Tensor:
        lora = {**sections["lora"], "base_quantization": base_quantization}
        gen = Generator(config={**sections, "lora": lora}, vocab_size=vocab, eos_id=0,
                        tokenizer_json=(tokenizer_dir / "tokenizer.json").read_text(),
                        reward="exact_match")
        group = gen.generate([prompt(3)], sampling, version=0)[0]
        trainer = ModelSpec.from_config(config_from_dict({**sections, "lora": {
            **lora, "base_quantization": "nf4"}}), vocab_size=vocab, eos_id=0
                                        ).build(torch.device("cpu"))
        rows = rollout_batch([group], torch.zeros(3), pad_id=0)
        with torch.no_grad():
            logits, at = answer_rows(trainer, rows.batch, rows.at)
            logp = row_logps(logits / sampling.temperature, rows.batch["input_ids"][:, 1:], at)
        return (logp - rows.old_logp).exp()

    same, apart = ratios("nf4"), ratios("none")
    assert (same - 1).abs().max() < 1e-3, same
    assert (apart - 1).abs().max() > 0.03, apart
