"""GGUF files that llama.cpp runs (``raylm export RUN_DIR --format gguf``).

Written by the ``gguf`` package, llama.cpp's own Python writer (its tensor names per
architecture, its reader of merges, special tokens and chat templates). Decided here is what
llama.cpp's converter script (``convert_hf_to_gguf.py``, in no package) decides, so that
llama.cpp computes what transformers computes:

- Llama and Mistral are the ``llama`` architecture, and Granite (four more scalars) its kin,
  which rotate interleaved pairs of a head's dimensions where transformers rotates its two
  halves: query and key rows are reordered. Rotary scaling that only rescales each frequency
  ('linear', Llama 3.1's 'llama3') goes in as llama.cpp's per-frequency factors
  (``rope_freqs``: transformers' unscaled over its scaled frequencies). Qwen2 (q/k/v biases),
  Qwen3 (per-head q/k norms), OLMo 2 (norms after each block) and Phi-3 (fused projections,
  rotary on part of each head) rotate halves as transformers. llama.cpp's Phi-3 keeps no
  window: the file's context length is the window's.
- Gemma 2 and 3: their norms multiply by 1 + weight, llama.cpp's by the weight (1 is added);
  Gemma 3's sliding layers and the window's own rotary base are written per layer, Gemma 2's
  two soft caps; llama.cpp scales queries by 1/sqrt(head_dim) (the 27Bs aside), so another
  ``query_pre_attn_scalar`` is refused.
- 1-D tensors stay fp32; matrices are fp32, fp16 or Q8_0 (blocks of 32 values with an fp16
  scale; rows not of whole blocks stay fp16); a tied head is not written. 4- to 6-bit files
  are llama.cpp's own quantizer's (libllama's ``llama_model_quantize``) from an fp32 file
  written here: its k-quant mixes pick a type per tensor by rules of its own.
- The tokenizer: byte-level BPE (raylm's, GPT-2's, Llama 3's, Qwen's) whose pre-tokenizer
  regex llama.cpp knows by name, or SentencePiece's BPE with byte fallback (Llama 2's,
  Mistral's, Gemma's, Phi-3's), its merges' order as scores. (A text that starts with a
  space gets one "▁" in transformers' Metaspace, two in llama.cpp as in SentencePiece.)

What llama.cpp would compute differently (other rotary scalings, Qwen2's sliding window,
other families) is refused before anything is written, naming the family or the setting.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raylm.model.build import Shape

FAMILIES = {"LlamaForCausalLM": "LLAMA", "MistralForCausalLM": "LLAMA",
            "Qwen2ForCausalLM": "QWEN2", "Qwen3ForCausalLM": "QWEN3",
            "Gemma3ForCausalLM": "GEMMA3", "Olmo2ForCausalLM": "OLMO2",
            "GraniteForCausalLM": "GRANITE", "Gemma2ForCausalLM": "GEMMA2",
            "Phi3ForCausalLM": "PHI3", "Qwen3MoeForCausalLM": "QWEN3MOE",
            "GPT2LMHeadModel": "GPT2"}
"""transformers' class -> gguf's MODEL_ARCH member."""
PERMUTED = {"LLAMA", "GRANITE"}
FREQ_SCALINGS = ("linear", "llama3")  # rotary scalings written as rope_freqs, LLAMA only
QUANTIZATIONS = ("f16", "q8_0", "f32")
BY_LLAMA_CPP = {"q4_0": 2, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}  # their llama_ftype
RECORD = "raylm.export"  # the export's record (run, step, kind) in the file's metadata

# The pre-tokenizer regexes of byte-level BPE tokenizers, by the name llama.cpp gives them.
SPLIT_REGEXES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}


def check_model(config: dict[str, Any]) -> str:
    """The gguf architecture of a model's ``config.json``, or a refusal naming what llama.cpp
    would compute differently."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    family = (config.get("architectures")
              or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"), "?")])[0]
    if family not in FAMILIES:
        raise ValueError(f"--format gguf: raylm writes GGUF for "
                         f"{', '.join(sorted(FAMILIES))}; this model is {family}. Export it "
                         f"as a Hugging Face directory (without --format).")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    # Gemma 3 has one per kind of layer.
    for part in rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) \
            else [rope]:
        kind = part.get("rope_type", part.get("type", "default"))
        if kind != "default" and (kind not in FREQ_SCALINGS or FAMILIES[family] != "LLAMA"):
            raise ValueError(f"--format gguf: {family} with rotary scaling {kind!r} is not "
                             f"written yet; the default rotary embedding is, and "
                             f"{' and '.join(FREQ_SCALINGS)} for Llama and Mistral.")
    if config.get("use_sliding_window") and config.get("sliding_window"):
        raise ValueError(f"--format gguf: {family} with a sliding window is not written yet.")
    if family == "Qwen3MoeForCausalLM" and (not config.get("norm_topk_prob") or config.get(
            "mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1):
        raise ValueError("--format gguf: llama.cpp runs a Qwen3-MoE as released: experts in "
                         "every layer, their top-k weights normalized (norm_topk_prob: true).")
    if family in (big := {"Gemma2ForCausalLM": 46, "Gemma3ForCausalLM": 62}):  # the 27Bs
        heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
        scale = config["hidden_size"] // heads if layers == big[family] else config["head_dim"]
        if config.get("query_pre_attn_scalar") != scale:
            raise ValueError(f"--format gguf: this {family} scales its queries by "
                             f"query_pre_attn_scalar={config.get('query_pre_attn_scalar')}, "
                             f"llama.cpp by {scale} (its head size).")
        if (family == "Gemma2ForCausalLM") != bool(cap := config.get("attn_logit_softcapping")):
            raise ValueError(f"--format gguf: {family} with attn_logit_softcapping={cap}: "
                             f"llama.cpp soft-caps Gemma 2's attention logits, not Gemma 3's.")
    return FAMILIES[family]


def pre_tokenizer(tokenizer_json: dict[str, Any], arch: str) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenization (``spm``, or ``spm-no-prefix``
    without a leading "▁", for a SentencePiece-style vocabulary), or a refusal."""
    from tokenizers import Tokenizer

    model = tokenizer_json.get("model", {})
    if arch == "PHI3" or model.get("byte_fallback"):
        tok = Tokenizer.from_str(json.dumps(tokenizer_json))
    if arch == "PHI3" and (lacks := [t for t in ("<unk>", "<s>", "</s>", "<|endoftext|>")
                                     if tok.token_to_id(t) is None]):
        raise ValueError(f"--format gguf: llama.cpp expects Phi-3's special tokens in a Phi-3 "
                         f"file; this vocabulary lacks {', '.join(lacks)}.")
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        # llama.cpp's SentencePiece way: each space a "▁", no split, no other change, a "▁"
        # put first or not (Llama's Metaspace; Gemma's normalizer, whose split on spaces then
        # splits nothing). Checked by running the tokenizer's own steps on a text.
        text = "A ﬁ  b\nc"
        text = tok.normalizer.normalize_str(text) if tok.normalizer else text
        pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)] \
            if tok.pre_tokenizer else [text]
        if pieces in (["▁A▁ﬁ▁▁b\nc"], ["A▁ﬁ▁▁b\nc"]):
            return "spm" if pieces[0][0] == "▁" else "spm-no-prefix"
    pre = tokenizer_json.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ValueError(f"--format gguf: the tokenizer is neither a byte-level BPE nor "
                         f"SentencePiece's as llama.cpp splits text (a {model.get('type')} "
                         f"model; {kinds}); raylm does not write it into GGUF.")
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        regex = parts[0].get("pattern", {}).get("Regex")
        if regex in SPLIT_REGEXES:
            return SPLIT_REGEXES[regex]
    raise ValueError(f"--format gguf: the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds))}"
                     f") is not one llama.cpp names (GPT-2's, Llama 3's or Qwen2's byte-level "
                     f"BPE); llama.cpp would split text into other tokens.")


def write_gguf(model_dir: Path, out: Path, *, quantize: str,
               record: dict | None = None) -> dict[str, Any]:
    """``model_dir`` (a Hugging Face directory: config, safetensors, tokenizer) as the GGUF
    file ``out``, ``record`` in its metadata as JSON under :data:`RECORD`; returns what it
    wrote (architecture, tensor types, bytes)."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if quantize in BY_LLAMA_CPP:  # else one of QUANTIZATIONS (the export checked it)
        return _quantized_by_llama_cpp(model_dir, out, quantize, record)
    config = json.loads((model_dir / "config.json").read_text())
    arch = gguf.MODEL_ARCH[check_model(config)]
    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    # The tokenizer as transformers loads it beside the model, not as its file says: for some
    # families (Qwen2) transformers 5 puts the family's own pre-tokenizer in.
    pre = pre_tokenizer(json.loads(tok.backend_tokenizer.to_str()), arch.name)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    c = model.config
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(model_dir.name)
    if record is not None:
        writer.add_string(RECORD, json.dumps(record))
    _add_shape(writer, arch.name, c)
    writer.add_vocab_size(c.vocab_size)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32,
                          "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[quantize])
    _add_vocabulary(writer, tok, model_dir, pre=pre, size=c.vocab_size)
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    types: Counter[str] = Counter()
    tensors = model.state_dict()
    # Stacked experts, named without ".weight"; transformers fuses gate and up on load.
    for key in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        parts = ("gate_proj", "up_proj") if key.endswith("gate_up_proj") else ("down_proj",)
        for part, data in zip(parts, tensors.pop(key).chunk(len(parts), dim=1), strict=True):
            tensors[f"{key.rsplit('.', 1)[0]}.{part}.weight"] = data
    shape = Shape.of(c)
    for name, tensor in tensors.items():
        if c.tie_word_embeddings and name == "lm_head.weight":
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"--format gguf: no GGUF name for the tensor {name} of "
                             f"{arch.name.lower()}")
        data = tensor.detach().float()
        if arch.name == "GPT2" and data.ndim == 2 and ".h." in name:  # Conv1D: (in, out)
            data = data.T
        if arch.name in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _interleaved_rotary(data, shape.kv_heads if "k_proj" in name
                                       else shape.heads)
        if arch.name in ("GEMMA2", "GEMMA3") and name.endswith("norm.weight"):
            data = data + 1.0
        types[_add_tensor(writer, target, data.numpy(), quantize)] += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"architecture": gguf.MODEL_ARCH_NAMES[arch], "tokenizer_pre": pre,
            "tensor_types": dict(types), "bytes": out.stat().st_size}


def _add_shape(writer, arch: str, c) -> None:
    """The model's hyperparameters, as llama.cpp's ``arch`` reads them."""
    import gguf

    shape = Shape.of(c)
    head_dim = shape.head_dim
    writer.add_block_count(shape.layers)
    # llama.cpp's Phi-3 attends to all it holds, transformers' to a window: the file's length
    # is as far as they agree.
    window = (arch == "PHI3" and c.sliding_window) or c.max_position_embeddings
    writer.add_context_length(min(window, c.max_position_embeddings))
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "GPT2":  # learned positions, LayerNorms
        writer.add_layer_norm_eps(c.layer_norm_epsilon)
        return
    part = c.rope_parameters.get("partial_rotary_factor", 1)  # Phi-3's (Phi-4 mini 0.75)
    writer.add_rope_dimension_count(int(head_dim * part))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch in ("GEMMA2", "GEMMA3"):
        writer.add_sliding_window(c.sliding_window)  # Gemma 2's every other layer, as llama.cpp
        if c.final_logit_softcapping:
            writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "GEMMA2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if arch == "GEMMA3":
        rope = c.rope_parameters
        writer.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
        writer.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    else:
        writer.add_rope_freq_base(float(theta := c.rope_parameters["rope_theta"]))
        if (kind := c.rope_parameters.get("rope_type", "default")) != "default":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            plain = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
            writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                              (plain / ROPE_INIT_FUNCTIONS[kind](c, "cpu")[0]).numpy())
    if arch == "QWEN3MOE":
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "GRANITE":  # its four scalars, where Llama has none
        writer.add_embedding_scale(c.embedding_multiplier)
        writer.add_residual_scale(c.residual_multiplier)
        writer.add_attention_scale(c.attention_multiplier)
        writer.add_logit_scale(c.logits_scaling)


def _quantized_by_llama_cpp(model_dir: Path, out: Path, quantize: str,
                            record: dict | None) -> dict[str, Any]:
    import gguf
    import llama_cpp

    full = Path(tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}-", suffix=".f32")[1])
    report = write_gguf(model_dir, full, quantize="f32", record=record)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = BY_LLAMA_CPP[quantize]
    # The binding prints llama.cpp's log to sys.stderr: a line per tensor, kept for a failure.
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            failed = llama_cpp.llama_model_quantize(str(full).encode(), str(out).encode(), params)
    finally:
        full.unlink()
    if failed:
        raise RuntimeError(f"llama.cpp's quantizer failed to write {quantize}: "
                           f"{said.getvalue()[-2000:]}")
    types = Counter(t.tensor_type.name.lower() for t in gguf.GGUFReader(out).tensors)
    return {**report, "tensor_types": dict(types), "bytes": out.stat().st_size}


def _interleaved_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The rows of a query or key projection reordered from transformers' rotation of each
    head's two halves to llama.cpp's rotation of adjacent pairs: within each head, row i of
    the first half and row i of the second half become rows 2i and 2i + 1."""
    rows = weight.shape[0] // heads
    return (weight.reshape(heads, 2, rows // 2, *weight.shape[1:]).transpose(1, 2)
            .reshape(weight.shape))


def _add_tensor(writer, name: str, data: np.ndarray, quantize: str) -> str:
    import gguf

    if data.ndim == 1 or quantize == "f32":
        writer.add_tensor(name, data.astype(np.float32))
        return "f32"
    if quantize == "q8_0" and data.shape[-1] % gguf.GGML_QUANT_SIZES[
            gguf.GGMLQuantizationType.Q8_0][0] == 0:
        packed = gguf.quants.quantize(data.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        # Shaped in bytes per row: the writer reads the element shape back from it.
        writer.add_tensor(name, packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        return "q8_0"
    writer.add_tensor(name, data.astype(np.float16))
    return "f16"


def _add_vocabulary(writer, tok, model_dir: Path, *, pre: str, size: int) -> None:
    """Every token id below the model's vocabulary size, in order (ids no token has are
    unused padding), with its kind; a SentencePiece-style vocabulary's byte tokens, and its
    merges' order as scores (llama.cpp joins the best-scored pair first); the merges, special
    tokens and chat template as the ``gguf`` package reads them from the directory."""
    import gguf

    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    kind = gguf.TokenType
    spm = pre.startswith("spm")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    kinds = [kind.UNUSED if i not in by_id else kind.BYTE if spm and re.fullmatch(
        "<0x[0-9A-F]{2}>", by_id[i]) else kind.NORMAL if i not in added else kind.CONTROL
        if added[i].special else kind.USER_DEFINED for i in range(size)]
    writer.add_tokenizer_model("llama" if spm else "gpt2")
    writer.add_tokenizer_pre("default" if spm else pre)
    if spm:
        merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
        rank = {"".join(m.split(" ") if isinstance(m, str) else m): -float(i)
                for i, m in enumerate(merges)}
        writer.add_token_scores([rank.get(t, 0.0) for t in tokens])
        writer.add_add_space_prefix(pre == "spm")
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    special = gguf.SpecialVocab(str(model_dir), load_merges=not spm, n_vocab=size)
    special.add_to_gguf(writer, quiet=True)
