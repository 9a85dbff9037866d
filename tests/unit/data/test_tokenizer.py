from __future__ import annotations

import pytest
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
    write_run_info(str(tmp_path / "run"), config={"model": {"path": str(model)}}, vocab_size=400,
                   eos_id=0,
                   tokenizer_path=str(model), prepared=str(tmp_path / "prepared"))
    kept = {f.name for f in (tmp_path / "run" / TOKENIZER_DIR).iterdir()}
    assert "tokenizer.json" in kept and not kept & {"model.safetensors", "config.json"}
    ours = AutoTokenizer.from_pretrained(str(tmp_path / "run" / TOKENIZER_DIR))
    text = "The river carried the boats past the old mill."
    assert ours(text)["input_ids"] == AutoTokenizer.from_pretrained(str(model))(text)["input_ids"]


def test_each_familys_export_tokenizes_as_training_did(tokenizer_dir, tmp_path):
    """raylm's own tokenizer beside a model of each family raylm trains: what preparation
    tokenizes with (load_backend) is what AutoTokenizer builds from an export (the run's copy
    of the tokenizer beside the model's config.json), on text with digits, runs of spaces,
    accents and emoji. transformers builds some families' own class whatever tokenizer.json
    says (Qwen2's splits digits one by one), so training takes the tokenizer as it loads
    beside the model; the prepared data's fingerprint tells the two apart."""
    import shutil

    from raylm.config import load_config
    from raylm.data.preparation import prepared_fingerprint
    from raylm.formats.exporter import TOKENIZER_DIR, write_run_info
    from tests.distributed.test_pretrained import family_config

    text = "Numbers 1234567 and 3.14;   café naïve Ελλάδα 東京 🙂🚀\n\n\tdone"
    alone = load_backend(tokenizer_dir)[0].encode(text).ids
    rebuilt = []
    for family in ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3",
                   "granite", "olmo2", "phi3", "gpt2"]:
        model = tmp_path / family
        family_config(family).save_pretrained(str(model))
        trained = load_backend(tokenizer_dir, str(model))[0].encode(text).ids
        run = tmp_path / "runs" / family
        write_run_info(str(run), config={"model": {"path": str(model)}}, vocab_size=400,
                       eos_id=0, tokenizer_path=str(tokenizer_dir), prepared="")
        export = tmp_path / "exports" / family  # as raylm.formats.exporter.write_export
        AutoTokenizer.from_pretrained(str(run / TOKENIZER_DIR)).save_pretrained(str(export))
        shutil.copy(model / "config.json", export / "config.json")
        got = AutoTokenizer.from_pretrained(str(export))(text, add_special_tokens=False)
        assert got["input_ids"] == trained, family
        if trained != alone:
            rebuilt.append(family)
    assert "qwen2" in rebuilt, rebuilt  # what makes this test tell the two ways apart
    fingerprints = {f: prepared_fingerprint("corpus", load_config(None, [
        f"--tokenizer.path={tokenizer_dir}", *([f"--model.path={tmp_path / f}"] if f else [])]))
        for f in ("", "llama", "qwen2")}
    assert fingerprints[""] == fingerprints["llama"] != fingerprints["qwen2"]


def test_a_run_keeps_the_default_chat_template_it_started_with(tokenizer_dir, tmp_path):
    """A new run renders chats with the default template's version 2 and records it in
    run.json; a run whose run.json names none (started before) keeps version 1, and with it
    the prepared data's fingerprint it had (recorded here, computed before version 2)."""
    import json

    from raylm.config import load_config
    from raylm.data.preparation import prepared_fingerprint, template_version
    from raylm.formats.exporter import write_run_info

    cfg = load_config(None, ["--data.format=chat", f"--run.storage_path={tmp_path}",
                             "--run.name=chat"])
    run = str(tmp_path / "chat")
    assert template_version(run) == 2
    new = prepared_fingerprint("corpus", cfg)
    (tmp_path / "chat").mkdir()
    before = {"config": {}, "vocab_size": 400, "eos_id": 0, "prepared": ""}  # as 6ef9b7a wrote
    (tmp_path / "chat" / "run.json").write_text(json.dumps(before))
    assert template_version(run) == 1
    assert prepared_fingerprint("corpus", cfg) == "ebd78dea72dbefa9" != new
    for name, version in (("chat", 1), ("fresh", 2)):  # each start records the version
        write_run_info(str(tmp_path / name), config={"model": {"path": None}},
                       vocab_size=400, eos_id=0, tokenizer_path=str(tokenizer_dir), prepared="")
        recorded = json.loads((tmp_path / name / "run.json").read_text())
        assert recorded["default_template"] == version == template_version(str(tmp_path / name))
    (tmp_path / "chat" / "run.json").write_text(json.dumps({**before, "default_template": "v9"}))
    with pytest.raises(ValueError, match="default_template is not a template version"):
        template_version(run)
    (tmp_path / "chat" / "run.json").write_text(json.dumps({**before, "default_template": 9}))
    with pytest.raises(ValueError, match="default_template=9 is no version"):
        template_version(run)
