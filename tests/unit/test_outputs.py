"""Outputs never damage inputs: the directories raylm writes are built beside their target and
renamed into place, replace only raylm's own earlier output, and are refused where they would
hold what they are made from (raylm.outputs, `raylm prepare --output`, `raylm export`)."""

from __future__ import annotations

import json
import threading

import pytest

from raylm.cli import main
from raylm.config import load_config
from raylm.contracts import EXPORT_INFO, PREPARED_MANIFEST, RUN_INFO
from raylm.formats.exporter import export
from raylm.outputs import OutputError, check_output, publish, staging
from tests.conftest import write_jsonl

PREPARED = dict(what="--output", marker=PREPARED_MANIFEST, key="fingerprint")


def corpus(root):
    """A corpus laid out as a prepared directory is: train/ and val/ (the layout that lost
    both files to `raylm prepare --output` onto it)."""
    for split in ("train", "val"):
        (root / split).mkdir(parents=True)
    write_jsonl(root / "train" / "a.jsonl", ["one document", "two documents"])
    write_jsonl(root / "val" / "b.jsonl", ["a held-out document"])
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_prepare_onto_its_own_corpus_is_refused_before_ray_and_keeps_it(
        tmp_path, capsys, ray_never_starts, monkeypatch):
    data = tmp_path / "data"
    files = corpus(data)
    before = {p: p.read_bytes() for p in files}
    monkeypatch.chdir(tmp_path)
    for output in ("data", "."):
        assert main(["prepare", "--data.source=data", f"--output={output}",
                     f"--run.cache_dir={tmp_path / 'cache'}"]) == 2
        err = capsys.readouterr().err
        assert "holds the source file" in err and err.count("\n") == 1, err
    assert {p: p.read_bytes() for p in files} == before


def test_only_raylms_own_earlier_output_is_replaced(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert check_output(out, **PREPARED) == out  # empty
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="holds files raylm did not write"):
        check_output(out, **PREPARED)
    # A manifest that is not raylm's does not prove anything either.
    (out / PREPARED_MANIFEST).write_text(json.dumps({"name": "someone else's"}))
    with pytest.raises(OutputError, match="did not write"):
        check_output(out, **PREPARED)
    (out / PREPARED_MANIFEST).write_text(json.dumps({"fingerprint": "abc"}))
    assert check_output(out, **PREPARED) == out
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="is a file"):
        check_output(tmp_path / "file", **PREPARED)


def test_a_published_output_replaces_the_old_whole_and_leaves_nothing_beside_it(tmp_path):
    out = tmp_path / "out"
    for n in range(2):
        tmp = staging(out)
        (tmp / PREPARED_MANIFEST).write_text(json.dumps({"fingerprint": n}))
        (tmp / f"part{n}").write_text("x")
        assert publish(tmp, out)
    assert sorted(p.name for p in out.iterdir()) == [PREPARED_MANIFEST, "part1"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_files_arriving_during_a_write_are_not_replaced(tmp_path):
    """The target was raylm's when the write began; by its end someone's files are there:
    nothing is replaced, and the built copy is removed."""
    out = tmp_path / "out"
    out.mkdir()
    (out / PREPARED_MANIFEST).write_text(json.dumps({"fingerprint": "old"}))
    tmp = staging(out)
    (tmp / PREPARED_MANIFEST).write_text(json.dumps({"fingerprint": "new"}))
    (out / PREPARED_MANIFEST).write_text(json.dumps({"name": "someone else's"}))
    with pytest.raises(OutputError, match="now holds files raylm did not write"):
        publish(tmp, out, mine=(PREPARED_MANIFEST, "fingerprint"))
    assert json.loads((out / PREPARED_MANIFEST).read_text()) == {"name": "someone else's"}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_killed_writers_staging_directory_is_removed_by_the_next_writer(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    out = tmp_path / "out"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    host = socket.gethostname()
    killed = tmp_path / f".out.raylm-{host}-{gone}-0123456789ab.tmp"
    live = tmp_path / f".out.raylm-{host}-{os.getpid()}-0123456789ab.tmp"
    elsewhere = tmp_path / f".out.raylm-another-host-{gone}-0123456789ab.tmp"
    for d in (killed, live, elsewhere):
        d.mkdir()
    tmp = staging(out)
    assert not killed.exists() and live.exists() and elsewhere.exists() and tmp.is_dir()


def test_a_uri_is_refused_as_an_output(tmp_path, monkeypatch):
    """Not a folder named `s3:` in the working directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputError, match="s3://bucket/m is a URI: raylm writes this output "
                                          "to a local or mounted directory"):
        check_output("s3://bucket/m", **PREPARED)
    assert not any(tmp_path.iterdir())


def test_two_preparations_of_one_cache_entry_both_succeed(tmp_path):
    """Both build in their own directory; the first to finish is kept, the other uses it."""
    out = tmp_path / "cache" / "entry"
    barrier, kept = threading.Barrier(2), []

    def prepare(n: int) -> None:
        tmp = staging(out)
        (tmp / PREPARED_MANIFEST).write_text(json.dumps({"fingerprint": "same", "by": n}))
        barrier.wait()
        kept.append(publish(tmp, out, same=True))

    threads = [threading.Thread(target=prepare, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(kept) == [False, True]
    assert json.loads((out / PREPARED_MANIFEST).read_text())["fingerprint"] == "same"
    assert [p.name for p in out.parent.iterdir()] == ["entry"]


@pytest.fixture
def lora_run(tmp_path):
    """A LoRA run's directory as export reads it first (its run.json), and its base model."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    cfg = load_config(None, [f"--model.path={base}", "--lora.rank=4"])
    run = tmp_path / "runs" / "sft"
    run.mkdir(parents=True)
    (run / RUN_INFO).write_text(json.dumps({"config": cfg.to_dict(), "vocab_size": 400,
                                             "eos_id": 0, "prepared": None}))
    return run, base


def test_export_never_writes_into_the_run_or_its_base_model(lora_run, tmp_path):
    run, base = lora_run
    for output, what in [(base, "the base model"), (run, "the run directory"),
                         (run.parent, "the run directory")]:
        with pytest.raises(OutputError, match=what):
            export(run, output)
    assert sorted(p.name for p in base.iterdir()) == ["config.json"]


def test_export_into_another_directory_or_export_kind_is_refused(lora_run, tmp_path):
    run, _ = lora_run
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_text("someone's weights")
    with pytest.raises(OutputError, match="did not write"):
        export(run, other)
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / EXPORT_INFO).write_text(json.dumps({"kind": "model", "step": 3}))
    # The adapter export of a LoRA run is another kind than a merged model.
    with pytest.raises(OutputError, match=r"another kind \(model, not lora-adapter\).*--overwrite"):
        export(run, merged)
