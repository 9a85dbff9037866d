"""Pruning (raylm.model.sparsity): which weights go, for each method and family, and that the
zeros stay zero through a LoRA merge."""

from __future__ import annotations

import copy

import pytest
import torch

from raylm.model import lora, sparsity
from tests.distributed.test_pretrained import family_config


def layer_sparsity(model) -> list[dict]:
    """The share of exact zeros in each prunable layer's weight."""
    return [{"layer": n, "shape": list(sparsity.rows_by_inputs(m).shape),
             "sparsity": round((m.weight == 0).float().mean().item(), 6)}
            for n, m in sparsity.prunable(model)]


def test_a_sparsity_is_a_fraction_or_two_of_four():
    assert sparsity.parse_target("0.5") == sparsity.Target(0.5)
    assert sparsity.parse_target("2:4") == sparsity.Target(0.5, 4)
    assert sparsity.parse_target("2:4").label == "2:4"
    assert sparsity.parse_target("0.25").label == "25%"
    for bad, says in [("1.5", "between 0 and 1"), ("half", "between 0 and 1"),
                      ("0", "between 0 and 1"), ("1:4", "2:4")]:
        with pytest.raises(ValueError, match=says):
            sparsity.parse_target(bad)


def test_each_row_loses_its_lowest_scores_and_two_of_every_four():
    gen = torch.Generator().manual_seed(0)
    score = torch.rand(6, 16, generator=gen)
    keep = sparsity.prune_mask(score, sparsity.Target(0.25))
    assert (keep.sum(dim=1) == 12).all()
    for row, kept in zip(score, keep, strict=True):
        assert row[~kept].max() < row[kept].min()
    keep = sparsity.prune_mask(score, sparsity.Target(0.5, 4))
    groups, kept = score.reshape(6, 4, 4), keep.reshape(6, 4, 4)
    assert (kept.sum(dim=-1) == 2).all()
    # The two kept of each four are its two highest.
    top2 = groups.topk(2, dim=-1).indices.sort(dim=-1).values
    assert (kept.nonzero()[:, -1].reshape(6, 4, 2) == top2).all()


def tiny(family: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config(family)).eval()


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gpt2", "qwen3_moe"])
def test_every_decoder_projection_is_pruned_and_nothing_else(family, tmp_path):
    """Magnitude to 50% per output row of each linear projection of the decoder layers
    (Phi-3's fused ones, GPT-2's Conv1D whose weight is stored transposed); the embeddings,
    the head, the norms, a mixture-of-experts router and its fused experts keep every weight;
    the zeros survive save_pretrained and from_pretrained."""
    from transformers import AutoModelForCausalLM

    model = tiny(family)
    before = {n: p.clone() for n, p in model.named_parameters()}
    report = sparsity.prune(model, sparsity.Target(0.5), method="magnitude")
    pruned = {r["layer"] + ".weight" for r in report}
    assert pruned and all(r["sparsity"] == 0.5 for r in report)
    for name, p in model.named_parameters():
        if name in pruned:
            continue
        assert torch.equal(p, before[name]), name
    if family == "qwen3_moe":
        assert not any("gate" in n and "gate_proj" not in n or "experts" in n for n in pruned)
    conv = sparsity.prunable(model)[0][1]
    rows = sparsity.rows_by_inputs(conv)
    # Per output row: every row of the (outputs, inputs) view lost exactly half.
    assert ((rows == 0).sum(dim=1) == rows.shape[1] // 2).all()
    model.save_pretrained(str(tmp_path))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert layer_sparsity(again) == [
        {"layer": r["layer"], "shape": r["shape"], "sparsity": 0.5} for r in report]


def test_wanda_scores_each_block_by_the_inputs_the_pruned_blocks_before_give_it():
    """Wanda's choice, checked against a plain computation: for each block in turn, the L2
    norm of every layer's input features over the calibration tokens, from full forwards of
    the model whose earlier blocks are already pruned, times |W|, lowest half per row."""
    model = tiny("llama")
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 384, (2, 24), generator=gen) for _ in range(3)]
    want = copy.deepcopy(model)
    calibrate = sparsity.calibration_runner(model, batches, lambda m, ids: m(input_ids=ids))
    report = sparsity.prune(model, sparsity.Target(0.5), method="wanda", calibrate=calibrate)
    assert len(report) == 14 and {r["sparsity"] for r in report} == {0.5}

    layers = dict(sparsity.prunable(want))
    for block in want.model.layers:
        mine = [(n, m) for n, m in layers.items() if any(m is x for x in block.modules())]
        sq: dict[str, torch.Tensor] = {}
        hooks = [m.register_forward_pre_hook(summing(sq, n)) for n, m in mine]
        with torch.no_grad():
            for ids in batches:
                want(input_ids=ids)
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for n, m in mine:
                score = m.weight.abs() * sq[n].sqrt()
                m.weight.mul_(sparsity.prune_mask(score, sparsity.Target(0.5)))
    for (name, got), (_, ref) in zip(sparsity.prunable(model), sparsity.prunable(want),
                                     strict=True):
        assert torch.equal(got.weight == 0, ref.weight == 0), name
    # It chose otherwise than magnitude would have: the activations matter.
    plain = tiny("llama")
    sparsity.prune(plain, sparsity.Target(0.5), method="magnitude")
    assert not torch.equal(plain.model.layers[1].mlp.down_proj.weight == 0,
                           model.model.layers[1].mlp.down_proj.weight == 0)


def summing(sums: dict, name: str):
    """A pre-hook adding the squares of each input feature over every token to sums[name]."""

    def hook(module, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        sums[name] = sums.get(name, 0) + x.pow(2).sum(0)

    return hook


def test_wanda_without_calibration_and_an_unknown_method_are_refused():
    with pytest.raises(ValueError, match="wanda needs calibration data"):
        sparsity.prune(tiny("llama"), sparsity.Target(0.5), method="wanda")
    with pytest.raises(ValueError, match="not one of magnitude, wanda"):
        sparsity.prune(tiny("llama"), sparsity.Target(0.5), method="sparsegpt")


def test_a_lora_merge_onto_a_pruned_base_keeps_its_zeros():
    """The adapters' product is dense; merged onto a pruned base with ``keep_zeros`` the
    base's zeros stay zero and every other weight is base + delta."""
    model = tiny("qwen3")
    sparsity.prune(model, sparsity.Target(0.5, 4), method="magnitude")
    zeros = [m.weight == 0 for _, m in sparsity.prunable(model)]
    adapted = lora.add_adapters(model, rank=4, alpha=8.0, dropout=0.0, target_modules="auto")
    for name, module in adapted.named_modules():
        if name.endswith((".lora_A.default", ".lora_B.default")):  # made on meta
            module.weight = torch.nn.Parameter(torch.randn(module.weight.shape) * 0.1)
    plain = lora.merge_adapters(copy.deepcopy(adapted))
    kept = lora.merge_adapters(adapted, keep_zeros=True)
    for z, (_, a), (_, b) in zip(zeros, sparsity.prunable(plain), sparsity.prunable(kept),
                                 strict=True):
        assert (a.weight[z] != 0).all()  # what a plain merge fills in
        assert (b.weight[z] == 0).all() and torch.equal(a.weight[~z], b.weight[~z])


def test_zero_masks_keep_a_trained_weight_at_zero():
    model = tiny("llama")
    sparsity.prune(model, sparsity.Target(0.25), method="magnitude")
    masks = sparsity.zero_masks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.arange(16)[None], labels=torch.arange(16)[None]).loss.backward()
    opt.step()
    layer = sparsity.prunable(model)[0][1]
    assert (layer.weight == 0).float().mean() < 0.25  # the step moved them
    sparsity.reapply(masks)
    assert {r["sparsity"] for r in layer_sparsity(model)} == {0.25}
