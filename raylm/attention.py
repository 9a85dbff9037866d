"""The one place that chooses the attention kernel, and makes the choice true.

transformers picks an implementation by name (``sdpa``, ``flash_attention_2``); which SDPA
kernel then runs is PyTorch's decision, made per call. raylm fixes it: training steps run inside
``torch.nn.attention.sdpa_kernel([...])`` with only the backend that is reported, so the log and
MLflow never claim flash attention while the math kernel runs (a call no allowed kernel can serve
fails loudly instead).

Packed blocks hold several documents. With ``data.cross_document_attention: false`` the loop
passes position ids that restart at every document start; transformers turns them into a
block-diagonal causal mask (SDPA) or varlen sequence boundaries (flash-attn). The kernels:

    device  cross-document  flash-attn installed  ->  backend
    cpu     any             -                     ->  SDPA flash (CPU kernel; takes a mask)
    cuda    allowed         no / not asked        ->  SDPA flash
    cuda    allowed         yes, asked            ->  flash-attn
    cuda    blocked         yes                   ->  flash-attn varlen
    cuda    blocked         no                    ->  SDPA memory-efficient (the CUDA flash
                                                      kernel takes no mask)
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass

from torch.nn.attention import SDPBackend, sdpa_kernel

from raylm.config import ATTENTIONS


@dataclass(frozen=True)
class AttentionChoice:
    implementation: str
    """transformers ``attn_implementation``."""
    backend: str
    """The kernel that runs, as logged and recorded in MLflow."""
    sdpa_backends: tuple[SDPBackend, ...] = ()
    """SDPA backends allowed while training (empty: SDPA is not used)."""

    def context(self):
        """Wrap forward and backward in this to pin the SDPA kernel."""
        if not self.sdpa_backends:
            return contextlib.nullcontext()
        return sdpa_kernel(list(self.sdpa_backends))


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def choose_attention(device_type: str, *, requested: str = "auto",
                     cross_document: bool = True) -> AttentionChoice:
    """Pick the kernel for ``device_type`` ('cuda' or 'cpu')."""
    if requested not in ATTENTIONS:
        raise ValueError(f"model.attention: {requested!r} is not one of "
                         f"{', '.join(ATTENTIONS)}.")
    if requested == "flash_attention_2":
        if device_type != "cuda":
            raise ValueError("model.attention=flash_attention_2 needs CUDA GPUs; use auto or "
                             "sdpa on CPU.")
        if not flash_attn_available():
            raise ValueError("model.attention=flash_attention_2 but the flash-attn package is "
                             "not installed; pip install flash-attn, or use auto.")
    if device_type != "cuda":
        return AttentionChoice("sdpa", "sdpa-flash-cpu", (SDPBackend.FLASH_ATTENTION,))
    use_fa = requested == "flash_attention_2" or (
        requested == "auto" and not cross_document and flash_attn_available())
    if use_fa:
        return AttentionChoice("flash_attention_2",
                               "flash-attn" if cross_document else "flash-attn-varlen")
    if cross_document:
        return AttentionChoice("sdpa", "sdpa-flash-cuda", (SDPBackend.FLASH_ATTENTION,))
    return AttentionChoice("sdpa", "sdpa-efficient-masked", (SDPBackend.EFFICIENT_ATTENTION,))
