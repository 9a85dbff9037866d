"""The preference step (raylm.workers.preference) on packed pairs: which targets belong to
which answer, the reference as the base with the adapters off, and a loss averaged over the
global batch's pairs whatever the accumulation."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend

from raylm.config import DpoConfig
from raylm.model.assemble import build_training_model
from raylm.model.lora import adapters_off
from raylm.workers.preference import (
    FIGURES,
    answer_segments,
    pair_terms,
    preference_evaluate,
    preference_step,
)
from tests.conftest import head_matmuls
from tests.pairs import pair_blocks

VOCAB, SEQ = 96, 64
LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def build(lora: dict | None = LORA):
    return build_training_model(preset="tiny", path=None, vocab_size=VOCAB, eos_id=0,
                                device=torch.device("cpu"), precision="fp32", seed=0,
                                lora=lora, cross_document=False)


def test_each_trained_target_is_numbered_by_its_pair_and_answer():
    # Block 0: a pair (positions 0-3 chosen half, 4-7 rejected half), a second pair, padding.
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 0, 1],
                        [0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 2, 2, 0, 1, 1, 0, 2, 2, 0, 0],
                         [0, 1, 1, 0, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    segments, pairs = answer_segments(pos, mask)
    assert pairs == 3
    assert segments.tolist() == [
        [-1, 0, 0, -1, -1, 1, 1, -1, 2, 2, -1, 3, 3, -1, -1],
        [0 + 4, 4, -1, 5, 5, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1]]


def test_the_reference_is_the_base_and_the_first_dpo_loss_is_ln2():
    built = build()
    batch = pair_blocks(2, seq=SEQ, vocab=VOCAB)
    objective = DpoConfig(loss="sigmoid", beta=0.1)
    # Adapters start as the identity (B = 0): the policy is its reference, every reward 0.
    loss, figures = pair_terms(built, batch, objective)
    pairs = answer_segments(batch["position_ids"], batch["loss_mask"])[1]
    assert loss.item() / pairs == pytest.approx(math.log(2), abs=1e-6)
    assert figures["margin"].item() == 0.0
    # With trained adapters, switching them off gives the base model's outputs exactly.
    with torch.no_grad():
        for name, p in built.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids = batch["input_ids"][:, :-1]
    base = build(lora=None).model
    with torch.no_grad(), adapters_off(built.model):
        off = built.model(input_ids=ids).logits
    torch.testing.assert_close(off, base(input_ids=ids).logits, rtol=0, atol=0)
    assert not torch.allclose(built.model(input_ids=ids).logits, off)
    with pytest.raises(ValueError, match="no LoRA adapters"), adapters_off(base):
        pass


@pytest.mark.parametrize("lora, loss", [(LORA, "sigmoid"), (LORA, "ipo"), (None, "simpo")])
def test_accumulation_gives_the_update_of_one_micro_batch(lora, loss):
    """Micro-batches hold different numbers of pairs: the step averages over all of them."""
    batch = pair_blocks(4, seq=SEQ, vocab=VOCAB, seed=1)
    halves = [{k: v[:1] for k, v in batch.items()}, {k: v[1:] for k, v in batch.items()}]
    counts = [answer_segments(h["position_ids"], h["loss_mask"])[1] for h in halves]
    assert counts[0] * 3 != counts[1]  # unequal shares: a mean of means would differ
    objective = DpoConfig(loss=loss, beta=0.5 if loss != "simpo" else 2.0)
    results = []
    for micro in ([batch], halves):
        built = build(lora)
        trained = [p for p in built.model.parameters() if p.requires_grad]
        sgd = torch.optim.SGD(trained, lr=1.0)
        # The second step: LoRA's B starts at zero, so A's first gradient is zero.
        preference_step(built, sgd, micro, accumulation=len(micro), objective=objective,
                        grad_clip=0.0)
        before = [p.detach().clone() for p in trained]
        loss_value, norm, figures = preference_step(built, sgd, micro,
                                                    accumulation=len(micro),
                                                    objective=objective, grad_clip=0.0)
        results.append((loss_value, norm, figures,
                        [b - p.detach() for b, p in zip(before, trained, strict=True)]))
    (l1, n1, f1, d1), (l2, n2, f2, d2) = results
    assert float(l2) == pytest.approx(float(l1), rel=1e-5)
    assert float(n2) == pytest.approx(float(n1), rel=1e-5)
    assert set(f1) == set(FIGURES)
    for k in FIGURES:
        assert float(f2[k]) == pytest.approx(float(f1[k]), rel=1e-5, abs=1e-6), k
    for a, b in zip(d1, d2, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_dpo_steps_teach_the_preference_and_evaluation_reports_it():
    built = build()
    batch = pair_blocks(2, seq=SEQ, vocab=VOCAB, seed=2)
    objective = DpoConfig(loss="sigmoid", beta=0.5)
    opt = torch.optim.AdamW([p for p in built.model.parameters() if p.requires_grad], lr=1e-2)
    before = preference_evaluate(built, [batch], objective)
    assert before["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    for _ in range(8):
        preference_step(built, opt, [batch], accumulation=1, objective=objective,
                        grad_clip=1.0)
    after = preference_evaluate(built, [batch], objective)
    assert after["val_loss"] < before["val_loss"] - 0.2
    assert after["val_accuracy"] == 1.0 and after["val_margin"] > 0
    assert set(after) == {"val_loss", *(f"val_{k}" for k in FIGURES)}


def test_pairs_are_scored_with_the_per_document_kernel_a_gpu_runs():
    """A pair's halves share a block and must not see each other, so the preference forward
    needs the kernel chosen for per-document attention: on CUDA, FlexAttention or flash-attn's
    varlen kernel, never SDPA pinned to its flash kernel, which takes no mask (preference
    steps once failed on the GPU there with "No available kernel"). A DPO config chooses that
    kernel, and a model built for unmasked blocks is refused before any forward."""
    from raylm.config import load_config
    from raylm.model.attention import choose_attention

    cfg = load_config(None, ["--data.format=preference", "--train.objective=dpo",
                             "--dpo.loss=simpo"])
    for precision in ("bf16-mixed", "fp32"):
        cuda = choose_attention("cuda", cross_document=cfg.data.across_documents,
                                precision=precision)
        assert cuda.backend in ("flex-attention", "flash-attn-varlen"), cuda
        assert SDPBackend.FLASH_ATTENTION not in cuda.sdpa_backends
    unmasked = build_training_model(preset="tiny", path=None, vocab_size=VOCAB, eos_id=0,
                                    device=torch.device("cpu"), precision="fp32", seed=0)
    opt = torch.optim.SGD(unmasked.model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="per-document attention"):
        preference_step(unmasked, opt, [pair_blocks(2, seq=SEQ - 1, vocab=VOCAB)],
                        accumulation=1, objective=DpoConfig(loss="simpo"), grad_clip=1.0)
    assert not build(None).cross_document


@pytest.mark.parametrize("loss", ["sigmoid", "simpo"])
def test_the_head_projects_the_answers_alone_and_scores_as_the_plain_head(loss):
    """With the chunked head loss's head, a preference step projects only the answers'
    positions onto the vocabulary (not the prompts' and padding's) and takes the plain
    head's step."""
    pairs = pair_blocks(2, seq=SEQ - 1, vocab=VOCAB)
    answers = int((pairs["loss_mask"][:, 1:] > 0).sum())
    steps = []
    for fused in (True, False):
        built = build_training_model(preset="tiny", path=None, vocab_size=VOCAB, eos_id=0,
                                     device=torch.device("cpu"), precision="fp32", seed=0,
                                     lora=LORA, cross_document=False, fused_loss=fused)
        heads = head_matmuls(built.model.lm_head.out_features)
        opt = torch.optim.SGD([p for p in built.model.parameters() if p.requires_grad], lr=0.5)
        with heads:
            first = preference_step(built, opt, [pairs], accumulation=1,
                                    objective=DpoConfig(loss=loss, beta=0.5), grad_clip=0.0)
        second = preference_step(built, opt, [pairs], accumulation=1,
                                 objective=DpoConfig(loss=loss, beta=0.5), grad_clip=0.0)
        steps.append([float(first[0]), float(first[1]), float(second[0])])
        # Policy, and for sigmoid its reference (the adapters off), once each.
        passes = 2 if loss == "sigmoid" else 1
        flat = pairs["input_ids"].numel() - len(pairs["input_ids"])
        assert [r for r, _ in heads.seen] == [answers if fused else flat] * passes
    assert steps[0] == pytest.approx(steps[1], rel=1e-5)
