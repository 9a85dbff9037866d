"""GGUF files (raylm.formats.llamacpp) run in llama.cpp itself (llama-cpp-python): its logits are
transformers' for each family written, it splits text into transformers' tokens for each
pre-tokenizer it names, and what it would compute otherwise is refused. The export of a
trained run (greedy tokens, each type's loss) is tested in tests/integration/test_train.py."""

from __future__ import annotations

import io
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from raylm.formats import llamacpp
from tests.conftest import make_docs
from tests.distributed.test_pretrained import family_config, save_family

llama_cpp = pytest.importorskip("llama_cpp")

TEXTS = ["The river carried the boats down to the mill, and 42 people waited.",
         "Numbers 1234567 and 3.14; symbols (a+b)*c != d?\n\nNew  lines\tand tabs.",
         "Unicode: café, naïve, 東京, emoji 🙂 — done."]


def save_model(root: Path, family: str, tokenizer_dir: Path, **settings) -> Path:
    """A tiny random-weight ``family`` model with the tokenizer of ``tokenizer_dir``."""
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    # Ids no token has: padding rows, as models have.
    out = save_family(root / family, family, vocab_size=len(vocab) + 8, **settings)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def run_llama_cpp(path: Path, ids: list[int]) -> np.ndarray:
    llm = llama_cpp.Llama(str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2)
    try:
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)])
    finally:
        llm.close()


def llama_cpp_tokens(path: Path, text: str) -> list[int]:
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        return llm.tokenize(text.encode(), add_bos=False, special=False)
    finally:
        llm.close()


FAMILY_SETTINGS = {
    # Gemma 3 as published: queries scaled by the head size; one layer of two global, so
    # both of its rotary bases and the window's layer pattern are used.
    "gemma3": {"query_pre_attn_scalar": 16, "sliding_window": 8,
               "layer_types": ["sliding_attention", "full_attention"]},
    # Gemma 2: soft caps low enough that the logits reach them (at their defaults, 50 and 30,
    # a tiny model's never do); the window shorter than the text.
    # Qwen3-MoE as released (transformers' default leaves the top-k weights unnormalized).
    "qwen3_moe": {"norm_topk_prob": True},
    "gemma2": {"query_pre_attn_scalar": 16, "sliding_window": 8, "attn_logit_softcapping": 0.05,
               "final_logit_softcapping": 0.5},
    # A GPT-2 config that also carries a key/value head count, which transformers ignores
    # (GPT-2 has one per head): the file says 4, as transformers computes.
    "gpt2": {"num_key_value_heads": 2}}


def assert_runs_as_in_transformers(model_dir: Path, path: Path, texts=tuple(TEXTS)) -> None:
    """llama.cpp splits every text into transformers' tokens, and its logits of a text are
    transformers' (to 1e-3: its matmuls sum in another order)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    for text in texts:
        assert llama_cpp_tokens(path, text) == tok(text, add_special_tokens=False)["input_ids"]
    ids = tok(TEXTS[0], add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(run_llama_cpp(path, ids), want, atol=1e-3, rtol=0)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2",
                                    "gemma3", "olmo2", "granite", "gpt2"])
def test_llama_cpp_computes_transformers_logits_and_tokens_for_each_family(
        family, tokenizer_dir, tmp_path):
    """fp32 GGUF: llama.cpp computes transformers' logits through Llama's reordered
    query/key rows, Qwen2's biases, Qwen3's per-head norms, Gemma 3's shifted norms, scaled
    embeddings and sliding window (8 tokens, the text longer), Gemma 2's two soft caps and
    window, OLMo 2's norms after each block and Granite's four scalars (without any one of
    them, or with OLMo 2's rows reordered, the logits are 0.03 to 0.7 away: checked); raylm's
    byte-level BPE splits every text alike in both.
    (Beside a Qwen2 model transformers 5 loads it with Qwen2's own pre-tokenizer, and the
    file says so.)"""
    model_dir = save_model(tmp_path, family, tokenizer_dir, **FAMILY_SETTINGS.get(family, {}))
    info = llamacpp.write_gguf(model_dir, tmp_path / "m.gguf", quantize="f32")
    assert info["architecture"] == {"mistral": "llama", "qwen3_moe": "qwen3moe"}.get(family, family)
    assert info["tokenizer_pre"] == ("qwen2" if family == "qwen2" else "gpt-2")
    assert set(info["tensor_types"]) == {"f32"}
    assert_runs_as_in_transformers(model_dir, tmp_path / "m.gguf")


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> Path:
    """A SentencePiece BPE vocabulary with byte fallback (the kind of Llama 2's, Mistral 7B's,
    Gemma's and Phi-3's), trained by the sentencepiece package on the test corpus."""
    import sentencepiece

    out, model = tmp_path_factory.mktemp("sentencepiece"), io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(make_docs(200) * 3), model_writer=model, vocab_size=400,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, minloglevel=2)
    (out / "tokenizer.model").write_bytes(model.getvalue())
    return out


PHI3 = {"sliding_window": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                  "partial_rotary_factor": 0.5}}


@pytest.mark.parametrize("family,tokenizer", [("llama", "LlamaTokenizer"),
                                              ("gemma3", "GemmaTokenizer"),
                                              ("phi3", "LlamaTokenizer")])
def test_sentencepiece_vocabularies_split_and_run_as_in_transformers(
        family, tokenizer, sentencepiece_model, tmp_path):
    """A SentencePiece vocabulary as transformers builds it from a ``tokenizer.model``
    (Llama's, Mistral's and Phi-3's a Metaspace putting "▁" first, Gemma's without): llama.cpp
    splits every text into transformers' tokens (byte tokens for what the vocabulary lacks:
    accents, CJK, emoji, newlines, tabs; the merges in their order, which the scores carry:
    with equal scores the documents split otherwise) and computes its logits. Phi-3 (fused
    projections; its released tokenizer's "<|endoftext|>" added, which llama.cpp requires)
    rotates half of each head's dimensions, and its window, which llama.cpp's Phi-3 does not
    keep, is the file's context length. Not alike in the two, and not tested: a text that
    begins with a space, where transformers' Metaspace puts no second "▁" and llama.cpp
    does."""
    import gguf
    import transformers

    tok = getattr(transformers, tokenizer).from_pretrained(str(sentencepiece_model))
    if family == "phi3":
        tok.add_tokens(["<|endoftext|>"], special_tokens=True)
    tok.save_pretrained(tmp_path / "tok")
    model_dir = save_model(tmp_path, family, tmp_path / "tok",
                           **{**FAMILY_SETTINGS, "phi3": PHI3}.get(family, {}))
    info = llamacpp.write_gguf(model_dir, tmp_path / "m.gguf", quantize="f32")
    assert info["tokenizer_pre"] == ("spm-no-prefix" if family == "gemma3" else "spm")
    assert_runs_as_in_transformers(model_dir, tmp_path / "m.gguf", (*TEXTS, *make_docs(3)))
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert fields[f"{info['architecture']}.context_length"].parts[-1][0] == (
        64 if family == "phi3" else 128)
    kinds = Counter(fields["tokenizer.ggml.token_type"].parts[i][0]
                    for i in fields["tokenizer.ggml.token_type"].data)
    assert kinds[gguf.TokenType.BYTE] == 256


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "linear", "factor": 4.0}], ids=["llama3", "linear"])
def test_rotary_scaling_reaches_llama_cpp_as_its_frequency_factors(rope, tokenizer_dir,
                                                                    tmp_path):
    """Llama 3.1's rotary scaling (and linear): llama.cpp's logits are transformers' over the
    text's positions (more than 16). A pretraining length of 16 puts the head's frequencies on
    every side of the scaling's two wavelengths (scaled, smoothed, kept), and the same model
    without the scaling gives other logits, so the factors are what makes them agree."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = None
    logits = {}
    for name, parameters in (("scaled", rope), ("plain", {"rope_type": "default"})):
        model_dir = save_model(tmp_path / name, "llama", tokenizer_dir,
                               rope_parameters={"rope_theta": 10000.0, **parameters})
        llamacpp.write_gguf(model_dir, tmp_path / f"{name}.gguf", quantize="f32")
        ids = ids or AutoTokenizer.from_pretrained(str(model_dir))(
            TEXTS[0], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits[name] = AutoModelForCausalLM.from_pretrained(str(model_dir))(
                torch.tensor([ids])).logits[0].numpy()
        got = run_llama_cpp(tmp_path / f"{name}.gguf", ids)
        np.testing.assert_allclose(got, logits[name], atol=1e-3, rtol=0)
    import gguf

    factors = [t for t in gguf.GGUFReader(tmp_path / "scaled.gguf").tensors
               if t.name == "rope_freqs.weight"]
    assert [len(t.data) for t in factors] == [8] and factors[0].data.max() > 1  # head_dim / 2
    assert not [t for t in gguf.GGUFReader(tmp_path / "plain.gguf").tensors
                if t.name == "rope_freqs.weight"]
    assert np.abs(logits["scaled"] - logits["plain"]).max() > 1e-2


def test_each_type_holds_its_tensor_types_and_strays_further_as_its_bits_fall(
        tokenizer_dir, tmp_path):
    """f16 and Q8_0 written by raylm (every matrix, the 1-D norms fp32); Q6_K, Q5_K_M, Q4_K_M
    and Q4_0 by llama.cpp's own quantizer from raylm's fp32 file, in its mixes (the _m mixes
    keep three matrices at Q6_K), with the export's record kept. Rows of 256 values, so every
    k-quant block is whole. Each runs in llama.cpp near transformers' logits, each file
    smaller than the type before it and further from them."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = save_model(tmp_path, "qwen3", tokenizer_dir, hidden_size=256,
                           intermediate_size=512, head_dim=64)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok(TEXTS[0], add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(model_dir))(
            torch.tensor([ids])).logits[0].numpy()
    # 2 layers x (7 projections) + embeddings + untied head; 9 norms.
    cases = {"f16": {"f16": 16}, "q8_0": {"q8_0": 16}, "q6_k": {"q6_k": 16},
             "q5_k_m": {"q5_k": 13, "q6_k": 3}, "q4_k_m": {"q4_k": 13, "q6_k": 3},
             "q4_0": {"q4_0": 15, "q6_k": 1}}
    sizes, errors = [], []
    for quantize, matrices in cases.items():
        path = tmp_path / f"{quantize}.gguf"
        info = llamacpp.write_gguf(model_dir, path, quantize=quantize, record={"q": quantize})
        assert info["tensor_types"] == {**matrices, "f32": 9}
        assert json.loads(GGUFReader(path).fields[llamacpp.RECORD].contents()) == {"q": quantize}
        sizes.append(info["bytes"])
        errors.append(float(np.abs(run_llama_cpp(path, ids) - want).mean()))
    assert sorted(p.name for p in tmp_path.glob("*.gguf")) == sorted(f"{q}.gguf" for q in cases)
    assert sizes == sorted(sizes, reverse=True) and errors == sorted(errors), (sizes, errors)
    assert errors[0] < 1e-3 and errors[-1] < 0.2, errors  # logits spread 0.45 here


def bpe_tokenizer(out: Path, regex: str) -> Path:
    """A byte-level BPE trained here whose pre-tokenizer is ``regex`` then byte-level mapping,
    as Llama 3's and Qwen2's tokenizer files have it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(make_docs(200) + TEXTS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(out))
    return out


TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("name", ["llama-bpe", "qwen2"])
def test_llama_3_and_qwen2_pre_tokenizers_are_named_and_split_alike(name, tmp_path):
    """Each splits every text as transformers does; the tokenizer's chat template and its
    end-of-text token go with it."""
    from transformers import AutoTokenizer

    regex = next(r for r, n in llamacpp.SPLIT_REGEXES.items() if n == name)
    tok_dir = bpe_tokenizer(tmp_path / "tok", regex)
    model_dir = save_model(tmp_path, "llama", tok_dir)
    info = llamacpp.write_gguf(model_dir, tmp_path / "m.gguf", quantize="f16")
    assert info["tokenizer_pre"] == name
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    for text in TEXTS:
        assert llama_cpp_tokens(tmp_path / "m.gguf", text) == tok(
            text, add_special_tokens=False)["input_ids"]
    llm = llama_cpp.Llama(str(tmp_path / "m.gguf"), vocab_only=True, verbose=False)
    try:
        assert llm.metadata["tokenizer.chat_template"] == TEMPLATE
        assert llm.token_eos() == tok.eos_token_id
    finally:
        llm.close()


def test_what_llama_cpp_would_compute_otherwise_is_refused(tokenizer_dir, tmp_path):
    for gemma, cap in (("gemma2", None), ("gemma3", 50.0)):
        with pytest.raises(ValueError, match="query_pre_attn_scalar=256, llama.cpp by 16"):
            llamacpp.check_model(family_config(gemma).to_dict())
        config = family_config(gemma).to_dict() | {"query_pre_attn_scalar": 16,
                                                   "attn_logit_softcapping": cap}
        with pytest.raises(ValueError, match=f"attn_logit_softcapping={cap}: llama.cpp"):
            llamacpp.check_model(config)
    with pytest.raises(ValueError, match="Qwen3-MoE as released"):  # norm_topk_prob: false
        llamacpp.check_model(family_config("qwen3_moe").to_dict())
    with pytest.raises(ValueError, match="this model is GPTNeoXForCausalLM"):
        llamacpp.check_model({"model_type": "gpt_neox"})
    scaled = family_config("llama")
    scaled.rope_parameters = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                              "original_max_position_embeddings": 32}
    with pytest.raises(ValueError, match="rotary scaling 'yarn' is not written yet"):
        llamacpp.check_model(scaled.to_dict())
    scaled = family_config("qwen2")  # llama.cpp's qwen2 reads no frequency factors
    scaled.rope_parameters = {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}
    with pytest.raises(ValueError, match="'linear' is not written yet.*for Llama and Mistral"):
        llamacpp.check_model(scaled.to_dict())
    window = family_config("qwen2")
    window.use_sliding_window, window.sliding_window = True, 64
    with pytest.raises(ValueError, match="sliding window"):
        llamacpp.check_model(window.to_dict())
    # SentencePiece's vocabulary split at each "▁", which llama.cpp would not split.
    from tokenizers import Tokenizer, models, pre_tokenizers

    split = Tokenizer(models.BPE(byte_fallback=True))
    split.pre_tokenizer = pre_tokenizers.Metaspace(split=True)
    with pytest.raises(ValueError, match="neither a byte-level BPE nor SentencePiece's"):
        llamacpp.pre_tokenizer(json.loads(split.to_str()), "LLAMA")
    other = {"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Whitespace"}}
    with pytest.raises(ValueError, match=r"\(Whitespace\) is not one llama.cpp names"):
        llamacpp.pre_tokenizer(other, "LLAMA")
    ours = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    with pytest.raises(ValueError, match="this vocabulary lacks <unk>, <s>, </s>.$"):
        llamacpp.pre_tokenizer(ours, "PHI3")


def fake_run(root: Path, model_dir: Path, tokenizer_dir: Path) -> Path:
    """A LoRA run's record of ``model_dir`` without checkpoints: what an export reads before
    it loads one."""
    from raylm.config import load_config
    from raylm.contracts import RUN_INFO

    cfg = load_config(None, [f"--model.path={model_dir}", "--lora.rank=4"])
    run = root / "runs" / "sft"
    (run / "tokenizer").mkdir(parents=True)
    shutil.copy(tokenizer_dir / "tokenizer.json", run / "tokenizer" / "tokenizer.json")
    (run / RUN_INFO).write_text(json.dumps({"config": cfg.to_dict(), "vocab_size": 400,
                                            "eos_id": 0}))
    return run


def test_a_run_of_a_family_not_written_is_refused_before_its_output_exists(tokenizer_dir,
                                                                          tmp_path, capsys):
    """``raylm export --format gguf`` of a Qwen3-MoE run whose top-k weights are not
    normalized, and of a Phi-3 run without Phi-3's special tokens: refused from the run's
    record alone, naming the setting or the tokens, and the output never made; GGUF's types
    need --format gguf."""
    from raylm.cli import main

    out = tmp_path / "gguf"
    for family, says in (("qwen3_moe", "norm_topk_prob: true"),
                         ("phi3", "llama.cpp expects Phi-3's special tokens")):
        run = fake_run(tmp_path / family, save_model(tmp_path, family, tokenizer_dir),
                       tokenizer_dir)
        assert main(["export", str(run), "--output", str(out), "--format", "gguf"]) == 2
        assert says in capsys.readouterr().err
        assert not out.exists()
    assert main(["export", str(run), "--output", str(out), "--quantize", "q8_0"]) == 2
    assert "add --format gguf" in capsys.readouterr().err
    assert not out.exists()


def test_a_gguf_file_raylm_did_not_write_is_left_alone(tokenizer_dir, tmp_path, capsys):
    """``--output NAME.gguf`` is the file itself: where one stands without an export's record
    in its metadata (another tool's GGUF, any other file) or a folder has the name, the export
    is refused before it loads anything, and what is there stays as it was; a URI is refused
    (the file is renamed into place, which object storage cannot do)."""
    from raylm.cli import main

    model_dir = save_model(tmp_path, "llama", tokenizer_dir)
    run = fake_run(tmp_path, model_dir, tokenizer_dir)
    theirs, notes, folder = tmp_path / "theirs.gguf", tmp_path / "notes.gguf", tmp_path / "d.gguf"
    llamacpp.write_gguf(model_dir, theirs, quantize="f32")  # no record: not an export
    notes.write_text("my notes")
    (folder / "inside").mkdir(parents=True)
    before = theirs.read_bytes()
    for target in (theirs, notes, folder, "s3://bucket/model.gguf"):
        assert main(["export", str(run), "--output", str(target), "--format", "gguf"]) == 2
        assert "where none stands or where its own earlier export does" in \
            capsys.readouterr().err
    assert theirs.read_bytes() == before and notes.read_text() == "my notes"
    assert [p.name for p in folder.iterdir()] == ["inside"]
    assert not list(tmp_path.glob(".*.tmp")) and not Path("s3:").exists()
