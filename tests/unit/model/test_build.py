from __future__ import annotations

import pytest
import torch

from raylm.model.attention import choose_attention
from raylm.model.build import (
    PRESETS,
    build_config,
    build_meta_model,
    init_weights,
    padded_vocab,
)


def tiny(vocab=300, cross_document=True, seed=0):
    choice = choose_attention("cpu", cross_document=cross_document)
    cfg = build_config(preset="tiny", path=None, vocab_size=vocab, eos_id=0,
                       attn_implementation=choice.implementation)
    model = build_meta_model(cfg)
    model.to_empty(device="cpu")
    init_weights(model, seed=seed, num_layers=cfg.num_hidden_layers)
    return model, choice


@pytest.mark.parametrize("preset, millions", [("tiny", 4.2), ("125m", 134), ("350m", 374),
                                              ("1b", 1039), ("3b", 2917)])
def test_preset_sizes_on_meta(preset, millions):
    cfg = build_config(preset=preset, path=None, vocab_size=32000, eos_id=0,
                       attn_implementation="sdpa")
    model = build_meta_model(cfg)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(millions, rel=0.01)
    assert cfg.vocab_size % 64 == 0 and padded_vocab(32000) == 32000


def test_unknown_preset_and_bad_path(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'huge'; choose one of tiny, 125m"):
        build_config(preset="huge", path=None, vocab_size=10, eos_id=0,
                     attn_implementation="sdpa")
    with pytest.raises(ValueError, match="holds no config.json"):
        build_config(preset=None, path=str(tmp_path), vocab_size=10, eos_id=0,
                     attn_implementation="sdpa")
    assert set(PRESETS) == {"tiny", "125m", "350m", "1b", "3b"}


def test_init_depends_on_seed_and_name_only():
    a, _ = tiny(seed=1)
    b, _ = tiny(seed=1)
    c, _ = tiny(seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(),
                                  strict=True):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    assert torch.isfinite(a.model.rotary_emb.inv_freq).all()
    assert a.model.rotary_emb.inv_freq[0] == 1.0


def test_documents_do_not_attend_across_boundaries():
    model, choice = tiny(cross_document=False)
    assert choice.backend == "sdpa-flash-cpu"
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(1, 300, (1, 10), generator=gen)
    second = torch.randint(1, 300, (1, 6), generator=gen)
    packed = torch.cat([first, second], 1)
    position_ids = torch.cat([torch.arange(10), torch.arange(6)])[None]
    with torch.no_grad(), choice.context():
        masked = model(input_ids=packed, position_ids=position_ids).logits
        alone = model(input_ids=second).logits
        open_ = model(input_ids=packed).logits
    # The second document sees nothing of the first: same logits as on its own.
    torch.testing.assert_close(masked[:, 10:], alone, atol=1e-5, rtol=1e-5)
    assert (open_[:, 10:] - alone).abs().max() > 1e-2  # and without the mask it would
    torch.testing.assert_close(masked[:, :10], open_[:, :10], atol=1e-5, rtol=1e-5)


def test_attention_choice_table():
    assert choose_attention("cuda").backend == "sdpa-flash-cuda"
    blocked = choose_attention("cuda", cross_document=False)
    assert blocked.backend in ("flash-attn-varlen", "flex-attention")
    assert choose_attention("cuda", requested="sdpa",
                            cross_document=False).backend == "sdpa-efficient-masked"
    assert choose_attention("cuda", requested="flex_attention").implementation == (
        "flex_attention")
    for kernel in ("flash_attention_2", "flex_attention"):
        with pytest.raises(ValueError, match="needs CUDA"):
            choose_attention("cpu", requested=kernel)


def test_a_model_that_brings_its_own_code_is_refused_and_its_code_never_runs(tmp_path):
    """A config.json with an ``auto_map`` into the directory's own modules: transformers would
    import them given trust_remote_code (or ask, on a terminal); raylm never passes it."""
    import json

    from raylm.model.build import build_config

    proof = tmp_path / "ran"
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "acme_custom", "architectures": ["AcmeModel"],
        "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig"}}))
    (tmp_path / "configuration_acme.py").write_text(
        f"open({str(proof)!r}, 'w').write('x')\n"
        "from transformers import PretrainedConfig\n"
        "class AcmeConfig(PretrainedConfig):\n    model_type = 'acme_custom'\n")
    with pytest.raises(ValueError, match="own Python code .* which raylm never does"):
        build_config(preset=None, path=str(tmp_path), vocab_size=10, eos_id=0,
                     attn_implementation="sdpa")
    assert not proof.exists()


def test_each_familys_shape_is_read_under_its_own_names():
    """Shape.of reads a model's dimensions from any family's transformers config: GPT-2's own
    names, its unset MLP width, its one key/value head per head; grouped-query heads and an
    explicit head size elsewhere."""
    import transformers as T

    from raylm.model.build import Shape

    gpt2 = T.GPT2Config(vocab_size=500, n_embd=64, n_layer=3, n_head=4, num_key_value_heads=2)
    assert Shape.of(gpt2) == Shape(layers=3, hidden=64, heads=4, kv_heads=4, head_dim=16,
                                   intermediate=256, vocab=500)
    assert Shape.of(T.GPT2Config(n_embd=64, n_head=4, n_inner=100)).intermediate == 100
    qwen3 = T.Qwen3Config(vocab_size=500, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32)
    assert Shape.of(qwen3) == Shape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32,
                                    intermediate=96, vocab=500)
