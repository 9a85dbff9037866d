"""Text sources: where documents come from, and how one file becomes a stream of records.

A source resolves, on the driver and before any Ray work, into a sorted list of
:class:`SourceFile`; a missing path or an unknown dataset is a one-line :class:`SourceError`.
Each file is then read by :func:`read_records`, which never raises on bad content: every record it
sees comes out once, either with its normalized text or with the reason it was dropped, so the
pipeline's counts always add up (``documents_read == documents_kept + sum(dropped)``).

The builtin corpus is the documentation already installed with raylm: the docstrings of the
modules, classes and functions of transformers, torch, ray, datasets, mlflow and peft, parsed with
``ast`` (no imports). It needs no download, is the same for the same installed versions, and is
about 21 MB of English prose and code examples (one document per docstring; about 30k documents,
of which a good share are exact duplicates copied between model files).
"""

from __future__ import annotations

import ast
import glob
import hashlib
import importlib.util
import json
import os
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from raylm.contracts import PREPARED_MANIFEST

Format = Literal["text", "jsonl", "parquet", "arrow", "pydoc"]

#: Why a record did not become a training document. Every record read gets exactly one outcome.
DROP_REASONS = ("malformed", "missing_field", "empty", "duplicate", "undecodable", "too_short",
                "too_long")
#: The largest record read: a JSONL line, a text paragraph, line or file (text_unit), a table
#: cell. A longer one is dropped as ``too_long`` while it is read, never held whole, so a
#: newline-free multi-gigabyte file costs a pass over it, not its size in memory. No
#: language-model document comes near it (64 MiB is about 16 million tokens).
MAX_RECORD_BYTES = 64 << 20
#: The further reasons of fine-tuning examples (``data.format`` chat or prompt_completion): a
#: role other than system/user/assistant, a conversation without an assistant turn, one left
#: with no trained token once cut to a block (``data.long_examples: truncate``), one whose text
#: spells a control token, a preference pair whose chosen and rejected answers are the same.
#: (``too_long``, above, is also one longer than a block under ``drop``.)
ROLES = ("system", "user", "assistant")
EXAMPLE_DROP_REASONS = ("unknown_role", "no_assistant", "no_trained_tokens", "control_text",
                        "identical_answers")
#: Reasons that mean the input itself is broken (listed by file and line; fatal with
#: ``on_bad_record: error``). The others are ordinary filtering.
BAD_REASONS = frozenset({"malformed", "missing_field", "undecodable", "unknown_role",
                         "no_assistant", "identical_answers"})
#: File formats that hold fine-tuning examples (fields of a row, not running text).
EXAMPLE_FORMATS = ("jsonl", "parquet", "arrow")

SUFFIX_FORMATS: dict[str, Format] = {
    ".txt": "text", ".text": "text", ".md": "text", ".rst": "text",
    ".jsonl": "jsonl", ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
}


class SourceError(ValueError):
    """A source that cannot be read at all: missing path, unknown dataset, unknown file type."""


@dataclass(frozen=True)
class SourceFile:
    path: str
    format: Format


@dataclass(frozen=True)
class Record:
    """One record as read: ``text`` is set when kept, ``reason`` when dropped."""

    text: str | None
    reason: str | None
    line: int
    """1-based line (text/JSONL), row (Parquet/Arrow) or docstring line (pydoc); 0 for a whole
    file (an empty file)."""
    row: str | None = None
    """A prompt's whole row, every column, as JSON (:func:`row_json`): what its reward reads."""


def is_bad(reason: str | None, line: int) -> bool:
    """Bad input (listed, fatal under on_bad_record=error): broken records and empty files."""
    return reason in BAD_REASONS or (reason == "empty" and line == 0)


# ---- Resolving sources ---------------------------------------------------------------------


def resolve_sources(
    source: str | list[str], *, builtin_packages: list[str], hf_split: str = "train"
) -> list[SourceFile]:
    """Expand ``data.source`` into the files to read, in a deterministic order."""
    sources = [source] if isinstance(source, str) else list(source)
    files: list[SourceFile] = []
    for s in sources:
        files.extend(_resolve_one(s, builtin_packages=builtin_packages, hf_split=hf_split))
    if not files:
        raise SourceError(f"data.source {source!r} contains no readable files "
                          f"(known types: {', '.join(sorted(SUFFIX_FORMATS))}).")
    return files


def _resolve_one(s: str, *, builtin_packages: list[str], hf_split: str) -> list[SourceFile]:
    if s == "builtin":
        return builtin_files(builtin_packages)
    if s.startswith("hf:"):
        return _hub_dataset_files(s[3:], hf_split)
    path = Path(s).expanduser()
    if any(c in s for c in "*?["):
        matches = sorted(glob.glob(str(path), recursive=True))
        found = [f for m in matches for f in _files_under(Path(m), s)]
        if not found:
            raise SourceError(f"data.source: no files match {s!r}.")
        return found
    if not path.exists():
        raise SourceError(f"data.source: path not found: {path}")
    if path.is_dir() and (path / PREPARED_MANIFEST).is_file():
        raise SourceError(f"data.source: {path} is a prepared directory; it cannot be mixed "
                          f"with other sources.")
    if path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):
        return _saved_dataset_files(path, hf_split)
    return _files_under(path, s)


def _files_under(path: Path, origin: str) -> list[SourceFile]:
    if path.is_file():
        fmt = SUFFIX_FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise SourceError(
                f"data.source: {path} has an unknown file type {path.suffix!r}; "
                f"use one of {', '.join(sorted(SUFFIX_FORMATS))}."
            )
        return [SourceFile(str(path.resolve()), fmt)]
    files = sorted(
        p for p in path.rglob("*")
        if p.is_file() and p.suffix.lower() in SUFFIX_FORMATS and not p.name.startswith(".")
    )
    if not files:
        raise SourceError(f"data.source: {origin!r} holds no files of a known type "
                          f"({', '.join(sorted(SUFFIX_FORMATS))}).")
    return [SourceFile(str(p.resolve()), SUFFIX_FORMATS[p.suffix.lower()]) for p in files]


def is_prepared_dir(source: str | list[str]) -> bool:
    return isinstance(source, str) and (Path(source).expanduser() / PREPARED_MANIFEST).is_file()


def _saved_dataset_files(path: Path, split: str) -> list[SourceFile]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises several types for a damaged directory
        raise SourceError(f"data.source: cannot load the saved dataset at {path}: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise SourceError(f"data.hf_split: {split!r} is not a split of {path}; "
                              f"it has {', '.join(ds)}.")
        ds = ds[split]
    return [SourceFile(f["filename"], "arrow") for f in ds.cache_files]


def _hub_dataset_files(spec: str, split: str) -> list[SourceFile]:
    import datasets

    name, _, config = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as e:  # hub errors come as many types: not found, offline, gated
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SourceError(
            f"data.source: Hugging Face dataset {name!r} could not be loaded ({first}). "
            f"Check the name, or download it elsewhere and point data.source at its "
            f"save_to_disk directory."
        ) from None
    return [SourceFile(f["filename"], "arrow") for f in ds.cache_files]


def builtin_files(packages: list[str]) -> list[SourceFile]:
    """The ``.py`` files of the installed ``packages``, in sorted order (absent ones skipped)."""
    files: list[SourceFile] = []
    for pkg in packages:
        spec = importlib.util.find_spec(pkg)
        if spec is None or spec.origin is None:
            continue
        root = Path(spec.origin).parent
        files.extend(SourceFile(str(p), "pydoc") for p in sorted(root.rglob("*.py")))
    if not files:
        raise SourceError(f"data.builtin_packages: none of {packages} is installed; "
                          f"name installed packages or set data.source to your corpus.")
    return files


def fingerprint_files(files: list[SourceFile]) -> str:
    """Changes when any file is added, removed, resized or touched."""
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        st = os.stat(f.path)
        h.update(f"{f.path}\0{f.format}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


# ---- Reading records -----------------------------------------------------------------------


def normalize(text: str) -> str:
    """NFC, Unix newlines, no surrounding whitespace: the text that is hashed and tokenized."""
    return unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n")).strip()


def content_hash(text: str) -> int:
    """64-bit hash of the normalized text: exact-duplicate key and the train/val splitter."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def read_records(
    f: SourceFile, *, text_field: str = "text", text_unit: str = "paragraph", min_chars: int = 0
) -> Iterator[Record]:
    """Every record of one file, once, each with its text or its drop reason."""
    raw = {
        "text": _text_records,
        "jsonl": _jsonl_records,
        "parquet": _table_records,
        "arrow": _table_records,
        "pydoc": _pydoc_records,
    }[f.format](f, text_field=text_field, text_unit=text_unit)
    n = 0
    for text, reason, line in raw:
        n += 1
        if reason is None:
            text = normalize(text)
            if not text:
                reason = "empty"
            elif len(text) < min_chars:
                reason = "too_short"
        yield Record(text if reason is None else None, reason, line)
    if n == 0 and f.format != "pydoc":
        # An empty file is not silently nothing: it is one record, dropped and listed. (A
        # Python module without docstrings is just that, not bad input.)
        yield Record(None, "empty", 0)


def read_examples(f: SourceFile, *, example_format: str, messages_field: str = "messages",
                  prompt_field: str = "prompt", completion_field: str = "completion",
                  chosen_field: str = "chosen", rejected_field: str = "rejected",
                  strings: str = "user_turn") -> Iterator[Record]:
    """Every fine-tuning example of one JSONL/Parquet/Arrow file, once: its text is the checked,
    normalized conversation as JSON (what is hashed for deduplication and the split, and
    rendered later by :mod:`raylm.data.chat`), or it has the reason it was dropped.
    ``strings``: how a string prompt is read (:data:`raylm.contracts.STRING_PROMPTS`); a run
    that does not say is one started before the rule (``user_turn``), as its fingerprints
    keep."""
    if f.format not in EXAMPLE_FORMATS:
        raise SourceError(f"data.format={example_format} reads examples from "
                          f"{', '.join(EXAMPLE_FORMATS)} files; {f.path} is {f.format}.")
    fields = {"chat": [messages_field], "prompt_completion": [prompt_field, completion_field],
              "preference": [prompt_field, chosen_field, rejected_field],
              "prompt": [prompt_field]}[example_format]
    n = 0
    whole = example_format == "prompt"  # a prompt keeps its row: its reward reads the columns
    for row, reason, line in _rows(f, fields, whole=whole):
        n += 1
        messages = None
        if reason is None:
            if example_format == "chat":
                value = row[messages_field]
                messages, reason = ((None, "missing_field") if value is None
                                    else parse_messages(value))
            elif example_format == "preference":
                messages, reason = parse_preference(*(row[k] for k in fields), strings)
            elif example_format == "prompt":
                value = row[prompt_field]
                messages, reason = ((None, "missing_field") if value is None
                                    else parse_prompt(value, strings))
            else:
                messages, reason = parse_prompt_completion(
                    row[prompt_field], row[completion_field], strings)
        text = None if reason is not None else json.dumps(messages, ensure_ascii=False)
        kept = whole and reason is None
        yield Record(text, reason, line, row_json(row, where=f"{f.path}:{line}") if kept else None)
    if n == 0:
        yield Record(None, "empty", 0)


def row_json(row: dict[str, Any], *, where: str) -> str:
    """A data row as the JSON its prompt keeps in the prepared blocks: JSON's own values as
    they are, dates and times as ISO 8601 text; anything else (bytes, a decimal) is refused
    naming its column, before any block is written."""
    import datetime

    def plain(value: Any) -> Any:
        if isinstance(value, (datetime.date, datetime.time, datetime.datetime)):
            return value.isoformat()
        raise TypeError(type(value).__name__)

    try:
        return json.dumps(row, ensure_ascii=False, default=plain)
    except TypeError as e:
        def fails(value: Any) -> bool:
            try:
                json.dumps(value, default=plain)
            except TypeError:
                return True
            return False

        name = next(k for k, v in row.items() if fails(v))  # the first column that fails alone
        raise SourceError(f"{where}: column {name!r} holds a {e} value, which a prompt's row "
                          f"cannot keep (it is stored as JSON for the reward); cast the column "
                          f"to text or numbers in the source, or drop it.") from None


def read_rows(f: SourceFile) -> dict[int, dict[str, Any]]:
    """Every row of a JSONL/Parquet/Arrow file with all its columns, by the line (or row)
    :func:`read_examples` gives it."""
    if f.format == "jsonl":
        return {line: obj for obj, _, line in _jsonl_objects(f) if obj is not None}
    import pyarrow as pa
    import pyarrow.parquet as pq

    if f.format == "parquet":
        return dict(enumerate(pq.read_table(f.path).to_pylist(), start=1))
    with pa.memory_map(f.path) as source:  # `datasets` writes the streaming format
        try:
            table = pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:  # the random-access file format
            table = pa.ipc.open_file(source).read_all()
        return dict(enumerate(table.to_pylist(), start=1))


def first_row(source: str | list[str], *, hf_split: str = "train") -> dict[str, Any] | None:
    """The first readable row of a local prompt source, every column (the preflight calls the
    reward function on it); None for a hub dataset or a prepared directory (not read before
    Ray starts) or a source without one."""
    first = source if isinstance(source, str) else source[0]
    if first.startswith("hf:") or first == "builtin" or is_prepared_dir(first):
        return None
    for f in resolve_sources(first, builtin_packages=[], hf_split=hf_split):
        if f.format == "jsonl":
            for obj, _, _ in _jsonl_objects(f):
                if obj is not None:
                    return obj
        elif f.format == "parquet":
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(f.path).iter_batches(batch_size=1):
                return batch.to_pylist()[0]
        elif f.format == "arrow":
            rows = read_rows(f)
            if rows:
                return rows[1]
    return None


def _rows(f: SourceFile, fields: list[str], *, whole: bool = False) -> Iterator[tuple]:
    """``(row, reason, line)``: each row of a JSONL/Parquet/Arrow file as a mapping of the
    ``fields`` (absent ones None; with ``whole``, every other column too), or the reason it
    cannot be read."""
    if f.format == "jsonl":
        for obj, reason, lineno in _jsonl_objects(f):
            if obj is not None:
                obj = {**dict.fromkeys(fields), **obj} if whole else {k: obj.get(k)
                                                                      for k in fields}
            yield obj, reason, lineno
        return
    present, batches, rows = _table_batches(f, fields, whole=whole)
    if batches is None:  # none of the fields: every row lacks them
        for i in range(rows):
            yield dict.fromkeys(fields), None, i + 1
        return
    line = 0
    # A record batch at a time: a file's columns are never Python lists whole.
    for batch in batches:
        columns = {k: batch.column(batch.schema.get_field_index(k)).to_pylist()
                   for k in present}
        for i in range(batch.num_rows):
            line += 1
            row = {k: (columns[k][i] if k in columns else None)
                   for k in (dict.fromkeys([*fields, *present]) if whole else fields)}
            if sum(_cell_size(v) for v in row.values()) > MAX_RECORD_BYTES:
                yield None, "too_long", line
            else:
                yield row, None, line


def _cell_size(value: Any) -> int:
    """The UTF-8 bytes of the text a table cell holds (a conversation's turns included)."""
    if isinstance(value, (str, bytes)):
        return _utf8_size(value)
    if isinstance(value, dict):
        return sum(_cell_size(v) for v in value.values())
    if isinstance(value, list):
        return sum(_cell_size(v) for v in value)
    return 0


def _lines(fh) -> Iterator[tuple[int, bytes | None]]:
    """``(line number, line)`` for each line of a binary file, the line None when it is longer
    than MAX_RECORD_BYTES (read past in pieces of that size, never held whole)."""
    limit = MAX_RECORD_BYTES
    lineno = 0
    while True:
        raw = fh.readline(limit + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > limit and not raw.endswith(b"\n"):
            while (rest := fh.readline(limit)) and not rest.endswith(b"\n"):
                pass
            yield lineno, None
            continue
        yield lineno, raw


def _text_records(f: SourceFile, *, text_unit: str, **_) -> Iterator[tuple]:
    with open(f.path, "rb") as fh:
        if text_unit == "file":
            data = fh.read(MAX_RECORD_BYTES + 1)
            if len(data) > MAX_RECORD_BYTES:
                yield None, "too_long", 1
                return
            try:
                yield data.decode("utf-8-sig"), None, 1
            except UnicodeDecodeError:
                yield None, "undecodable", 1
            return
        para: list[str] = []
        size, start, bad = 0, 0, None
        for lineno, raw in _lines(fh):
            if raw is None:
                line, bad_line = "\ufffd", "too_long"
            else:
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError:
                    line, bad_line = "\ufffd", "undecodable"
                else:
                    bad_line = None
            if text_unit == "line":
                if line.strip():
                    yield (None, bad_line, lineno) if bad_line else (line, None, lineno)
                continue
            if not line.strip() and not bad_line:
                if para:
                    yield (None, bad, start) if bad else ("".join(para), None, start)
                para, size, bad = [], 0, None
                continue
            if not para:
                start = lineno
            size += len(raw or b"")
            if size > MAX_RECORD_BYTES:
                bad_line = "too_long"
            # A paragraph already too long keeps only a placeholder until its blank line.
            para.append(line if bad is None and bad_line is None else "")
            bad = bad or bad_line
        if para:
            yield (None, bad, start) if bad else ("".join(para), None, start)


def _jsonl_objects(f: SourceFile) -> Iterator[tuple]:
    """``(object, None, line)`` for each JSON object line of a JSONL file, or ``(None, reason,
    line)`` for a line that is not one."""
    with open(f.path, "rb") as fh:
        for lineno, raw in _lines(fh):
            if raw is None:
                yield None, "too_long", lineno
                continue
            if not raw.strip():
                continue  # blank lines separate nothing and hold no record
            try:
                obj = json.loads(raw.decode("utf-8"))
                if b"\\u" in raw:  # an escaped lone surrogate is valid JSON but not text
                    json.dumps(obj, ensure_ascii=False).encode()
            except UnicodeError:
                yield None, "undecodable", lineno
                continue
            except (ValueError, RecursionError):  # a line nested past Python's stack: malformed
                yield None, "malformed", lineno
                continue
            if not isinstance(obj, dict):
                yield None, "malformed", lineno
                continue
            yield obj, None, lineno


def _jsonl_records(f: SourceFile, *, text_field: str, **_) -> Iterator[tuple]:
    for obj, reason, lineno in _jsonl_objects(f):
        if obj is None:
            yield None, reason, lineno
            continue
        value = obj.get(text_field)
        if value is None:
            yield None, "missing_field", lineno
        elif not isinstance(value, str):
            yield None, "malformed", lineno
        else:
            yield value, None, lineno


def _table_batches(f: SourceFile, columns: list[str], *, whole: bool = False):
    """(the ``columns`` the file has, their record batches, None), or ([], None, row count)
    when it has none of them. With ``whole``, the batches hold every column the file has
    (listed after them), wherever it has one of ``columns``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def found(names: list[str]) -> list[str]:
        present = [c for c in columns if c in names]
        if whole and present:
            present += [c for c in names if c not in present]
        return present

    if f.format == "parquet":
        pf = pq.ParquetFile(f.path)
        present = found(pf.schema_arrow.names)
        if not present:
            return [], None, pf.metadata.num_rows
        return present, pf.iter_batches(columns=present, batch_size=1024), None
    source = pa.memory_map(f.path)
    try:  # `datasets` writes the streaming format
        stream = pa.ipc.open_stream(source)
        schema, batches = stream.schema, stream
    except pa.ArrowInvalid:  # the random-access file format
        reader = pa.ipc.open_file(source)
        schema = reader.schema
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    present = found(schema.names)
    if not present:
        return [], None, sum(b.num_rows for b in batches)
    return present, batches, None


def _table_records(f: SourceFile, *, text_field: str, **_) -> Iterator[tuple]:
    _, batches, rows_without_field = _table_batches(f, [text_field])
    if batches is None:
        for row in range(1, rows_without_field + 1):
            yield None, "missing_field", row
        return
    row = 0
    for batch in batches:
        for value in batch.column(batch.schema.get_field_index(text_field)).to_pylist():
            row += 1
            if value is None:
                yield None, "missing_field", row
            elif len(value) > MAX_RECORD_BYTES // 4 and _utf8_size(value) > MAX_RECORD_BYTES:
                yield None, "too_long", row
            elif isinstance(value, bytes):
                try:
                    yield value.decode("utf-8"), None, row
                except UnicodeDecodeError:
                    yield None, "undecodable", row
            elif not isinstance(value, str):
                yield None, "malformed", row
            else:
                yield value, None, row


def _utf8_size(value: str | bytes) -> int:
    return len(value) if isinstance(value, bytes) else len(value.encode("utf-8", "replace"))


_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _pydoc_records(f: SourceFile, **_) -> Iterator[tuple]:
    try:
        tree = ast.parse(Path(f.path).read_bytes())
    except (SyntaxError, ValueError):
        yield None, "malformed", 1
        return
    for node in ast.walk(tree):
        if isinstance(node, _DOC_NODES):
            doc = ast.get_docstring(node, clean=True)
            if doc is not None:
                yield doc, None, getattr(node, "lineno", 1)


# ---- Checking fine-tuning examples (what raylm.data.chat renders) --------------------------


def parse_messages(value: Any, *, needs_assistant: bool = True
                   ) -> tuple[list[dict[str, str]] | None, str | None]:
    """``(messages, None)`` for a valid conversation, normalized; ``(None, reason)`` otherwise:
    ``malformed`` (not a non-empty list of ``{role, content}`` with string values),
    ``unknown_role`` (a role other than system, user, assistant), ``no_assistant`` (nothing
    to train on)."""
    if not isinstance(value, (list, tuple)) or not value:
        return None, "malformed"
    messages = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            return None, "malformed"
        if m["role"] not in ROLES:
            return None, "unknown_role"
        messages.append({"role": m["role"], "content": normalize(m["content"])})
    if needs_assistant and not any(m["role"] == "assistant" for m in messages):
        return None, "no_assistant"
    return messages, None


def parse_prompt_completion(prompt: Any, completion: Any, strings: str = "as_written"
                            ) -> tuple[list | dict | None, str | None]:
    """A prompt/completion pair, normalized: two strings as ``[user, assistant]`` messages
    (rendered as written: the prompt, then the completion and EOS); a conversation (not ending
    with an assistant turn) and its completion (a string: one assistant turn, or assistant
    turns) as ``{prompt, completion}`` message lists, rendered with the chat template (runs of
    the ``user_turn`` rule read only strings). Or ``(None, reason)``: ``missing_field``,
    ``malformed``, ``unknown_role``, ``empty`` (an empty completion: nothing to train on)."""
    if prompt is None or completion is None:
        return None, "missing_field"
    if isinstance(prompt, str):
        answer, reason = parse_answer(completion, written=True)
        return (None, reason) if reason else ([{"role": "user", "content": normalize(prompt)},
                                               {"role": "assistant", "content": answer}], None)
    if strings == "user_turn":
        return None, "malformed"
    return parse_pair(prompt, {"completion": completion}, strings)


def parse_prompt(prompt: Any, strings: str = "as_written"
                 ) -> tuple[str | list[dict[str, str]] | None, str | None]:
    """A prompt, normalized: a string as written (``empty`` if it holds nothing), or under
    the ``user_turn`` rule as one user turn; a conversation, which must not end with an
    assistant turn (the answer comes next)."""
    if isinstance(prompt, str):
        text = normalize(prompt)
        if strings == "user_turn":
            return [{"role": "user", "content": text}], None
        return (text, None) if text.strip() else (None, "empty")
    turns, reason = parse_messages(prompt, needs_assistant=False)
    if reason is None and turns[-1]["role"] == "assistant":
        return None, "malformed"
    return turns, reason


def parse_answer(value: Any, *, written: bool = False
                 ) -> tuple[str | list[dict[str, str]] | None, str | None]:
    """An answer to a prompt, normalized: after a prompt used as written (``written``) a
    string, as written; after a conversation assistant turns, of which a string is one."""
    if written:
        if not isinstance(value, str):
            return None, "malformed"
        text = normalize(value)
        return (text, None) if text else (None, "empty")
    if isinstance(value, str):
        value = [{"role": "assistant", "content": value}]
    answer, reason = parse_messages(value, needs_assistant=False)
    if reason is not None:
        return None, reason
    if any(m["role"] != "assistant" for m in answer):
        return None, "malformed"
    if not all(m["content"] for m in answer):
        return None, "empty"
    return answer, None


def parse_pair(prompt: Any, answers: dict[str, Any], strings: str
               ) -> tuple[dict[str, Any] | None, str | None]:
    """``{"prompt": ..., **answers}`` parsed: the prompt by :func:`parse_prompt`, each answer
    by :func:`parse_answer` (as written after a prompt used as written), or
    ``(None, reason)``."""
    turns, reason = parse_prompt(prompt, strings)
    if reason is not None:
        return None, reason
    pair: dict[str, Any] = {"prompt": turns}
    for name, value in answers.items():
        pair[name], reason = parse_answer(value, written=isinstance(turns, str))
        if reason is not None:
            return None, reason
    return pair, None


def parse_preference(prompt: Any, chosen: Any, rejected: Any, strings: str = "as_written"
                     ) -> tuple[dict[str, Any] | None, str | None]:
    """A preference pair as ``{prompt, chosen, rejected}``, normalized (:func:`parse_pair`:
    strings as written, or messages), or ``(None, reason)``: ``missing_field``, ``malformed``,
    ``unknown_role``, ``empty`` (an answer with nothing to train on), ``identical_answers``
    (nothing to prefer)."""
    if prompt is None or chosen is None or rejected is None:
        return None, "missing_field"
    pair, reason = parse_pair(prompt, {"chosen": chosen, "rejected": rejected}, strings)
    if reason is not None:
        return None, reason
    if pair["chosen"] == pair["rejected"]:
        return None, "identical_answers"
    return pair, None
