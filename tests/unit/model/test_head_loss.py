"""The chunked head loss computes what the plain head and cross-entropy compute (fp32, 1e-5):
the loss and every gradient, for untied, tied, soft-capped and scaled heads, with LoRA's
frozen head, masked and unmasked, and without ever holding a batch's logits."""

from __future__ import annotations

import pytest
import torch

from raylm.model import head_loss
from raylm.model.assemble import batch_loss, build_training_model

VOCAB, SEQ, ROWS = 320, 25, 4


def save(out, family: str):
    import transformers as T

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config = {
        "llama": lambda: T.LlamaConfig(**shape, tie_word_embeddings=False),
        "qwen3": lambda: T.Qwen3Config(**shape, head_dim=16, tie_word_embeddings=True),
        # Soft-capped logits, and no SDPA path: eager attention.
        "gemma2": lambda: T.Gemma2Config(**shape, head_dim=16, final_logit_softcapping=3.0),
        "granite": lambda: T.GraniteConfig(**shape, logits_scaling=4.0),
        "gpt2": lambda: T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
                                     embd_pdrop=0.0),
    }[family]()
    torch.manual_seed(3)
    T.AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    return str(out)


def batch(masked: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    out = {"input_ids": torch.randint(1, VOCAB, (ROWS, SEQ), generator=gen)}
    if masked:
        out["loss_mask"] = (torch.rand(ROWS, SEQ, generator=gen) < 0.4).to(torch.int8)
    return out


def loss_and_grads(path: str, *, fused: bool, masked: bool, lora=None):
    built = build_training_model(preset=None, path=path, vocab_size=VOCAB, eos_id=0,
                                 device=torch.device("cpu"), precision="fp32", seed=0,
                                 lora=lora, fused_loss=fused)
    assert built.fused_loss == fused
    loss = batch_loss(built, batch(masked), cross_document=True)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in built.model.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "granite", "gpt2"])
def test_the_chunked_loss_and_its_gradients_equal_the_plain_heads(tmp_path, monkeypatch,
                                                                  family):
    # 3 rows of logits per chunk: 96 targets make 32 chunks.
    monkeypatch.setattr(head_loss, "CHUNK_BYTES", 3 * 4 * VOCAB)
    path = save(tmp_path / family, family)
    lora = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": "auto"}
    for masked, adapters in ((False, None), (True, None), (True, lora)):
        want, want_grads = loss_and_grads(path, fused=False, masked=masked, lora=adapters)
        got, grads = loss_and_grads(path, fused=True, masked=masked, lora=adapters)
        assert float(got) == pytest.approx(float(want), rel=1e-6), (family, masked)
        assert grads.keys() == want_grads.keys()
        for name, g in want_grads.items():
            torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-5, msg=name)
        if adapters:  # the head and the base are frozen: only adapters have gradients
            assert all(".lora_" in n for n in grads)


def test_no_step_holds_a_batchs_logits(tmp_path, monkeypatch):
    """What the step keeps for backward, and the logits the model returns: nothing of the
    batch's (tokens x vocabulary) size; evaluation without gradients gives the same loss."""
    monkeypatch.setattr(head_loss, "CHUNK_BYTES", 8 * 4 * VOCAB)
    path = save(tmp_path / "qwen3", "qwen3")
    built = build_training_model(preset=None, path=path, vocab_size=VOCAB, eos_id=0,
                                 device=torch.device("cpu"), precision="fp32", seed=0)
    logits = []

    def keep(t):
        if t.dim() and t.size(-1) == VOCAB:
            logits.append(t.numel() // VOCAB)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = batch_loss(built, batch(False), cross_document=True)
    # Only a chunk's logits, inside the chunk's own loss (the head's gradient, kept for
    # backward, is vocabulary x hidden).
    assert logits and max(logits) == 8, logits
    with head_loss.head_loss(torch.zeros(ROWS, SEQ - 1, dtype=torch.long), built.config):
        returned = built.model(input_ids=batch(False)["input_ids"][:, :-1]).logits
    assert returned.shape == (ROWS, SEQ - 1, 0)
    with torch.no_grad():
        again = batch_loss(built, batch(False), cross_document=True)
    assert float(again) == pytest.approx(float(loss), rel=1e-6)
    # Outside a loss, the head is the model's plain linear layer.
    assert built.model(input_ids=batch(False)["input_ids"]).logits.shape[-1] == VOCAB


def test_only_a_bias_free_linear_head_computes_the_loss_in_chunks():
    from torch import nn

    model = nn.Module()
    model.lm_head = nn.Linear(8, VOCAB)
    assert not head_loss.fusable(model)
    model.lm_head = nn.Linear(8, VOCAB, bias=False)
    assert head_loss.fusable(model)
