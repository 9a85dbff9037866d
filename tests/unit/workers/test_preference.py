"""Preference losses (raylm.workers.preference) against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from raylm.config import DpoConfig
from raylm.model.assemble import row_logps
from raylm.workers.preference import Answers, pair_losses, segment_sums, trained


def answer_logps(logits, targets, segments, *, num_segments):
    """Each answer's summed log-probability of its trained targets, and their count, from a
    (B, T, V) batch's whole logits, through the step's pieces. ``segments`` (B, T): each
    target's answer across the batch, or -1 for an untrained one."""
    at, index = trained(segments)
    rows = logits.reshape(-1, logits.size(-1)).index_select(0, at)
    return segment_sums(row_logps(rows, targets, at), index, num_segments=num_segments)


def answers(chosen, rejected, chosen_len=(1.0,), rejected_len=(1.0,)) -> Answers:
    t = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    return Answers(t(chosen), t(rejected), t(chosen_len), t(rejected_len))


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


POLICY = answers([-4.0], [-6.0], [4.0], [2.0])
REFERENCE = answers([-5.0], [-5.5], [4.0], [2.0])


def test_dpo_sigmoid_with_and_without_label_smoothing():
    # Log-ratios: chosen -4 - (-5) = 1, rejected -6 - (-5.5) = -0.5; beta 0.1: z = 0.15.
    losses, m = pair_losses(POLICY, REFERENCE, DpoConfig(loss="sigmoid", beta=0.1))
    assert losses.item() == pytest.approx(-logsig(0.15), rel=1e-6)
    assert m["chosen_reward"].item() == pytest.approx(0.1)
    assert m["rejected_reward"].item() == pytest.approx(-0.05)
    assert m["margin"].item() == pytest.approx(0.15) and m["accuracy"].item() == 1.0
    smooth, _ = pair_losses(POLICY, REFERENCE,
                            DpoConfig(loss="sigmoid", beta=0.1, label_smoothing=0.2))
    assert smooth.item() == pytest.approx(-0.8 * logsig(0.15) - 0.2 * logsig(-0.15), rel=1e-6)


def test_ipo_divides_each_log_ratio_by_its_answer_length():
    losses, _ = pair_losses(POLICY, REFERENCE, DpoConfig(loss="ipo", beta=0.5))
    d = 1.0 / 4 - (-0.5) / 2  # 0.5
    assert losses.item() == pytest.approx((d - 1 / (2 * 0.5)) ** 2, rel=1e-6)


def test_simpo_needs_no_reference_and_takes_a_margin():
    losses, m = pair_losses(POLICY, None, DpoConfig(loss="simpo", beta=2.0, simpo_gamma=0.5))
    z = 2.0 * (-4.0 / 4) - 2.0 * (-6.0 / 2) - 0.5  # -2 + 6 - 0.5 = 3.5
    assert losses.item() == pytest.approx(-logsig(z), rel=1e-6)
    assert m["margin"].item() == pytest.approx(4.0)
    with pytest.raises(ValueError, match="reference"):
        pair_losses(POLICY, None, DpoConfig(loss="sigmoid", beta=0.1))
    with pytest.raises(ValueError, match="dpo.loss"):
        pair_losses(POLICY, REFERENCE, DpoConfig(loss="kto", beta=0.1))


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


def trl_step(policy, reference, tok, *, loss: str, output_dir):
    """TRL's DPOTrainer on :data:`PAIRS` (beta 0.1, fp32, CPU): its trainer, first batch, and
    loss on that batch, whose backward has run (the policy holds TRL's gradients)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(output_dir), per_device_train_batch_size=4, beta=0.1,
                     loss_type=[loss], report_to=[], use_cpu=True, bf16=False,
                     disable_dropout=True, dataset_num_proc=None)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args,
                         train_dataset=Dataset.from_dict(PAIRS), processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    value = trainer.compute_loss(trainer.model, batch)
    value.backward()
    return trainer, batch, value


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

    from transformers import AutoTokenizer

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
    trainer, batch, trl_loss_value = trl_step(policy, reference, tok, loss=trl_loss,
                                              output_dir=tmp_path)

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
    losses, _ = pair_losses(logps(ours), ref, DpoConfig(loss=loss, beta=0.1))
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
    mine, m = pair_losses(Answers(sums_c, sums_r, lens_c, lens_r), None,
                          DpoConfig(loss="simpo", beta=2.0, simpo_gamma=0.5,
                                    label_smoothing=0.1))
    torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(m["chosen_reward"], chosen)
    torch.testing.assert_close(m["rejected_reward"], rejected)


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_raylms_packed_lora_step_equals_trls_dpo_trainer(tokenizer_dir, tmp_path, loss):
    """The whole step as raylm runs it, against TRL's DPOTrainer on the same pairs: TRL's
    tokenized sequences, packed as raylm packs pairs (several pairs in one block, each half a
    document of its own), scored by a raylm-built LoRA model with its adapters switched off as
    the reference; TRL is given the same adapted model and the base as its reference model.
    The loss and every adapter's gradient agree (fp32)."""
    import numpy as np
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raylm.data.packing import ExamplePacker, position_ids
    from raylm.model.assemble import build_training_model
    from raylm.workers.preference import answer_segments, pair_terms

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.pad_token = tok.eos_token
    base_dir = tmp_path / "base"
    tiny_llama(len(tok), seed=0).save_pretrained(base_dir)
    lora = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    built = build_training_model(preset=None, path=str(base_dir), vocab_size=len(tok),
                                 eos_id=tok.eos_token_id, device=torch.device("cpu"),
                                 precision="fp32", cross_document=False, seed=0, lora=lora)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # adapters away from the identity: the policy is not its reference
        for name, p in built.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    policy = inject_adapter_in_model(
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        AutoModelForCausalLM.from_pretrained(base_dir))
    policy.load_state_dict(built.model.state_dict())
    for name, p in policy.named_parameters():
        p.requires_grad_(".lora_" in name)
    reference = AutoModelForCausalLM.from_pretrained(base_dir)
    trainer, batch, theirs = trl_step(policy, reference, tok, loss=loss,
                                      output_dir=tmp_path / "trl")

    # TRL's rows: the chosen sequences, then the rejected, right-padded.
    ids, keep, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    pairs = len(ids) // 2
    halves = [(ids[i][keep[i].bool()].numpy(), completion[i][keep[i].bool()].numpy())
              for i in range(len(ids))]
    examples = []
    for p in range(pairs):
        (c_ids, c_mask), (r_ids, r_mask) = halves[p], halves[pairs + p]
        examples.append((np.concatenate([c_ids, r_ids]).astype(np.int32),
                         np.concatenate([c_mask, 2 * r_mask]).astype(np.uint8), len(c_ids)))
    length = sum(len(e[0]) for e in examples) + 5
    packer = ExamplePacker(length, pad_id=tok.eos_token_id)
    packer.add(examples)
    blocks, starts, masks, _ = packer.finish()
    packed = {"input_ids": torch.from_numpy(blocks.astype(np.int64)),
              "position_ids": torch.from_numpy(position_ids(starts[0], length))[None],
              "loss_mask": torch.from_numpy(masks)}
    assert answer_segments(packed["position_ids"], packed["loss_mask"])[1] == pairs
    loss_sum, _ = pair_terms(built, packed, DpoConfig(loss=loss, beta=0.1))
    mine = loss_sum / pairs
    mine.backward()
    assert mine.item() == pytest.approx(theirs.item(), abs=1e-5)
    trl_grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.requires_grad}
    grads = {n: p.grad for n, p in built.model.named_parameters() if p.requires_grad}
    assert grads.keys() == trl_grads.keys() and len(grads) == 8
    for name, g in grads.items():
        torch.testing.assert_close(g, trl_grads[name], atol=1e-5, rtol=1e-4, msg=name)
