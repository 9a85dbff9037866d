"""Preference losses (raylm.workers.preference) against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from raylm.workers.preference import Answers, answer_logps, pair_losses


def answers(chosen, rejected, chosen_len=(1.0,), rejected_len=(1.0,)) -> Answers:
    t = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    return Answers(t(chosen), t(rejected), t(chosen_len), t(rejected_len))


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


POLICY = answers([-4.0], [-6.0], [4.0], [2.0])
REFERENCE = answers([-5.0], [-5.5], [4.0], [2.0])


def test_dpo_sigmoid_with_and_without_label_smoothing():
    # Log-ratios: chosen -4 - (-5) = 1, rejected -6 - (-5.5) = -0.5; beta 0.1: z = 0.15.
    losses, m = pair_losses(POLICY, REFERENCE, loss="sigmoid", beta=0.1)
    assert losses.item() == pytest.approx(-logsig(0.15), rel=1e-6)
    assert m["chosen_reward"].item() == pytest.approx(0.1)
    assert m["rejected_reward"].item() == pytest.approx(-0.05)
    assert m["margin"].item() == pytest.approx(0.15) and m["accuracy"].item() == 1.0
    smooth, _ = pair_losses(POLICY, REFERENCE, loss="sigmoid", beta=0.1, label_smoothing=0.2)
    assert smooth.item() == pytest.approx(-0.8 * logsig(0.15) - 0.2 * logsig(-0.15), rel=1e-6)


def test_ipo_divides_each_log_ratio_by_its_answer_length():
    losses, _ = pair_losses(POLICY, REFERENCE, loss="ipo", beta=0.5)
    d = 1.0 / 4 - (-0.5) / 2  # 0.5
    assert losses.item() == pytest.approx((d - 1 / (2 * 0.5)) ** 2, rel=1e-6)


def test_simpo_needs_no_reference_and_takes_a_margin():
    losses, m = pair_losses(POLICY, None, loss="simpo", beta=2.0, simpo_gamma=0.5)
    z = 2.0 * (-4.0 / 4) - 2.0 * (-6.0 / 2) - 0.5  # -2 + 6 - 0.5 = 3.5
    assert losses.item() == pytest.approx(-logsig(z), rel=1e-6)
    assert m["margin"].item() == pytest.approx(4.0)
    with pytest.raises(ValueError, match="reference"):
        pair_losses(POLICY, None, loss="sigmoid", beta=0.1)
    with pytest.raises(ValueError, match="dpo.loss"):
        pair_losses(POLICY, REFERENCE, loss="kto", beta=0.1)


def test_answer_logps_sum_each_answers_targets():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, requires_grad=True)
    targets = torch.randint(0, 7, (2, 5))
    # Block 0: answer 0 at targets 1-2, answer 1 at 4; block 1: answer 2 at 0-3.
    segments = torch.tensor([[-1, 0, 0, -1, 1], [2, 2, 2, 2, -1]])
    sums, counts = answer_logps(logits, targets, segments, num_segments=3)
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want = torch.stack([logp[0, 1] + logp[0, 2], logp[0, 4], logp[1, :4].sum()])
    torch.testing.assert_close(sums, want)
    assert counts.tolist() == [2.0, 1.0, 4.0]
    sums.sum().backward()  # gradients flow to the logits of trained targets only
    assert logits.grad[0, 0].abs().sum() == 0 and logits.grad[0, 1].abs().sum() > 0


PAIRS = {
    "prompt": ["Reverse: red green blue\n", "Reverse: one two\n", "Reverse: sun moon star\n",
               "Reverse: up down\n"],
    "chosen": ["blue green red", "two one", "star moon sun", "down up"],
    "rejected": ["blue red green", "one two", "star sun moon", "up down"],
}


def tiny_llama(vocab: int, seed: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=128,
        tie_word_embeddings=False))


@pytest.mark.parametrize(("loss", "trl_loss"), [("sigmoid", "sigmoid"), ("ipo", "ipo")])
def test_dpo_and_ipo_equal_trls_loss_and_gradients(tokenizer_dir, tmp_path, loss, trl_loss):
    """TRL's DPOTrainer computes its loss on a batch of pairs with a tiny model; the same
    sequences through raylm's functions give the same loss and the same gradients (fp32)."""
    import copy

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.pad_token = tok.eos_token
    policy = tiny_llama(len(tok), seed=0)
    # The reference: the policy's starting weights moved a little, so that the log-ratios
    # are not all zero.
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ours = copy.deepcopy(policy)
    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, beta=0.1,
                     loss_type=[trl_loss], report_to=[], use_cpu=True, bf16=False,
                     disable_dropout=True, dataset_num_proc=None)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args,
                         train_dataset=Dataset.from_dict(PAIRS), processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    trl_loss_value = trainer.compute_loss(trainer.model, batch)
    trl_loss_value.backward()

    ids, completion = batch["input_ids"], batch["completion_mask"]
    pairs = len(ids) // 2  # TRL's batch: the chosen sequences, then the rejected
    # Each row is one answer: its completion targets are trained.
    segments = torch.where(completion[:, 1:].bool(),
                           torch.arange(len(ids))[:, None].expand(-1, ids.shape[1] - 1), -1)

    def logps(model):
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits[:, :-1]
        sums, counts = answer_logps(logits, ids[:, 1:], segments, num_segments=len(ids))
        return Answers(sums[:pairs], sums[pairs:], counts[:pairs], counts[pairs:])

    with torch.no_grad():
        ref = logps(reference)
    losses, _ = pair_losses(logps(ours), ref, loss=loss, beta=0.1)
    mine = losses.mean()
    mine.backward()
    assert mine.item() == pytest.approx(trl_loss_value.item(), abs=1e-5)
    theirs = dict(trainer.model.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_simpo_equals_trls_cpo_loss_on_mean_log_probabilities():
    """SimPO is in TRL's CPO trainer; its loss method, given the answers' mean
    log-probabilities (TRL averages them for simpo), is the computation compared."""
    from types import SimpleNamespace

    from trl.experimental.cpo import CPOTrainer

    torch.manual_seed(1)
    sums_c, sums_r = -torch.rand(6) * 20, -torch.rand(6) * 20
    lens_c, lens_r = torch.randint(1, 9, (6,)).float(), torch.randint(1, 9, (6,)).float()
    settings = SimpleNamespace(loss_type="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.1,
                               alpha=0.0, accelerator=SimpleNamespace(device="cpu"))
    theirs, chosen, rejected = CPOTrainer.cpo_loss(settings, sums_c / lens_c, sums_r / lens_r)
    mine, m = pair_losses(Answers(sums_c, sums_r, lens_c, lens_r), None, loss="simpo", beta=2.0,
                          simpo_gamma=0.5, label_smoothing=0.1)
    torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(m["chosen_reward"], chosen)
    torch.testing.assert_close(m["rejected_reward"], rejected)
