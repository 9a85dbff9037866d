"""Preparation: raw text -> packed blocks on disk, in tasks whose output does not depend on the
cluster that ran them.

The files of a corpus are cut into *pieces*: runs of consecutive files of about
``data.piece_mb`` of source each (by default 1/4096 of the corpus, at least 4 MB), decided by
the files alone. Then::

    A. hash  (a task per piece)      read, normalize, filter; the hash and (file, record) key of
                                     every kept document, split by hash into P partitions
    B. dedup (a task per partition)  one partition's keys from every piece, sorted by (hash,
                                     file, record): all but the first of each hash are
                                     duplicates, sent back to the pieces that hold them
    C. pack  (a task per piece)      read again, drop the piece's duplicates, tokenize, split
                                     train/val by hash, pack each split and write its Parquet
    driver                           plans the pieces, collects each piece's counts and its
                                     tail (what did not fill a block), packs the tails into a
                                     last piece, writes layout.json and then manifest.json

Exact deduplication keeps the first occurrence in (file, record) order, as one sequential pass
would, without any process holding every hash: a partition task holds 1/P of them (16 bytes per
document), a piece task one piece's duplicates, the driver one entry per piece and row group.
What a piece writes is a function of its files, its duplicates and the settings, and the
duplicates are a function of all the hashes, so the packed files and the manifest are the same
byte for byte on one CPU or on many nodes, whatever the scheduling (P depends on the number of
pieces only, and does not change the result anyway). A piece packs its own documents; what
does not fill its last block goes to the driver, which packs those tails on in piece order, so
under one block per split is dropped for the whole corpus, as one sequential pass would drop.

Ray Core tasks rather than Ray Data: deduplication is an exchange in both directions (each
piece's hashes out to the partitions, each partition's verdicts back to the pieces), which the
object store carries directly as the tasks' multiple returns, and packing needs one task to see
one piece's documents in order; Ray Data would take two hash shuffles and a join for the same.
Stage A reads but does not tokenize (reading is ~5% of the work): keeping A's tokens until the
verdicts arrive would hold the whole tokenized corpus in the object store.

Fine-tuning examples (``data.format`` chat or prompt_completion) take the same path: the tasks
read them as checked JSON, render and tokenize them with their loss mask (:mod:`raylm.data.chat`,
:class:`ExampleRenderer`), and pack them whole (:class:`raylm.data.packing.ExamplePacker`); their
blocks carry a ``loss_mask`` column, which the readers pass on.

Packed files and the cache live on a file system every node sees (``run.cache_dir``): the
piece tasks write their files where the driver will read the layout.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raylm import storage
from raylm.config import Config, cache_dir, run_dir
from raylm.contracts import LAYOUT, PROMPT_ROW, RUN_INFO, SPLITS, RunInfo
from raylm.data.chat import (
    DEFAULT_VERSION,
    DefaultTemplate,
    JinjaTemplate,
    control_text,
    conversation_segments,
    encode,
    example_pair,
    forged,
    longest_token_chars,
    pair_segments,
    prompt_segments,
    turns,
    within_chars,
)
from raylm.data.corpus import (
    DROP_REASONS,
    EXAMPLE_DROP_REASONS,
    EXAMPLE_FORMATS,
    PREPARED_MANIFEST,
    SourceError,
    SourceFile,
    content_hash,
    fingerprint_files,
    is_bad,
    is_prepared_dir,
    read_examples,
    read_records,
    resolve_sources,
)
from raylm.data.packing import ExamplePacker, Packer, source_key
from raylm.data.tokenizer import build_tokenizer, chat_template, load_backend, tokenizer_fingerprint
from raylm.outputs import building, check_output, publish

# 64 row groups per file: with 256-block row groups, 16,384 blocks (~17 MB at seq_len 256).
ROW_GROUPS_PER_FILE = 64
# The most dedup partitions: the driver holds pieces x P object refs for the exchange, and a
# partition task holds 1/P of all hashes (a billion documents: 16 GB / 64 = 250 MB per task).
MAX_PARTITIONS = 64


class BadRecordError(ValueError):
    """A bad record under ``data.on_bad_record: error``."""


# ---- Reading and tokenizing (inside the tasks) ---------------------------------------------

_RECORD_SCHEMA = pa.schema([
    ("text", pa.string()), ("reason", pa.string()), ("file_id", pa.int32()),
    ("line", pa.int64()), ("key", pa.int64()), ("hash", pa.uint64()), ("row", pa.string()),
])


def record_key(file_id: int, index: int) -> int:
    """Orders records as one sequential reader meets them: file, then record within the file."""
    return (file_id << 32) | index


def _records(files: list[tuple[SourceFile, int]], *, text_field: str, text_unit: str,
             min_chars: int, chunk_rows: int, examples: dict[str, str] | None = None):
    """Record tables of ``chunk_rows`` rows (the last may be short) read from ``files`` (each
    with its index in the corpus); fine-tuning examples when ``examples`` gives their format
    and fields."""
    cols: dict[str, list] = {name: [] for name in _RECORD_SCHEMA.names}
    for spec, file_id in files:
        records = (read_examples(spec, **examples) if examples else
                   read_records(spec, text_field=text_field, text_unit=text_unit,
                                min_chars=min_chars))
        for index, rec in enumerate(records):
            cols["text"].append(rec.text)
            cols["reason"].append(rec.reason)
            cols["file_id"].append(file_id)
            cols["line"].append(rec.line)
            cols["key"].append(record_key(file_id, index))
            cols["hash"].append(content_hash(rec.text) if rec.text is not None else 0)
            cols["row"].append(rec.row)
            if len(cols["text"]) >= chunk_rows:
                yield pa.table(cols, schema=_RECORD_SCHEMA)
                cols = {name: [] for name in _RECORD_SCHEMA.names}
    if cols["text"]:
        yield pa.table(cols, schema=_RECORD_SCHEMA)


@functools.lru_cache(maxsize=2)
def _tokenizer_from_json(tokenizer_json: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json)


@functools.lru_cache(maxsize=2)
def _text_tokenizer_from_json(tokenizer_json: str):
    """The tokenizer for running text: a special token's string in a document is ordinary
    text (``<|endoftext|>`` written in a file does not end the document; the document's one
    end of text is the EOS raylm appends)."""
    tok = _tokenizer_from_json.__wrapped__(tokenizer_json)
    tok.encode_special_tokens = True
    return tok


def _tokenize(tok, eos_id: int, table: pa.Table) -> pa.Table:
    texts = table.column("text").to_pylist()
    kept = [i for i, t in enumerate(texts) if t is not None]
    encoded = tok.encode_batch([texts[i] for i in kept], add_special_tokens=False)
    lengths = np.zeros(len(texts), dtype=np.int64)
    pieces = []
    for i, enc in zip(kept, encoded, strict=True):
        ids = enc.ids
        ids.append(eos_id)
        lengths[i] = len(ids)
        pieces.append(np.asarray(ids, dtype=np.int32))
    flat = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
    return table.drop_columns(["text"]).append_column("ids", ids)


class ExampleRenderer:
    """Tokenizes fine-tuning examples (:mod:`raylm.data.chat`): ids and loss mask, with examples
    longer than ``block_length`` dropped (``too_long``) or cut (``truncated``; dropped as
    ``no_trained_tokens`` when no trained target is left). An example whose text spells out one
    of the tokenizer's control tokens is dropped (``control_text``): the template renders text
    and markers into one string, where such text would end the example or forge a turn, and
    rows from untrusted sources must not steer the trained text that way."""

    def __init__(self, *, example_format: str, messages_field: str, prompt_field: str,
                 completion_field: str, chat_template: dict[str, Any] | None, loss_on: str,
                 block_length: int, long_examples: str, tokenizer, eos_id: int,
                 chosen_field: str | None = None, rejected_field: str | None = None,
                 default_template: int = DEFAULT_VERSION, strings: str = "user_turn") -> None:
        # (``strings``: how rows were read; each example's stored form says how it renders.)

        self.format, self.loss_on = example_format, loss_on
        self.template = (JinjaTemplate(**chat_template) if chat_template
                         else DefaultTemplate(default_template))
        self.block_length, self.long_examples = block_length, long_examples
        self.tok, self.eos_id = tokenizer, eos_id

        self.control = control_text(tokenizer)
        # Contents longer than this cannot fit a block: cut before rendering (see within_chars).
        longest = longest_token_chars(tokenizer)
        self.max_chars = 2 * block_length * longest if longest else None

    def __call__(self, table: pa.Table) -> pa.Table:

        if self.format == "preference":
            return self._pairs(table)
        if self.format == "prompt":
            return self._prompts(table)
        texts = table.column("text").to_pylist()
        reasons = table.column("reason").to_pylist()
        ids_out, masks_out, truncated, written = [], [], [], []
        for i, text in enumerate(texts):
            ids = mask = np.zeros(0, np.int32)
            cut = False
            example = json.loads(text) if text is not None else None
            if example is not None and forged(turns(example), self.control):
                reasons[i], example = "control_text", None
            if example is not None and len(turns(example)) > self.block_length:
                # Every turn renders to a token at least: longer than a block, unrendered.
                reasons[i], example = "too_long", None
            if example is not None and self.max_chars is not None:
                example, over = self._within(example)
                if over and self.long_examples == "drop":
                    reasons[i], example = "too_long", None
            if example is not None:
                segments = (pair_segments(self.template, *example_pair(example))
                            if self.format == "prompt_completion" else
                            conversation_segments(self.template, example, loss_on=self.loss_on))
                ids, mask = encode(segments, self.tok, eos_id=self.eos_id, loss_on=self.loss_on)
                if len(ids) > self.block_length:
                    if self.long_examples == "drop":
                        reasons[i] = "too_long"
                    else:
                        ids, mask, cut = ids[:self.block_length], mask[:self.block_length], True
                # The first token is never a target (nothing before it in its block).
                if reasons[i] is None and not mask[1:].any():
                    reasons[i] = "no_trained_tokens"
                if reasons[i] is not None:
                    ids, mask, cut = np.zeros(0, np.int32), np.zeros(0, np.uint8), False
            ids_out.append(ids)
            masks_out.append(mask)
            truncated.append(cut)
            written.append(self.format == "prompt_completion" and isinstance(example, list))
        return self._table(table, reasons, ids_out, masks_out, truncated, written)

    def _within(self, example: list | dict) -> tuple[list | dict, bool]:
        """``example`` cut to ``max_chars`` (:func:`raylm.data.chat.within_chars`); a
        conversation and its completion are cut as one conversation."""
        if not isinstance(example, dict):
            return within_chars(example, self.max_chars)
        prompt = example["prompt"]
        kept, over = within_chars([*prompt, *example["completion"]], self.max_chars)
        return {"prompt": kept[:len(prompt)], "completion": kept[len(prompt):]}, over

    @staticmethod
    def _table(table: pa.Table, reasons: list, ids: list, masks: list, truncated: list,
               written: list, splits: list | None = None) -> pa.Table:
        out = (table.drop_columns(["text", "reason"])
               .append_column("reason", pa.array(reasons, pa.string()))
               .append_column("ids", _list_array(ids, pa.int32()))
               .append_column("loss_mask", _list_array(masks, pa.uint8()))
               .append_column("truncated", pa.array(truncated, pa.bool_()))
               .append_column("as_written", pa.array(written, pa.bool_())))
        if splits is not None:
            out = out.append_column("split", pa.array(splits, pa.int32()))
        return out

    def _prompts(self, table: pa.Table) -> pa.Table:
        """Prompts for reinforcement learning: each rendered as the model is asked to answer
        it (:func:`raylm.data.chat.prompt_segments`: a string as written, a conversation as
        the template's generation prompt), nothing trained. A prompt is never cut: one
        longer than a block is dropped (``too_long``)."""
        reasons = table.column("reason").to_pylist()
        ids_out, written = [], []
        for i, text in enumerate(table.column("text").to_pylist()):
            ids = np.zeros(0, np.int32)
            prompt = json.loads(text) if text is not None else None
            if prompt is not None and forged(turns(prompt), self.control):
                reasons[i], prompt = "control_text", None
            if prompt is not None and self.max_chars is not None and \
                    within_chars(turns(prompt), self.max_chars)[1]:
                reasons[i], prompt = "too_long", None
            if prompt is not None:
                ids, _ = encode(prompt_segments(self.template, prompt), self.tok,
                                eos_id=self.eos_id, loss_on="all")
                if len(ids) > self.block_length:
                    reasons[i], ids = "too_long", np.zeros(0, np.int32)
            ids_out.append(ids)
            written.append(isinstance(prompt, str))
        masks = [np.zeros(len(ids), np.uint8) for ids in ids_out]
        return self._table(table, reasons, ids_out, masks, [False] * len(ids_out), written)

    def _pairs(self, table: pa.Table) -> pa.Table:
        """Preference pairs: the chosen half (answer targets marked 1) then the rejected half
        (marked 2) as one example, and where the second half starts. A pair is never cut: one
        that does not fit a block whole is dropped (``too_long``)."""

        reasons = table.column("reason").to_pylist()
        ids_out, masks_out, splits, written = [], [], [], []
        for i, text in enumerate(table.column("text").to_pylist()):
            ids, mask, split = np.zeros(0, np.int32), np.zeros(0, np.uint8), 0
            pair = json.loads(text) if text is not None else None
            if pair is not None and forged(turns(pair), self.control):
                reasons[i], pair = "control_text", None
            if pair is not None and self.max_chars is not None and any(
                    within_chars(turns(pair["prompt"]) + turns(pair[a]), self.max_chars)[1]
                    for a in ("chosen", "rejected")):
                reasons[i], pair = "too_long", None
            if pair is not None:
                halves = [encode(pair_segments(self.template, pair["prompt"], pair[a]),
                                 self.tok, eos_id=self.eos_id, loss_on="assistant")
                          for a in ("chosen", "rejected")]
                (c_ids, c_mask), (r_ids, r_mask) = halves
                if len(c_ids) + len(r_ids) > self.block_length:
                    reasons[i] = "too_long"
                elif not c_mask[1:].any() or not r_mask[1:].any():
                    reasons[i] = "no_trained_tokens"
                else:
                    ids = np.concatenate([c_ids, r_ids])
                    mask = np.concatenate([c_mask, 2 * r_mask]).astype(np.uint8)
                    split = len(c_ids)
            ids_out.append(ids)
            masks_out.append(mask)
            splits.append(split)
            written.append(pair is not None and isinstance(pair["prompt"], str))
        return self._table(table, reasons, ids_out, masks_out, [False] * len(splits), written,
                           splits)


def _list_array(pieces: list[np.ndarray], value_type) -> pa.ListArray:
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = (np.concatenate(pieces) if pieces else np.zeros(0)).astype(value_type.to_pandas_dtype())
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=value_type))


# ---- Writing blocks ------------------------------------------------------------------------


class BlockWriter:
    """Writes blocks of one split as Parquet files ``{prefix}-{k:05d}.parquet``, in row groups of
    exactly ``group_rows`` rows (the last may be short) so that row groups are the unit
    :class:`raylm.data.packing.SampleOrder` permutes. Each file is written under a temporary name
    and renamed when complete, so a piece task that is retried leaves no half file. Besides the
    tokens and document starts, each block keeps where its segments came from (``doc_sources``:
    :func:`raylm.data.packing.source_key` of file and line, 8 bytes per document), so that a
    sample a run leaves out can be traced to its records. A block of a prompt set keeps its
    prompt's whole row too (``prompt_row``, JSON: what the reward reads), so a prepared
    directory trains without its sources."""

    def __init__(self, directory: Path, *, block_length: int, group_rows: int,
                 loss_mask: bool = False, prefix: str = "part",
                 prompt_rows: bool = False) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.block_length = block_length
        self.group_rows = group_rows
        self.prefix = prefix
        fields = [("input_ids", pa.list_(pa.int32())), ("doc_starts", pa.list_(pa.int32())),
                  ("doc_sources", pa.list_(pa.int64()))]
        if loss_mask:
            fields.append(("loss_mask", pa.list_(pa.uint8())))
        if prompt_rows:
            fields.append((PROMPT_ROW, pa.string()))
        self.schema = pa.schema(fields)
        self.loss_mask, self.prompt_rows = loss_mask, prompt_rows
        self._rows: list[str] = []
        self._blocks: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._starts: list[np.ndarray] = []
        self._sources: list[np.ndarray] = []
        self._pending = 0
        self._writer: pq.ParquetWriter | None = None
        self._groups_in_file = 0
        self.files: list[str] = []
        self.group_sizes: list[int] = []
        self.file_groups: list[int] = []
        """Row groups of each file in :attr:`files`, so readers find a row group without
        opening every file's footer."""

    def add(self, blocks: np.ndarray, doc_starts: list[np.ndarray],
            sources: list[np.ndarray], masks: np.ndarray | None = None,
            rows: list[str] | None = None) -> None:
        assert (masks is not None) == self.loss_mask and len(sources) == len(blocks)
        assert (rows is not None) == self.prompt_rows
        if rows is not None:
            assert len(rows) == len(blocks)
            self._rows.extend(rows)
        if len(blocks):
            self._blocks.append(blocks)
            if masks is not None:
                self._masks.append(masks)
            self._starts.extend(doc_starts)
            self._sources.extend(sources)
            self._pending += len(blocks)
        while self._pending >= self.group_rows:
            self._flush(self.group_rows)

    def _flush(self, n: int) -> None:
        stacked = np.concatenate(self._blocks)
        rows, rest = stacked[:n], stacked[n:]
        starts, self._starts = self._starts[:n], self._starts[n:]
        sources, self._sources = self._sources[:n], self._sources[n:]
        self._blocks = [rest] if len(rest) else []
        columns = []
        if self.loss_mask:
            all_masks = np.concatenate(self._masks)
            mask_rows, mask_rest = all_masks[:n], all_masks[n:]
            self._masks = [mask_rest] if len(mask_rest) else []
            m_off = pa.array(np.arange(n + 1, dtype=np.int32) * self.block_length)
            columns.append(pa.ListArray.from_arrays(
                m_off, pa.array(mask_rows.reshape(-1), type=pa.uint8())))
        if self.prompt_rows:
            columns.append(pa.array(self._rows[:n], pa.string()))
            self._rows = self._rows[n:]
        self._pending -= n
        if self._writer is None or self._groups_in_file >= ROW_GROUPS_PER_FILE:
            self._open()
        offsets = pa.array(np.arange(n + 1, dtype=np.int32) * self.block_length)
        ids = pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1)))
        lens = np.fromiter((len(s) for s in starts), dtype=np.int32, count=n)
        s_off = pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        flat = np.concatenate(starts).astype(np.int32) if starts else np.zeros(0, np.int32)
        doc = pa.ListArray.from_arrays(s_off, pa.array(flat, type=pa.int32()))
        src = _list_array(sources, pa.int64())
        self._writer.write_table(pa.table([ids, doc, src, *columns], schema=self.schema),
                                 row_group_size=n)
        self._groups_in_file += 1
        self.group_sizes.append(n)

    def _open(self) -> None:
        self._finish_file()
        name = f"{self.prefix}-{len(self.files):05d}.parquet"
        self.files.append(name)
        self._writer = pq.ParquetWriter(self.dir / f".{name}.tmp", self.schema)
        self._groups_in_file = 0

    def _finish_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self.file_groups.append(self._groups_in_file)
            os.replace(self.dir / f".{self.files[-1]}.tmp", self.dir / self.files[-1])
            self._writer = None

    def close(self) -> None:
        if self._pending:
            self._flush(self._pending)
        self._finish_file()


# ---- The three stages ----------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """How the tasks read records (the same for stage A and C)."""

    text_field: str
    text_unit: str
    min_chars: int
    examples: dict[str, str] | None

    def records(self, files: list[tuple[SourceFile, int]], chunk_rows: int):
        return _records(files, text_field=self.text_field, text_unit=self.text_unit,
                        min_chars=self.min_chars, chunk_rows=chunk_rows,
                        examples=self.examples)


def plan_pieces(sizes: list[int], piece_bytes: int) -> list[int]:
    """The index of the first file of each piece, for files of ``sizes`` bytes in corpus order:
    a piece takes consecutive files until it holds at least ``piece_bytes`` of source (a file is
    never split)."""
    starts, size = [0], 0
    for i, n in enumerate(sizes):
        if size >= piece_bytes:
            starts.append(i)
            size = 0
        size += n
    return starts


def piece_bytes(sizes: list[int], piece_mb: float | None) -> int:
    """``data.piece_mb``, or by default 1/4096 of the corpus and at least 4 MB: small corpora
    still get pieces enough to keep a cluster busy, large ones no more than ~4096 (the dedup
    exchange holds pieces x partitions object refs on the driver). A property of the files
    alone, as the output must be."""
    if piece_mb is not None:
        return int(piece_mb * 2**20)
    return max(4 * 2**20, sum(sizes) // 4096)


def _piece_files(files: list[SourceFile], starts: list[int], piece: int
                 ) -> list[tuple[SourceFile, int]]:
    end = starts[piece + 1] if piece + 1 < len(starts) else len(files)
    return [(files[i], i) for i in range(starts[piece], end)]


def _returns(values: list):
    """A task's results as its ``num_returns=len(values)`` objects (with one, Ray stores the
    return value itself as the object, so the list must not be)."""
    return values if len(values) > 1 else values[0]


def hash_piece(files: list[tuple[SourceFile, int]], reading: Reading, partitions: int):
    """Stage A: for each partition, a (n, 2) uint64 array of (hash, record key) of the piece's
    kept documents whose hash falls in it."""
    hashes, keys = [], []
    for table in reading.records(files, chunk_rows=65536):
        kept = table.column("reason").is_null().to_numpy(zero_copy_only=False)
        hashes.append(table.column("hash").to_numpy()[kept])
        keys.append(table.column("key").to_numpy()[kept].astype(np.uint64))
    pairs = np.stack([np.concatenate([np.zeros(0, np.uint64), *hashes]),
                      np.concatenate([np.zeros(0, np.uint64), *keys])], axis=1)
    part = pairs[:, 0] % np.uint64(partitions)
    return _returns([pairs[part == p] for p in range(partitions)])


def find_duplicates(piece_starts: list[int], *parts: np.ndarray):
    """Stage B: one partition's (hash, key) pairs from every piece; for each piece, the sorted
    keys of its records that repeat a document met earlier in (file, record) order."""
    pairs = np.concatenate([np.zeros((0, 2), np.uint64), *parts])
    order = np.lexsort((pairs[:, 1], pairs[:, 0]))  # by hash, then by key
    hashes, keys = pairs[order, 0], pairs[order, 1]
    repeat = np.zeros(len(hashes), bool)
    repeat[1:] = hashes[1:] == hashes[:-1]
    dup = np.sort(keys[repeat]).astype(np.int64)
    piece = np.searchsorted(np.asarray(piece_starts, np.int64), dup >> 32, side="right") - 1
    return _returns([dup[piece == p] for p in range(len(piece_starts))])


@dataclass
class PieceResult:
    """What a piece task reports: its counts and, per split, the files and row groups it wrote
    and its tail (the tokens that did not fill a block, with their document starts)."""

    read: int = 0
    kept: int = 0
    truncated: int = 0
    as_written: int = 0
    """Kept examples whose prompt is a string, used as written (the others are messages)."""
    dropped: dict[str, int] = field(default_factory=dict)
    bad_records: list[dict[str, Any]] = field(default_factory=list)
    splits: dict[str, dict[str, Any]] = field(default_factory=dict)
    node: str = ""
    """The Ray node that ran the task (for the log)."""


def pack_piece(piece: int, files: list[tuple[SourceFile, int]], *duplicates: np.ndarray,
               reading: Reading, out: str, tokenizer_json: str, eos_id: int,
               block_length: int, group_rows: int, chunk_rows: int, val_fraction: float,
               on_bad_record: str, bad_records_listed: int,
               render: dict[str, Any] | None) -> PieceResult:
    """Stage C: read the piece, drop its duplicates, tokenize, split, pack and write it."""
    import ray

    tok = (_tokenizer_from_json if render else _text_tokenizer_from_json)(tokenizer_json)
    renderer = ExampleRenderer(**render, tokenizer=tok, eos_id=eos_id) if render else None
    dup = np.unique(np.concatenate([np.zeros(0, np.int64), *duplicates]))
    prefix = f"part-{piece:05d}"
    prompts = renderer is not None and renderer.format == "prompt"
    writers = {s: BlockWriter(Path(out) / s, block_length=block_length, group_rows=group_rows,
                              loss_mask=renderer is not None, prefix=prefix,
                              prompt_rows=prompts) for s in SPLITS}
    packers = {s: ExamplePacker(block_length, pad_id=eos_id, one_per_block=prompts)
               if renderer else Packer(block_length) for s in SPLITS}
    # A prompt's row by its source key, until the packer hands out the prompt's block.
    rows: dict[int, str] | None = {} if prompts else None
    val_cut = int(val_fraction * 2**64)
    res = PieceResult(dropped=dict.fromkeys(
        DROP_REASONS + (EXAMPLE_DROP_REASONS if renderer else ()), 0),
        node=ray.get_runtime_context().get_node_id())
    paths = {file_id: spec.path for spec, file_id in files}
    for table in reading.records(files, chunk_rows):
        # Duplicates are dropped before tokenizing: their text is not needed again.
        reasons = table.column("reason").to_pylist()
        is_dup = np.isin(table.column("key").to_numpy(), dup)
        for i in np.flatnonzero(is_dup):
            assert reasons[i] is None, "a duplicate must be a kept record"
            reasons[i] = "duplicate"
        if is_dup.any():
            texts = [None if d else t for d, t in
                     zip(is_dup, table.column("text").to_pylist(), strict=True)]
            table = (table.drop_columns(["text", "reason"])
                     .append_column("text", pa.array(texts, pa.string()))
                     .append_column("reason", pa.array(reasons, pa.string())))
        table = renderer(table) if renderer else _tokenize(tok, eos_id, table)
        reasons = table.column("reason").to_pylist()
        hashes = table.column("hash").to_numpy()
        lines = table.column("line").to_numpy()
        file_ids = table.column("file_id").to_numpy()
        ids = table.column("ids").combine_chunks()
        flat, offsets = ids.values.to_numpy(), ids.offsets.to_numpy()
        if renderer:
            mask_list = table.column("loss_mask").combine_chunks()
            masks, mask_offsets = mask_list.values.to_numpy(), mask_list.offsets.to_numpy()
            cut = table.column("truncated").to_numpy(zero_copy_only=False)
            as_written = table.column("as_written").to_numpy(zero_copy_only=False)
            pair_splits = (table.column("split").to_numpy()
                           if "split" in table.column_names else None)
        docs: dict[str, list] = {s: [] for s in SPLITS}
        keys: dict[str, list] = {s: [] for s in SPLITS}
        row_of = table.column("row").to_pylist() if rows is not None else None
        for i, reason in enumerate(reasons):
            res.read += 1
            if reason is not None:
                res.dropped[reason] += 1
                if is_bad(reason, int(lines[i])):
                    where = {"file": paths[int(file_ids[i])], "line": int(lines[i]),
                             "reason": reason}
                    if on_bad_record == "error":
                        raise BadRecordError(
                            f"{where['file']}:{where['line']}: {reason} record. "
                            f"Fix the input, or set data.on_bad_record=skip to drop and count "
                            f"such records.")
                    if len(res.bad_records) < bad_records_listed:
                        res.bad_records.append(where)
                continue
            res.kept += 1
            split = "val" if int(hashes[i]) < val_cut else "train"
            doc = flat[offsets[i]:offsets[i + 1]]
            if renderer:
                res.truncated += int(cut[i])
                res.as_written += int(as_written[i])
                doc = (doc, masks[mask_offsets[i]:mask_offsets[i + 1]])
                if pair_splits is not None:  # a preference pair: two documents
                    doc = (*doc, int(pair_splits[i]))
            docs[split].append(doc)
            keys[split].append(source_key(int(file_ids[i]), int(lines[i])))
            if row_of is not None:
                rows[keys[split][-1]] = row_of[i]
        for s in SPLITS:
            if docs[s]:
                _write(writers[s], packers[s].add(docs[s], np.array(keys[s], np.int64)), rows)
    for s in SPLITS:
        if renderer:
            _write(writers[s], packers[s].finish(), rows)
        writers[s].close()
        p = packers[s]
        res.splits[s] = {
            "files": writers[s].files, "row_group_sizes": writers[s].group_sizes,
            "file_groups": writers[s].file_groups, "blocks": p.blocks_out, "tokens": p.tokens_in,
            "padding_tokens": getattr(p, "padding_tokens", 0),
            "trained_tokens": getattr(p, "trained_tokens", 0),
            # What did not fill a block: packed on by the driver with the other pieces'.
            "tail": None if renderer else p.tail()}
    return res


# ---- The driver ----------------------------------------------------------------------------


def given_tokenizer(cfg: Config) -> Path | None:
    """The tokenizer directory to use as it is: ``tokenizer.path``, else the pretrained
    model's own (``model.path``, when it holds one); None: a BPE is trained."""
    if cfg.tokenizer.path:
        return Path(cfg.tokenizer.path).expanduser().resolve()
    model = cfg.model.path and Path(cfg.model.path).expanduser()
    if model and any((model / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return model.resolve()
    return None


def _tokenizer_id(cfg: Config) -> str:
    """What determines the tokenizer: its directory, or the settings a BPE is trained with
    (the corpus is in the fingerprint separately); and the family of a model beside which
    transformers builds it otherwise (:func:`raylm.data.tokenizer.load_tokenizer`: a BPE not
    yet trained cannot be tried, so any model directory's)."""
    t, given, model = cfg.tokenizer, given_tokenizer(cfg), cfg.model.path
    base = str(given) if given else f"bpe:{t.vocab_size}:{t.min_frequency}:{t.train_chars}"
    config = Path(model or "", "config.json")
    if not model or not config.is_file() or (given and Path(given, "config.json").is_file()):
        return base
    if given and load_backend(given, model)[0].to_str() == load_backend(given)[0].to_str():
        return base
    return f"{base}:beside:{json.loads(config.read_text()).get('model_type')}"


def prepared_fingerprint(corpus_fp: str, cfg: Config, *, blocks_only: bool = False) -> str:
    """Names the cached preparation and is the manifest's ``fingerprint``. ``blocks_only``:
    without what a prompt set's blocks keep beside their tokens (``prompt_rows``: each
    prompt's data row, since raylm stopped reading the sources at training time), so equal
    for two preparations whose blocks hold the same samples: a run's identity
    (``data_identity``), and the name of a prompt set's cache before it kept its rows."""
    d = cfg.data
    tokenizer_id = _tokenizer_id(cfg)
    examples = {}
    if d.examples:
        # render=2: a template's assistant turn is trained up to its end-of-turn token.
        examples = dict(**example_fields(cfg), loss_on=d.trains_on,
                        long_examples=d.long_examples, render=2)
        if (version := template_version(run_dir(cfg))) != 1:  # 1's fingerprints kept
            examples["default_template"] = version
        if d.format == "prompt" and not blocks_only:
            examples["prompt_rows"] = 1
    return tokenizer_fingerprint(
        corpus_fp, tokenizer=tokenizer_id, seq_len=d.seq_len, min_chars=d.min_chars,
        dedup=d.dedup, val_fraction=d.val_fraction, text_field=d.text_field,
        text_unit=d.text_unit, rows_per_row_group=d.rows_per_row_group,
        # format=4: special tokens' strings in text are text; control_text rows dropped. (The
        # record size limit, MAX_RECORD_BYTES, changes no corpus with records below 64 MiB, so
        # it keeps the format: a run's resume does not see its data as changed.)
        piece_mb=d.piece_mb, format=4, **examples,
    )


def template_version(run: str) -> int:
    """The version of raylm's default chat template (:class:`raylm.data.chat.DefaultTemplate`)
    the run directory ``run`` renders with: the one its ``run.json`` names (1 where it names
    none: a run started before version 2), the newest for a run not started yet. A run keeps
    the template it started with."""
    info = storage.join(run, RUN_INFO)
    if not storage.is_file(info):
        return DEFAULT_VERSION
    version = RunInfo.from_json(storage.read_text(info)).default_template
    if version not in (1, DEFAULT_VERSION):
        raise ValueError(f"{info}: default_template={version!r} is no version raylm renders "
                         f"(1 or {DEFAULT_VERSION}); it is not a run raylm started.")
    return version


def string_prompts(run: str) -> str:
    """How the run directory ``run`` renders a prompt given as a string
    (:data:`raylm.contracts.STRING_PROMPTS`): as its ``run.json`` says (``user_turn`` where it
    says nothing: a run started before the rule), ``as_written`` for a run not started yet."""
    info = storage.join(run, RUN_INFO)
    if not storage.is_file(info):
        return "as_written"
    return RunInfo.from_json(storage.read_text(info)).string_prompts


def resolve_tokenizer(cfg: Config, files: list[SourceFile], corpus_fp: str, log) -> Path:
    t = cfg.tokenizer
    given = given_tokenizer(cfg)
    if given is not None:
        load_backend(given, cfg.model.path)  # fail now, with the tokenizer's own message
        return given
    return build_tokenizer(
        files, corpus_fingerprint=corpus_fp, cache_dir=cache_dir(cfg),
        vocab_size=t.vocab_size, min_frequency=t.min_frequency, train_chars=t.train_chars,
        text_field=cfg.data.text_field, text_unit=cfg.data.text_unit,
        examples=example_fields(cfg), log=log,
    )


def example_fields(cfg: Config) -> dict[str, str] | None:
    """How fine-tuning examples are read (:func:`raylm.data.corpus.read_examples`); None for
    text. Each key is part of the preparation's fingerprint, so a run started before a key
    existed reads without it, as it did."""
    d = cfg.data
    if not d.examples:
        return None
    fields = dict(example_format=d.format, messages_field=d.messages_field,
                  prompt_field=d.prompt_field, completion_field=d.completion_field)
    if d.format == "preference":  # only here: the other formats' fingerprints stay as they were
        fields |= dict(chosen_field=d.chosen_field, rejected_field=d.rejected_field)
    if d.format != "chat" and (rule := string_prompts(run_dir(cfg))) != "user_turn":
        fields |= dict(strings=rule)
    return fields


def _as_list(refs, n: int) -> list:
    """A task's returns as a list (``num_returns=1`` gives one ref, not a list of one)."""
    return list(refs) if n > 1 else [refs]


def _get(ref):
    """``ray.get``, with a task's own input error raised as itself (the CLI prints it as one
    line) instead of wrapped in Ray's task error."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, (BadRecordError, SourceError)):
            raise e.cause from None
        raise


def prepare(cfg: Config, output: str | os.PathLike, *, log: Callable[[str], None] = print,
            shared: bool = False) -> dict[str, Any]:
    """Run the pipeline once; write ``output/{train,val}/*.parquet``, ``layout.json`` and
    ``manifest.json``. The directory is built beside ``output`` and renamed into place when
    complete (:mod:`raylm.outputs`): an ``output`` that holds a source file, or files raylm
    did not write, is refused before anything is read. ``shared``: ``output`` is a cache entry
    other preparations of the same data may fill at the same time; the first to finish is
    kept. Needs ``ray.init``."""
    d = cfg.data
    files = resolve_sources(d.source, builtin_packages=d.builtin_packages, hf_split=d.hf_split)
    out = check_output(output, what="--output", marker=PREPARED_MANIFEST, key="fingerprint",
                       inputs=[("the source file", f.path) for f in files])
    if d.examples:
        check_example_files(files, d.format)
    with building(out) as tmp:
        manifest = _prepare_into(tmp, cfg, files, log=log)
    if not publish(tmp, out, same=shared, mine=(PREPARED_MANIFEST, "fingerprint")):
        log(f"data: {out} was prepared meanwhile by another run; using it")
        return json.loads((out / PREPARED_MANIFEST).read_text())
    return manifest


def _prepare_into(out: Path, cfg: Config, files: list[SourceFile], *,
                  log: Callable[[str], None]) -> dict[str, Any]:
    """The pipeline, writing into the new, empty directory ``out``."""
    import ray

    d = cfg.data
    corpus_fp = fingerprint_files(files)
    tok_path = resolve_tokenizer(cfg, files, corpus_fp, log)
    backend, eos = load_backend(tok_path, cfg.model.path)
    fp = prepared_fingerprint(corpus_fp, cfg)
    L = d.seq_len + 1
    sizes = [os.path.getsize(f.path) for f in files]
    starts = plan_pieces(sizes, piece_bytes(sizes, d.piece_mb))
    n = len(starts)
    log(f"prepare: {len(files)} files in {n} pieces, tokenizer {tok_path}, blocks of {L} "
        f"tokens")
    t0 = time.monotonic()
    reading = Reading(d.text_field, d.text_unit, d.min_chars, example_fields(cfg))
    # SPREAD: the pieces' reads and writes go to every node (or every data node, with
    # scaling.data_resources), not first to the driver's.
    options = dict(resources=dict(cfg.scaling.data_resources) or None,
                   scheduling_strategy="SPREAD")
    duplicates: list[list] = [[] for _ in range(n)]
    if d.dedup:
        P = min(n, MAX_PARTITIONS)
        hash_task = ray.remote(hash_piece).options(num_returns=P, **options)
        parts = [_as_list(hash_task.remote(_piece_files(files, starts, i), reading, P), P)
                 for i in range(n)]
        dedup_task = ray.remote(find_duplicates).options(num_returns=n, **options)
        for p in range(P):
            verdicts = _as_list(dedup_task.remote(starts, *(parts[i][p] for i in range(n))), n)
            for i in range(n):
                duplicates[i].append(verdicts[i])
        del parts  # the partition tasks hold what they need
    render = None
    if d.examples:
        render = dict(**example_fields(cfg), chat_template=chat_template(tok_path),
                      loss_on=d.trains_on, block_length=L, long_examples=d.long_examples,
                      default_template=template_version(run_dir(cfg)))
    pack_task = ray.remote(pack_piece).options(**options)
    settings = dict(reading=reading, out=str(out), tokenizer_json=ray.put(backend.to_str()),
                    eos_id=eos, block_length=L, group_rows=d.rows_per_row_group,
                    chunk_rows=d.tokenize_batch_size, val_fraction=d.val_fraction,
                    on_bad_record=d.on_bad_record, bad_records_listed=d.max_bad_records_listed,
                    render=render)
    results = _run_pieces(
        lambda i: pack_task.remote(i, _piece_files(files, starts, i), *duplicates[i],
                                   **settings),
        n, limit=d.tokenize_concurrency, log=log, t0=t0)
    return _finish(out, results, cfg=cfg, eos=eos, tok_path=tok_path, fp=fp,
                   identity=prepared_fingerprint(corpus_fp, cfg, blocks_only=True), log=log,
                   t0=t0, sources=[str(f.path) for f in files])


def _run_pieces(submit: Callable[[int], Any], n: int, *, limit: int,
                log: Callable[[str], None], t0: float) -> list[PieceResult]:
    """Run the ``n`` piece tasks, at most ``limit`` at a time (0: all submitted, Ray runs as
    many as the cluster has CPUs), logging progress; the results in piece order. A piece's
    error is raised once every piece before it is done, so the first bad record in (file,
    record) order is the one reported, however the tasks were scheduled."""
    import ray

    refs: list = []
    running: list = []
    last_log = time.monotonic()
    while len(refs) < n or running:
        while len(refs) < n and (not limit or len(running) < limit):
            refs.append(submit(len(refs)))
            running.append(refs[-1])
        _, running = ray.wait(running, num_returns=1, timeout=5.0, fetch_local=False)
        if time.monotonic() - last_log >= 5 and running:
            last_log = time.monotonic()
            log(f"prepare: {len(refs) - len(running)}/{n} pieces packed "
                f"({last_log - t0:.0f} s)")
    return [_get(r) for r in refs]


def _write(writer: BlockWriter, packed: tuple, rows: dict[int, str] | None = None) -> None:
    """A packer's output into ``writer``: (blocks, starts, sources) from
    :class:`~raylm.data.packing.Packer`, (blocks, starts, masks, sources) from
    :class:`~raylm.data.packing.ExamplePacker`; ``rows``: prompts' rows by source key, each
    taken by its block (one prompt a block, its first segment)."""
    if len(packed) == 3:
        blocks, starts, sources = packed
        writer.add(blocks, starts, sources)
    else:
        blocks, starts, masks, sources = packed
        writer.add(blocks, starts, sources, masks,
                   None if rows is None else [rows.pop(int(s[0])) for s in sources])


def _pack_tails(out: Path, results: list[PieceResult], *, block_length: int,
                group_rows: int) -> dict[str, dict[str, Any]]:
    """Pack the pieces' tails (each under a block per split), in piece order, into the blocks
    of one last piece: the whole corpus then drops under one block per split, as one
    sequential packing would. Their size is bounded by the number of pieces."""
    packed = {}
    for s in SPLITS:
        writer = BlockWriter(out / s, block_length=block_length, group_rows=group_rows,
                             prefix=f"part-{len(results):05d}")
        packer = Packer(block_length)
        for r in results:
            _write(writer, packer.add_stream(*r.splits[s]["tail"]))
        writer.close()
        packed[s] = {"files": writer.files, "row_group_sizes": writer.group_sizes,
                     "file_groups": writer.file_groups,
                     "blocks": packer.blocks_out, "tail_tokens": packer.tail_tokens}
    return packed


def _finish(out: Path, results: list[PieceResult], *, cfg: Config, eos: int, tok_path: Path,
            fp: str, identity: str, log: Callable[[str], None], t0: float, sources: list[str]
            ) -> dict[str, Any]:
    """Sum the pieces' counts, pack their tails, check the invariants, write layout.json (with
    the corpus files by index: ``sources``) and manifest.json."""
    d = cfg.data
    L = d.seq_len + 1
    tails = (None if d.examples else
             _pack_tails(out, results, block_length=L, group_rows=d.rows_per_row_group))
    dropped = dict.fromkeys(DROP_REASONS + (EXAMPLE_DROP_REASONS if d.examples else ()), 0)
    bad_records: list[dict[str, Any]] = []
    for r in results:
        for k, v in r.dropped.items():
            dropped[k] += v
        bad_records.extend(r.bad_records[:d.max_bad_records_listed - len(bad_records)])
    read = sum(r.read for r in results)
    kept = sum(r.kept for r in results)

    def total(split: str | None, key: str) -> int:
        splits = [s for s in SPLITS if split in (None, s)]
        if key == "tail_tokens":  # only the last piece's are dropped
            return sum(tails[s][key] for s in splits) if tails is not None else 0
        n = sum(r.splits[s][key] for r in results for s in splits)
        if tails is not None and key == "blocks":
            n += sum(tails[s][key] for s in splits)
        return n

    def listed(split: str, key: str) -> list:
        last = tails[split][key] if tails is not None else []
        return [x for r in results for x in r.splits[split][key]] + last

    tokens, blocks = total(None, "tokens"), total(None, "blocks")
    tail, padding = total(None, "tail_tokens"), total(None, "padding_tokens")
    assert tokens + padding == blocks * L + tail and read == kept + sum(dropped.values())
    if d.examples and not total("train", "blocks"):
        raise ValueError(f"no fine-tuning example of {d.source!r} was kept (dropped: "
                         f"{ {k: v for k, v in dropped.items() if v} }); check data.format "
                         f"and its fields, or data.seq_len for too_long.")
    manifest = {"documents_read": read, "documents_kept": kept, "dropped": dropped,
                "bad_records": bad_records, "tokens": tokens, "block_length": L,
                "blocks": blocks, "tail_tokens_dropped": tail, "pieces": len(results),
                "tokenizer_path": str(tok_path), "fingerprint": fp,
                "data_identity": identity}
    if d.examples:
        manifest.update({
            "format": d.format, "loss_on": d.trains_on,
            "trained_tokens": total(None, "trained_tokens"),
            "padding_tokens": padding, "truncated": sum(r.truncated for r in results)})
    if d.format != "chat" and d.examples:
        written = manifest["prompts_as_written"] = sum(r.as_written for r in results)
        if 0 < written < kept:
            log(f"data: warning: {written:,} of {kept:,} {d.format} rows give the prompt as a "
                f"string, used as written with no chat template, and {kept - written:,} as "
                f"messages, rendered with it: the model sees two renderings. Give every row "
                f"one form (docs/data.md, 'Strings and messages').")
    layout = {
        "block_length": L, "eos_id": eos, "seq_len": d.seq_len, "loss_mask": d.examples,
        "sources": sources, "prompt_rows": d.format == "prompt",
        "splits": {s: {"blocks": total(s, "blocks"),
                       "tail_tokens_dropped": total(s, "tail_tokens"),
                       "files": listed(s, "files"),
                       "row_group_sizes": listed(s, "row_group_sizes"),
                       "file_groups": listed(s, "file_groups")}
                   for s in SPLITS},
    }
    (out / LAYOUT).write_text(json.dumps(layout))
    nodes = len({r.node for r in results})
    (out / PREPARED_MANIFEST).write_text(json.dumps(manifest, indent=2))
    log(f"prepare: done in {time.monotonic() - t0:.1f}s: {read:,} read, {kept:,} kept, "
        f"dropped { {k: v for k, v in dropped.items() if v} }, {tokens:,} tokens -> "
        f"{blocks:,} blocks (train {total('train', 'blocks'):,}, val {total('val', 'blocks'):,}),"
        f" {tail:,} tail tokens dropped; {len(results)} pieces packed on {nodes} "
        f"node{'s' if nodes > 1 else ''}")
    return manifest


def check_example_files(files: list[SourceFile], example_format: str) -> None:
    """Fine-tuning examples are rows with fields: text files cannot hold them."""
    other = [f for f in files if f.format not in EXAMPLE_FORMATS]
    if other:
        raise SourceError(f"data.format={example_format} reads examples from JSONL, Parquet, "
                          f"Arrow or saved datasets; {other[0].path} is {other[0].format} "
                          f"({len(other)} such files in data.source).")


def cached_prepared_dir(cfg: Config, files: list | None = None) -> Path:
    """Where the cache keeps (or will keep) the preparation of ``cfg``'s data sources
    (``files``, when the caller resolved them already): a folder named by the corpus's
    content and the preparation settings."""
    d = cfg.data
    if files is None:
        files = resolve_sources(d.source, builtin_packages=d.builtin_packages,
                                hf_split=d.hf_split)
    return cache_dir(cfg) / "prepared" / prepared_fingerprint(fingerprint_files(files), cfg)


def prepared_dir(cfg: Config, *, log: Callable[[str], None] = print) -> Path:
    """The packed data for ``cfg``: ``data.source`` itself when it is a prepared directory,
    else a cached preparation (made now if missing). Needs ``ray.init``."""
    d = cfg.data
    if is_prepared_dir(d.source):
        path = Path(str(d.source)).expanduser().resolve()
        layout = json.loads((path / LAYOUT).read_text())
        if any("file_groups" not in info for info in layout["splits"].values()):
            raise ValueError(f"the prepared directory {path} was written by an earlier raylm "
                             f"(its {LAYOUT} does not say which row groups each file holds); "
                             f"prepare it again with `raylm prepare`.")
        if layout["seq_len"] != d.seq_len:
            raise ValueError(f"data.seq_len={d.seq_len} but the prepared directory {path} "
                             f"holds blocks for seq_len={layout['seq_len']}; set data.seq_len="
                             f"{layout['seq_len']} or prepare again.")
        if d.format == "prompt" and not layout.get("prompt_rows"):
            raise ValueError(f"the prepared directory {path} was written by an earlier raylm: "
                             f"its prompts do not keep their rows, which their reward reads "
                             f"(that raylm read them from the source files at training time); "
                             f"prepare it again with `raylm prepare`.")
        return path
    files = resolve_sources(d.source, builtin_packages=d.builtin_packages, hf_split=d.hf_split)
    corpus_fp = fingerprint_files(files)
    target = cache_dir(cfg) / "prepared" / prepared_fingerprint(corpus_fp, cfg)
    if (target / PREPARED_MANIFEST).is_file():
        log(f"data: reusing prepared data {target}")
        return target
    if d.format == "prompt":
        earlier = target.parent / prepared_fingerprint(corpus_fp, cfg, blocks_only=True)
        if (earlier / PREPARED_MANIFEST).is_file():
            log(f"data: preparing these prompts again: their blocks now keep each prompt's row "
                f"(the columns its reward reads), where the preparation {earlier} left them in "
                f"the source files; the samples and their order are the same")
    prepare(cfg, target, log=log, shared=True)
    return target
