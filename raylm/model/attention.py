"""The one place that chooses the attention kernel, and makes the choice true.

transformers picks an implementation by name (``sdpa``, ``flash_attention_2``); which SDPA
kernel then runs is PyTorch's decision, made per call. raylm fixes it: training steps run inside
``torch.nn.attention.sdpa_kernel([...])`` with only the backend that is reported, so the log and
MLflow never claim flash attention while the math kernel runs (a call no allowed kernel can serve
fails loudly instead).

Packed blocks hold several documents. With ``data.cross_document_attention: false`` the loop
passes position ids that restart at every document start; transformers turns them into a
block-diagonal causal mask: a dense one for SDPA (batch x seq x seq, and SDPA's CUDA flash
kernel takes no mask, so the slower memory-efficient one runs), a ``BlockMask`` for
FlexAttention (which skips the blocks that cross documents and builds nothing dense), or varlen
sequence boundaries for flash-attn. The kernels:

    device  cross-document  requested                       ->  backend
    cpu     any             auto, sdpa                      ->  SDPA flash (CPU kernel; masks)
    cuda    allowed         auto, sdpa                      ->  SDPA flash (bf16), SDPA
                                                                memory-efficient (fp32)
    cuda    allowed         flash_attention_2               ->  flash-attn
    cuda    blocked         auto, flash-attn installed      ->  flash-attn varlen
    cuda    blocked         auto without flash-attn         ->  FlexAttention (block-sparse)
    cuda    any             flex_attention                  ->  FlexAttention
    cuda    blocked         sdpa                            ->  SDPA memory-efficient, dense mask

A model whose class does not implement the chosen kernel (Gemma 2 has no SDPA path in
transformers 5: its attention soft-caps the logits) gets, under ``auto``, FlexAttention on CUDA
where it has it and eager attention elsewhere (:func:`fit_to_model`); a kernel asked for by name
that the model lacks is refused.
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
    fallback: str = ""
    """Why this model runs a slower kernel than the device offers (empty: it does not)."""

    def context(self):
        """Wrap forward and backward in this to pin the SDPA kernel."""
        if not self.sdpa_backends:
            return contextlib.nullcontext()
        return sdpa_kernel(list(self.sdpa_backends))


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def choose_attention(device_type: str, *, requested: str = "auto",
                     cross_document: bool = True, precision: str = "bf16-mixed"
                     ) -> AttentionChoice:
    """Pick the kernel for ``device_type`` ('cuda' or 'cpu') and the resolved ``precision``
    (the CUDA flash kernels take 16-bit inputs only: fp32 training uses the memory-efficient
    SDPA kernel, or FlexAttention for per-document masks)."""
    if requested not in ATTENTIONS:
        raise ValueError(f"model.attention: {requested!r} is not one of "
                         f"{', '.join(ATTENTIONS)}.")
    half = precision != "fp32"
    if requested == "flash_attention_2":
        if device_type != "cuda":
            raise ValueError("model.attention=flash_attention_2 needs CUDA GPUs; use auto or "
                             "sdpa on CPU.")
        if not flash_attn_available():
            raise ValueError("model.attention=flash_attention_2 but the flash-attn package is "
                             "not installed; pip install flash-attn, or use auto.")
        if not half:
            raise ValueError("model.attention=flash_attention_2 needs bf16 (train.precision="
                             "bf16-mixed or bf16-true); use auto with fp32.")
    if requested == "flex_attention" and device_type != "cuda":
        raise ValueError("model.attention=flex_attention needs CUDA GPUs (it is compiled "
                         "with Triton); use auto or sdpa on CPU.")
    if device_type != "cuda":
        return AttentionChoice("sdpa", "sdpa-flash-cpu", (SDPBackend.FLASH_ATTENTION,))
    use_fa = requested == "flash_attention_2" or (
        requested == "auto" and not cross_document and half and flash_attn_available())
    if use_fa:
        return AttentionChoice("flash_attention_2",
                               "flash-attn" if cross_document else "flash-attn-varlen")
    if requested == "flex_attention" or (requested == "auto" and not cross_document):
        return AttentionChoice("flex_attention", "flex-attention")
    if not cross_document:
        return AttentionChoice("sdpa", "sdpa-efficient-masked",
                               (SDPBackend.EFFICIENT_ATTENTION,))
    if half:
        return AttentionChoice("sdpa", "sdpa-flash-cuda", (SDPBackend.FLASH_ATTENTION,))
    return AttentionChoice("sdpa", "sdpa-efficient-cuda", (SDPBackend.EFFICIENT_ATTENTION,))


# transformers' class attributes that say which attention implementations a model has.
SUPPORTS = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn",
            "flash_attention_2": "_supports_flash_attn"}


def fit_to_model(choice: AttentionChoice, config, *, requested: str, device_type: str
                 ) -> AttentionChoice:
    """``choice``, if the model ``config`` describes implements it; else, under ``auto``,
    FlexAttention (CUDA) or eager attention that it does implement."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return choice  # a model class transformers does not list: it says so when built
    if getattr(cls, SUPPORTS.get(choice.implementation, ""), True):
        dropout = getattr(config, "attention_dropout", 0) or getattr(config, "attn_pdrop", 0)
        if choice.backend == "sdpa-flash-cpu" and dropout:
            # PyTorch's CPU flash kernel takes no dropout (GPT-2 drops 10% of attention).
            return AttentionChoice("sdpa", "sdpa-math-cpu", (SDPBackend.MATH,),
                                   fallback=f"{cls.__name__} drops out attention, which "
                                            f"PyTorch's CPU flash kernel does not")
        return choice
    if requested != "auto":
        raise ValueError(f"model.attention={requested}: {cls.__name__} does not implement "
                         f"{choice.implementation} attention; use auto.")
    why = f"{cls.__name__} does not implement {choice.implementation} attention"
    if device_type == "cuda" and getattr(cls, SUPPORTS["flex_attention"], False):
        return AttentionChoice("flex_attention", "flex-attention", fallback=why)
    return AttentionChoice("eager", "eager", fallback=why)
