"""Every record read comes out once, kept or with its reason; bad sources fail in one line."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raylm.data.corpus import (
    SourceError,
    SourceFile,
    builtin_files,
    is_bad,
    normalize,
    read_records,
    resolve_sources,
)


def reasons(path, fmt, **kw):
    return [(r.reason, r.line) for r in read_records(SourceFile(str(path), fmt), **kw)]


def test_jsonl_bad_records_are_counted_with_line(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_bytes(
        b'{"text": "good one"}\n'
        b'{"text": "broken\n'  # malformed JSON
        b'{"body": "no text field"}\n'
        b'\n'  # blank line: no record
        b'{"text": "bad \xff\xfe utf8"}\n'
        b'{"text": "   "}\n'
        b'[1, 2]\n'
        b'{"text": 5}\n'
        b'{"text": null}\n'
        b'{"text": "good two"}\n'
        b'{"text": "lone \\ud83d surrogate"}\n'  # valid JSON, no text: common in scraped data
        + b"[" * 100_000 + b"\n"  # nested past Python's stack
        + b'{"text": "a pair \\ud83d\\ude00 is one character"}\n'
    )
    got = reasons(p, "jsonl")
    assert got == [(None, 1), ("malformed", 2), ("missing_field", 3), ("undecodable", 5),
                   ("empty", 6), ("malformed", 7), ("malformed", 8), ("missing_field", 9),
                   (None, 10), ("undecodable", 11), ("malformed", 12), (None, 13)]
    kept = [r.text for r in read_records(SourceFile(str(p), "jsonl"))]
    assert [t for t in kept if t] == ["good one", "good two",
                                      "a pair \U0001f600 is one character"]


def test_text_units(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("First para\nstill first.\n\n\nSecond para.\n   \nThird.\n")
    assert [r.text for r in read_records(SourceFile(str(p), "text"))] == [
        "First para\nstill first.", "Second para.", "Third."]
    lines = [r.text for r in read_records(SourceFile(str(p), "text"), text_unit="line")]
    assert lines == ["First para", "still first.", "Second para.", "Third."]
    whole = [r.text for r in read_records(SourceFile(str(p), "text"), text_unit="file")]
    assert len(whole) == 1 and whole[0].startswith("First para") and whole[0].endswith("Third.")


def test_invalid_utf8_in_text_drops_only_its_paragraph(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes(b"fine paragraph\n\nbroken \xc3\x28 bytes\nsame para\n\nfine again\n")
    assert reasons(p, "text") == [(None, 1), ("undecodable", 3), (None, 6)]


def test_empty_file_is_one_bad_record(tmp_path):
    for name, fmt in [("e.txt", "text"), ("e.jsonl", "jsonl")]:
        p = tmp_path / name
        p.write_text("")
        assert reasons(p, fmt) == [("empty", 0)]
        assert is_bad("empty", 0) and not is_bad("empty", 3)


def test_min_chars_and_normalization(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps({"text": "  e\u0301t\u00e9\r\nok  "}) + "\n" +
                 json.dumps({"text": "tiny"}) + "\n")
    recs = list(read_records(SourceFile(str(p), "jsonl"), min_chars=5))
    assert recs[0].text == "\u00e9t\u00e9\nok" == normalize("e\u0301t\u00e9\r\nok")
    assert recs[1].reason == "too_short"


def test_parquet_and_missing_column(tmp_path):
    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["one", None, "three"]}), p)
    assert reasons(p, "parquet") == [(None, 1), ("missing_field", 2), (None, 3)]
    assert reasons(p, "parquet", text_field="body") == [("missing_field", i) for i in (1, 2, 3)]


def test_saved_hf_dataset_and_dict(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["alpha doc", "beta doc", ""]})
    ds.save_to_disk(str(tmp_path / "single"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    files = resolve_sources(str(tmp_path / "single"), builtin_packages=[])
    assert {f.format for f in files} == {"arrow"}
    recs = [r for f in files for r in read_records(f)]
    assert [r.text for r in recs] == ["alpha doc", "beta doc", None]
    assert recs[2].reason == "empty"
    test_split = resolve_sources(str(tmp_path / "dd"), builtin_packages=[], hf_split="test")
    assert [r.text for f in test_split for r in read_records(f)] == ["alpha doc"]
    with pytest.raises(SourceError, match="'validation' is not a split"):
        resolve_sources(str(tmp_path / "dd"), builtin_packages=[], hf_split="validation")


def test_missing_sources_fail_in_one_line(tmp_path):
    with pytest.raises(SourceError, match=f"path not found: {tmp_path / 'nope.jsonl'}"):
        resolve_sources(str(tmp_path / "nope.jsonl"), builtin_packages=[])
    with pytest.raises(SourceError, match="no files match"):
        resolve_sources(str(tmp_path / "*.jsonl"), builtin_packages=[])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match="unknown file type '.csv'"):
        resolve_sources(str(tmp_path / "x.csv"), builtin_packages=[])
    with pytest.raises(SourceError, match="none of .* is installed"):
        builtin_files(["no_such_package_xyz"])


def test_hub_dataset_that_does_not_exist(monkeypatch):
    # Offline mode keeps the test on this machine; the error path is the same as a 404.
    # (The flags are read at import, so set the imported constants too.)
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SourceError) as e:
        resolve_sources("hf:raylm-test/no-such-dataset", builtin_packages=[])
    msg = str(e.value)
    assert "'raylm-test/no-such-dataset' could not be loaded" in msg and "\n" not in msg


def test_directories_and_globs_are_sorted_and_typed(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "a.txt").write_text("y\n")
    (tmp_path / "sub" / "c.parquet").write_bytes(b"")
    (tmp_path / "notes.csv").write_text("ignored in a directory walk")
    files = resolve_sources(str(tmp_path), builtin_packages=[])
    assert [(f.path.rsplit("/", 1)[1], f.format) for f in files] == [
        ("a.txt", "text"), ("b.jsonl", "jsonl"), ("c.parquet", "parquet")]
    globbed = resolve_sources(str(tmp_path / "*.jsonl"), builtin_packages=[])
    assert [f.format for f in globbed] == ["jsonl"]


def test_builtin_corpus_is_real_prose_and_deterministic():
    files = builtin_files(["ray"])
    assert files == builtin_files(["ray"]) and len(files) > 100
    texts = [r.text for f in files[:300] for r in read_records(f) if r.text]
    assert sum(map(len, texts)) > 50_000
    words = Counter(w.lower() for t in texts for w in t.split())
    # English function words dominate real prose.
    assert {"the", "of", "to", "a"} <= {w for w, _ in words.most_common(30)}


def test_arrow_stream_and_file_formats(tmp_path):
    table = pa.table({"text": ["first", None], "blob": [b"x", b"\xff"]})
    with pa.ipc.new_file(tmp_path / "f.arrow", table.schema) as w:
        w.write_table(table)
    with pa.ipc.new_stream(tmp_path / "s.arrow", table.schema) as w:
        w.write_table(table)
    for name in ("f.arrow", "s.arrow"):
        assert reasons(tmp_path / name, "arrow") == [(None, 1), ("missing_field", 2)]
        # Binary text columns are decoded as UTF-8, and bad bytes are counted.
        assert reasons(tmp_path / name, "arrow", text_field="blob") == [(None, 1),
                                                                        ("undecodable", 2)]
        assert reasons(tmp_path / name, "arrow", text_field="nope") == [("missing_field", 1),
                                                                        ("missing_field", 2)]


def test_chat_examples_from_jsonl_each_with_one_outcome(tmp_path):
    from raylm.data.corpus import read_examples

    good = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    lines = [json.dumps({"messages": good}), "{broken", json.dumps([1, 2]),
             json.dumps({"text": "no messages"}),
             json.dumps({"messages": [{"role": "tool", "content": "x"}, *good]}),
             json.dumps({"messages": good[:1]}), "",
             json.dumps({"messages": [{"role": "user", "content": 5}, good[1]]})]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    recs = list(read_examples(SourceFile(str(path), "jsonl"), example_format="chat"))
    assert [(r.reason, r.line) for r in recs] == [
        (None, 1), ("malformed", 2), ("malformed", 3), ("missing_field", 4),
        ("unknown_role", 5), ("no_assistant", 6), ("malformed", 8)]
    assert json.loads(recs[0].text) == good


def test_examples_from_parquet_and_prompt_completion(tmp_path):
    from raylm.data.corpus import SourceError, read_examples

    chats = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
             [{"role": "user", "content": "Q"}]]
    pq.write_table(pa.table({"messages": chats}), tmp_path / "chat.parquet")
    recs = list(read_examples(SourceFile(str(tmp_path / "chat.parquet"), "parquet"),
                              example_format="chat"))
    assert [(r.reason, r.line) for r in recs] == [(None, 1), ("no_assistant", 2)]
    pq.write_table(pa.table({"prompt": ["2+2=", "3+3=", None], "completion": ["4", " ", "6"]}),
                   tmp_path / "pc.parquet")
    recs = list(read_examples(SourceFile(str(tmp_path / "pc.parquet"), "parquet"),
                              example_format="prompt_completion"))
    assert [r.reason for r in recs] == [None, "empty", "missing_field"]
    assert json.loads(recs[0].text)[1] == {"role": "assistant", "content": "4"}
    pq.write_table(pa.table({"question": ["a", "b"]}), tmp_path / "other.parquet")
    recs = list(read_examples(SourceFile(str(tmp_path / "other.parquet"), "parquet"),
                              example_format="prompt_completion"))
    assert [(r.reason, r.line) for r in recs] == [("missing_field", 1), ("missing_field", 2)]
    (tmp_path / "notes.txt").write_text("not examples\n")
    with pytest.raises(SourceError, match="data.format=chat reads examples from jsonl, "
                                          "parquet, arrow files"):
        list(read_examples(SourceFile(str(tmp_path / "notes.txt"), "text"),
                           example_format="chat"))


def test_a_record_over_the_size_limit_is_dropped_while_read_not_held(tmp_path, monkeypatch):
    """A line, paragraph, file or cell over MAX_RECORD_BYTES is too_long; the records around it
    are read as before, at their own line numbers (the limit is lowered to 1 kB here)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raylm.data import corpus

    monkeypatch.setattr(corpus, "MAX_RECORD_BYTES", 1000)
    big = "x" * 5000
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(f'{{"text": "first"}}\n{{"text": "{big}"}}\n{{"text": "third"}}\n'
                     f'{{"text": "{big}')  # the last line, without a newline
    got = [(r.text, r.reason, r.line) for r in corpus.read_records(corpus.SourceFile(
        str(jsonl), "jsonl"))]
    assert got == [("first", None, 1), (None, "too_long", 2), ("third", None, 3),
                   (None, "too_long", 4)]

    text = tmp_path / "b.txt"
    many_lines = "\n".join(["y" * 100] * 20)  # one paragraph of 2 kB in short lines
    text.write_text(f"intro\n\n{big}\n\n{many_lines}\n\nend\n")
    paragraphs = [(r.text, r.reason, r.line) for r in corpus.read_records(
        corpus.SourceFile(str(text), "text"))]
    assert paragraphs == [("intro", None, 1), (None, "too_long", 3), (None, "too_long", 5),
                          ("end", None, 26)]
    lines = [r.reason for r in corpus.read_records(corpus.SourceFile(str(text), "text"),
                                                     text_unit="line")]
    assert lines.count("too_long") == 1 and lines.count(None) == 22
    (whole,) = corpus.read_records(corpus.SourceFile(str(text), "text"), text_unit="file")
    assert whole.reason == "too_long"

    table = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": ["ok", "z" * 5000]}), table)
    assert [r.reason for r in corpus.read_records(corpus.SourceFile(str(table), "parquet"))] == [
        None, "too_long"]
    # A conversation's cell counts its turns' text; a preference row, its three cells. Read a
    # record batch at a time, past the first batch's 1,024 rows.
    chats = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]] * 1100
    chats[1050] = [{"role": "user", "content": "q"}, {"role": "assistant", "content": big}]
    pq.write_table(pa.table({"messages": chats}), tmp_path / "chat.parquet")
    reasons = [(r.reason, r.line) for r in corpus.read_examples(
        corpus.SourceFile(str(tmp_path / "chat.parquet"), "parquet"), example_format="chat")]
    assert len(reasons) == 1100 and reasons[1050] == ("too_long", 1051)
    assert {reason for reason, _ in reasons[:1050]} == {None}
    pairs = pa.table({"prompt": ["p", "p"], "chosen": ["a", "y" * 600],
                      "rejected": ["b", "n" * 600]})
    pq.write_table(pairs, tmp_path / "pairs.parquet")
    assert [r.reason for r in corpus.read_examples(corpus.SourceFile(
        str(tmp_path / "pairs.parquet"), "parquet"), example_format="preference")] == [
        None, "too_long"]
