"""raylm.storage on a local directory and through a URI (file://, pyarrow's filesystem path,
the one s3:// and gs:// take)."""

from __future__ import annotations

import pytest

from raylm import storage
from raylm.config import load_config, run_dir
from raylm.run.tracking import resolve_uri


@pytest.fixture(params=["path", "uri"])
def root(request, tmp_path):
    return str(tmp_path) if request.param == "path" else f"file://{tmp_path}"


def test_files_round_trip(root, tmp_path):
    f = storage.join(root, "a", "summary.json")
    assert storage.size(f) is None and not storage.is_file(f)
    with pytest.raises(FileNotFoundError):
        storage.read_text(f)
    storage.write_text(f, "{}")
    storage.write_text(f, '{"x": 1}')  # replaced whole
    assert storage.read_text(f) == '{"x": 1}' and storage.size(f) == 8
    assert storage.read_bytes(f) == b'{"x": 1}'
    log = storage.join(root, "a", "events.jsonl")
    if storage.is_uri(root):  # object storage has no append
        with pytest.raises(AssertionError):
            storage.append_text(log, "one\n")
        storage.write_text(log, "one\ntwo\n")
    else:
        storage.append_text(log, "one\n")
        storage.append_text(log, "two\n")
    assert storage.read_text(log) == "one\ntwo\n"
    storage.write_text(storage.join(root, "a", "checkpoint_1", "m.json"), "1")
    assert storage.list_dirs(storage.join(root, "a")) == ["checkpoint_1"]
    assert storage.list_files(storage.join(root, "a")) == ["events.jsonl", "summary.json"]
    assert storage.list_files(storage.join(root, "missing")) == []
    assert storage.list_dirs(storage.join(root, "missing")) == []
    assert storage.is_dir(storage.join(root, "a")) and not storage.is_dir(f)
    assert storage.parent(f) == storage.join(root, "a") and storage.name(f) == "summary.json"
    # No temporary files left beside the ones written.
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "checkpoint_1", "events.jsonl", "summary.json"]


def test_directories_travel_both_ways(root, tmp_path):
    src = tmp_path / "local"
    (src / "sub").mkdir(parents=True)
    (src / "tokenizer.json").write_text("t")
    (src / "sub" / "x").write_text("y")
    remote = storage.join(root, "runs", "tokenizer")
    storage.upload(src, remote)
    back = storage.download(remote, tmp_path / "back")
    assert (back / "tokenizer.json").read_text() == "t" and (back / "sub" / "x").read_text() == "y"


def test_run_dir_of_a_uri_and_mlflow_default(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(None, ["--run.storage_path=s3://bucket/runs/", "--run.name=r1"])
    assert run_dir(cfg) == "s3://bucket/runs/r1"
    with pytest.raises(ValueError, match="run.storage_path='s3://bucket/runs/' is object storage"
                                         ".*set tracking.uri"):
        resolve_uri(cfg)
    local = load_config(None, [f"--run.storage_path={tmp_path}", "--run.name=r1"])
    assert run_dir(local) == str(tmp_path / "r1")
    assert resolve_uri(local) == f"sqlite:///{tmp_path}/mlflow.db"


def test_credentials_in_uris_are_redacted_from_what_is_printed_and_logged():
    from raylm.run.tracking import _param_value

    assert storage.redact("s3://AKIA123:s3cr3t@bucket/runs and http://u:p@mlflow:5000/x") == (
        "s3://***@bucket/runs and http://***@mlflow:5000/x")
    assert storage.redact("gs://b/p?X-Goog-Signature=abc&x=1&access_token=t") == (
        "gs://b/p?X-Goog-Signature=***&x=1&access_token=***")
    assert storage.redact("runs/plain and http://mlflow:5000") == "runs/plain and http://mlflow:5000"
    # MLflow params are the flat config: a URI with a secret is logged without it.
    assert _param_value(["s3://k:s@b/x"]) == '["s3://***@b/x"]'


def test_no_credentials_in_the_run_directory_and_a_partial_tokenizer_copy_is_redone(
        tmp_path, tokenizer_dir):
    """run.json's config and the summary's checkpoint path keep the address, not the keys."""
    import json

    from raylm.formats.exporter import write_run_info
    from raylm.run.record import RunRecord
    from raylm.run.tracking import Tracker

    cfg = load_config(None, ["--run.storage_path=s3://AKIA123:s3cr3t@bucket/runs",
                             "--tracking.uri=http://u:pw-123@mlflow:5000"]).to_dict()
    write_run_info(str(tmp_path), config=cfg, vocab_size=1, eos_id=0,
                   tokenizer_path=str(tokenizer_dir), prepared="p")
    # The run's copy of the tokenizer, its digest written last; the same tokenizer again is
    # not copied again.
    digest = (tmp_path / "tokenizer" / ".raylm-tokenizer").read_text()
    (tmp_path / "tokenizer" / "stray").write_text("x")
    write_run_info(str(tmp_path), config=cfg, vocab_size=1, eos_id=0,
                   tokenizer_path=str(tokenizer_dir), prepared="p")
    assert (tmp_path / "tokenizer" / "stray").exists()
    (tmp_path / "tokenizer" / ".raylm-tokenizer").write_text("partial copy")
    write_run_info(str(tmp_path), config=cfg, vocab_size=1, eos_id=0,
                   tokenizer_path=str(tokenizer_dir), prepared="p")
    assert not (tmp_path / "tokenizer" / "stray").exists()
    assert (tmp_path / "tokenizer" / ".raylm-tokenizer").read_text() == digest
    written = (tmp_path / "run.json").read_text()
    assert "s3cr3t" not in written and "pw-123" not in written
    assert json.loads(written)["config"]["run"]["storage_path"] == "s3://***@bucket/runs"
    record = RunRecord(str(tmp_path), total_steps=2, tracker=Tracker())
    record.checkpoint_path = "s3://AKIA123:s3cr3t@bucket/runs/r/checkpoint_1"
    assert record.summary().checkpoint_path == "s3://***@bucket/runs/r/checkpoint_1"
