"""Throughput, MFU, data stalls and memory.

FLOPs per trained token follow the PaLM appendix convention: ``6 * N`` for the matmuls of
forward and backward over the non-embedding parameters (the output head included, the embedding
lookup not), plus ``12 * layers * hidden * seq_len`` for attention scores and values (no
discount for causality). For the 1b preset at seq_len 2048 that is 6 x 1.04e9 + 12 x 16 x 2048 x
2048 = 7.0e9 FLOPs per token; MFU = tokens/s x that / (devices x peak).

Peaks are dense bf16 tensor-core figures from the vendors' data sheets, by device name; an
unknown device (and every CPU) has no peak, and MFU is then reported as None, not guessed.
"""

from __future__ import annotations

import resource
import sys

import torch

from raylm.model.build import Shape

# Dense (no sparsity) bf16 tensor-core peak FLOP/s, from the vendors' data sheets, keyed by
# the exact name CUDA reports. Exact, because names nest: "NVIDIA L40" is not an L4 (181 vs
# 121 TFLOP/s) and "NVIDIA H200 NVL" is not the SXM H200 (835 vs 989); a substring match once
# gave an L40 the L4's peak and overstated its MFU 1.5x. A part missing here has no MFU.
BF16_PEAK_FLOPS = {
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA H100 80GB HBM3": 989e12,  # SXM5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,  # SXM
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA B200": 2250e12,
    "NVIDIA L4": 121e12,
    "NVIDIA L40": 181e12,
    "NVIDIA L40S": 362e12,
}


def bf16_peak(device_name: str) -> float | None:
    """The dense bf16 peak of the device CUDA calls ``device_name``; None when not listed."""
    return BF16_PEAK_FLOPS.get(device_name.strip())


def flops_per_token(config, seq_len: int) -> float:
    s = Shape.of(config)
    attn = s.hidden * s.head_dim * (2 * s.heads + 2 * s.kv_heads)  # q, o and k, v projections
    mlp = 3 * s.hidden * s.intermediate
    non_embedding = s.layers * (attn + mlp) + s.hidden * s.vocab  # + output head
    return 6.0 * non_embedding + 12.0 * s.layers * s.hidden * seq_len


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of one ``device`` at ``precision``; None when unknown (CPUs, fp32)."""
    if device.type != "cuda" or not precision.startswith("bf16"):
        return None
    return bf16_peak(torch.cuda.get_device_name(device))


def mfu(tokens_per_s: float, flops_token: float, peak: float | None, devices: int
        ) -> float | None:
    if peak is None or devices <= 0:
        return None
    return tokens_per_s * flops_token / (peak * devices)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this worker: CUDA allocator peak, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t``: its local shard of a DTensor, the packed data of a
    quantized tensor subclass (NF4)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def state_memory_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                       ) -> tuple[int, int]:
    """(parameter bytes, optimizer-state bytes) this rank holds: what sharding, tensor and
    pipeline parallelism divide. Optimizer state exists once a step has been taken."""
    params = sum(tensor_bytes(p) for p in model.parameters())
    state = sum(tensor_bytes(v) for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    return params, state
