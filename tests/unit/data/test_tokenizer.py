from __future__ import annotations

from transformers import AutoTokenizer

from raylm.data.corpus import SourceFile
from raylm.data.tokenizer import EOS_TOKEN, build_tokenizer, load_backend
from tests.conftest import make_docs, write_jsonl


def test_trained_tokenizer_round_trips_and_loads_with_transformers(tokenizer_dir):
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert hf.eos_token == EOS_TOKEN and hf.eos_token_id is not None
    for text in ["The river carried the boats.", "naïve café — 東京 🚀\n\ttabs", "x = f(y) + 1"]:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert hf.decode(ids) == text  # byte-level: nothing is lost, not even unseen scripts
    backend, eos = load_backend(tokenizer_dir)
    assert eos == hf.eos_token_id and backend.get_vocab_size() == len(hf)


def test_build_tokenizer_caches_by_fingerprint(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_docs(100))
    files = [SourceFile(str(corpus), "jsonl")]
    kw = dict(cache_dir=tmp_path / "cache", vocab_size=350, min_frequency=2,
              train_chars=100_000, text_field="text", text_unit="paragraph", log=lambda m: None)
    a = build_tokenizer(files, corpus_fingerprint="fp1", **kw)
    mtime = (a / "tokenizer.json").stat().st_mtime_ns
    assert build_tokenizer(files, corpus_fingerprint="fp1", **kw) == a
    assert (a / "tokenizer.json").stat().st_mtime_ns == mtime  # reused, not retrained
    b = build_tokenizer(files, corpus_fingerprint="fp2", **kw)
    assert b != a
    assert AutoTokenizer.from_pretrained(str(b)).vocab_size <= 350


def test_load_backend_errors(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="is not a directory"):
        load_backend(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_backend(tmp_path / "empty")


def test_a_run_keeps_only_the_tokenizers_files_of_a_model_directory(tokenizer_dir, tmp_path):
    """The tokenizer of a fine-tuning run is usually model.path itself: the run's copy (which
    exports and generation read) holds the tokenizer, not the model's weights and config."""
    import json
    import shutil

    from raylm.formats.exporter import TOKENIZER_DIR, write_run_info

    model = tmp_path / "model"
    shutil.copytree(tokenizer_dir, model)
    (model / "model.safetensors").write_bytes(b"\0" * 1024)
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    write_run_info(str(tmp_path / "run"), config={}, vocab_size=400, eos_id=0,
                   tokenizer_path=str(model), prepared=str(tmp_path / "prepared"))
    kept = {f.name for f in (tmp_path / "run" / TOKENIZER_DIR).iterdir()}
    assert "tokenizer.json" in kept and not kept & {"model.safetensors", "config.json"}
    ours = AutoTokenizer.from_pretrained(str(tmp_path / "run" / TOKENIZER_DIR))
    text = "The river carried the boats past the old mill."
    assert ours(text)["input_ids"] == AutoTokenizer.from_pretrained(str(model))(text)["input_ids"]
