from __future__ import annotations

import pytest
import torch

from raylm.model.build import build_config
from raylm.workers.metrics import bf16_peak, flops_per_token, mfu, peak_flops, peak_memory_bytes


def test_flops_per_token_by_hand():
    cfg = build_config(preset="1b", path=None, vocab_size=32000, eos_id=0,
                       attn_implementation="sdpa")
    # Per layer: q,o 2*2048*2048, k,v 2*2048*512, mlp 3*2048*8192; head 2048*32000.
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192
    n = 16 * per_layer + 2048 * 32000
    assert flops_per_token(cfg, 2048) == 6 * n + 12 * 16 * 2048 * 2048
    assert flops_per_token(cfg, 2048) == pytest.approx(7.04e9, rel=0.01)


def test_mfu_arithmetic():
    # 40k tok/s x 6.6 GFLOP/token on 1 device of 989 TFLOP/s = 26.7%.
    assert mfu(40_000, 6.6e9, 989e12, 1) == pytest.approx(0.2669, abs=1e-4)
    assert mfu(80_000, 6.6e9, 989e12, 2) == pytest.approx(0.2669, abs=1e-4)
    assert mfu(1.0, 1.0, None, 1) is None


def test_cpu_has_no_peak_and_memory_is_measured():
    assert peak_flops(torch.device("cpu"), "fp32") is None
    assert peak_memory_bytes(torch.device("cpu")) > 10 * 2**20


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA A100-SXM4-40GB", 312), ("NVIDIA A100-SXM4-80GB", 312),
    ("NVIDIA A100-PCIE-40GB", 312), ("NVIDIA A100 80GB PCIe", 312),
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
    ("NVIDIA H200", 989), ("NVIDIA H200 NVL", 835), ("NVIDIA B200", 2250),
    ("NVIDIA L4", 121), ("NVIDIA L40", 181), ("NVIDIA L40S", 362),
    # Names that contain a listed one are other parts: no peak rather than a wrong one.
    ("NVIDIA GeForce RTX 4090", None), ("NVIDIA L40G", None), ("NVIDIA H100", None),
])
def test_peak_is_looked_up_by_exact_device_name(name, tflops):
    peak = bf16_peak(name)
    assert (peak if peak is None else peak / 1e12) == tflops


def test_flops_per_token_of_a_gpt2_as_released():
    """GPT-2's config names no key/value heads and leaves its MLP width unset (4 x hidden):
    the count is a full multi-head model's, even where a hand-edited config carries a key/value
    head count transformers ignores."""
    from transformers import GPT2Config

    per_layer = 4 * 64 * 64 + 3 * 64 * 256  # q, k, v, o; the MLP 4 x 64 wide
    want = 6 * (2 * per_layer + 64 * 500) + 12 * 2 * 64 * 128
    for config in (GPT2Config(vocab_size=500, n_embd=64, n_layer=2, n_head=4),
                   GPT2Config(vocab_size=500, n_embd=64, n_layer=2, n_head=4,
                              num_key_value_heads=2)):
        assert flops_per_token(config, 128) == want
