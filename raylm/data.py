"""The Ray Data pipeline: raw text -> packed blocks on disk -> ordered per-worker streams.

Preparation (``prepare``) runs once per corpus and settings::

    files --read (tasks)--> records --tokenize (actor pool)--> ids --driver--> dedup, split, pack
                                                                         --> Parquet + manifest

Reading and tokenizing are the expensive, parallel part and run as Ray Data tasks and actors,
sized to the cluster. Deduplication, the train/validation split and packing stay on the driver,
consuming the tokenized stream in file order (``preserve_order``): packing is inherently
sequential (a block may hold the end of one document and the start of the next), and a fixed
order is what makes the output, and so every later run, reproducible. The driver keeps one 8-byte
hash per unique document (a Python set: ~70 bytes each, 70 MB for a million documents) and less
than one row group of blocks; all else streams.

Fine-tuning examples (``data.format`` chat or prompt_completion) take the same path: the tasks
read them as checked JSON, render and tokenize them with their loss mask (:mod:`raylm.chat`,
:class:`ExampleRenderer`), and the driver packs them whole (:class:`raylm.packing.
ExamplePacker`); their blocks carry a ``loss_mask`` column, which the readers pass on.

Training (``build_train_stream``) never uses ``streaming_split``: it hands out blocks to
whichever worker asks first, so two runs see different orders (measured: two runs of
``streaming_split(2, equal=True)`` over 2,000 rows gave each rank a different sequence). Instead
each worker builds its own Ray Data stream of exactly the positions it owns in the global order
(:mod:`raylm.packing`), read from the packed Parquet, starting at the step its restored
checkpoint holds. No Ray Train ``DataConfig`` is involved: it runs before the workers load the
checkpoint, so it would have to guess the resume point. Every rank reads the row groups of the
current shuffle window and keeps its own rows, so storage reads scale with the worker count (for
token data that is ~4 bytes per token per worker per epoch, small next to a training step).
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raylm.config import Config, cache_dir
from raylm.corpus import (
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
from raylm.packing import (
    ExamplePacker,
    Packer,
    SampleOrder,
    position_ids,
    rank_positions,
    rank_share,
)
from raylm.tokenizer import build_tokenizer, chat_template, load_backend, tokenizer_fingerprint

LAYOUT = "layout.json"
SPLITS = ("train", "val")
# 64 row groups per file: with 256-block row groups, 16,384 blocks (~17 MB at seq_len 256).
ROW_GROUPS_PER_FILE = 64


class BadRecordError(ValueError):
    """A bad record under ``data.on_bad_record: error``."""


# --------------------------------------------------------------------------------------------
# Preparation: the Ray Data stages
# --------------------------------------------------------------------------------------------

_RECORD_SCHEMA = pa.schema([
    ("text", pa.string()), ("reason", pa.string()), ("file_id", pa.int32()),
    ("line", pa.int64()), ("hash", pa.uint64()),
])


def _records(files: list[SourceFile], *, text_field: str, text_unit: str, min_chars: int,
             chunk_rows: int, examples: dict[str, str] | None = None):
    """Record tables of ``chunk_rows`` rows (the last may be short) read from ``files``;
    fine-tuning examples when ``examples`` gives their format and fields."""
    cols: dict[str, list] = {name: [] for name in _RECORD_SCHEMA.names}
    for spec, file_id in files:
        records = (read_examples(spec, **examples) if examples else
                   read_records(spec, text_field=text_field, text_unit=text_unit,
                                min_chars=min_chars))
        for rec in records:
            cols["text"].append(rec.text)
            cols["reason"].append(rec.reason)
            cols["file_id"].append(file_id)
            cols["line"].append(rec.line)
            cols["hash"].append(content_hash(rec.text) if rec.text is not None else 0)
            if len(cols["text"]) >= chunk_rows:
                yield pa.table(cols, schema=_RECORD_SCHEMA)
                cols = {name: [] for name in _RECORD_SCHEMA.names}
    if cols["text"]:
        yield pa.table(cols, schema=_RECORD_SCHEMA)


@functools.lru_cache(maxsize=2)
def _tokenizer_from_json(tokenizer_json: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json)


def _read_and_tokenize(batch: dict[str, np.ndarray], *, tokenizer_json: str, eos_id: int,
                       text_field: str, text_unit: str, min_chars: int, batch_size: int,
                       examples: dict[str, Any] | None = None):
    """Ray Data UDF: file specs in; records with token ids (each document + EOS) out.

    Reading and tokenizing share one task: reading is ~5% of the work (JSON parsing and
    hashing, measured on the builtin corpus) and a separate read stage would only move text
    through the object store once more. Tasks rather than an actor pool: tasks run in Ray's
    already started worker processes, while each new actor costs a process start and imports
    (~2.5 s of a 9 s pipeline, measured); the tokenizer is rebuilt from its JSON once per
    worker process and cached.
    """
    tok = _tokenizer_from_json(tokenizer_json)
    files = [(SourceFile(str(p), str(f)), int(i))
             for p, f, i in zip(batch["path"], batch["format"], batch["file_id"], strict=True)]
    if examples:
        render = ExampleRenderer(**examples, tokenizer=tok, eos_id=eos_id)
        fields = {k: examples[k] for k in ("example_format", "messages_field", "prompt_field",
                                           "completion_field")}  # the reading part
        for table in _records(files, text_field=text_field, text_unit=text_unit,
                              min_chars=min_chars, chunk_rows=batch_size, examples=fields):
            yield render(table)
        return
    for table in _records(files, text_field=text_field, text_unit=text_unit,
                          min_chars=min_chars, chunk_rows=batch_size):
        yield _tokenize(tok, eos_id, table)


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
    """Tokenizes fine-tuning examples (:mod:`raylm.chat`): ids and loss mask, with examples
    longer than ``block_length`` dropped (``too_long``) or cut (``truncated``; dropped as
    ``no_trained_tokens`` when no trained target is left)."""

    def __init__(self, *, example_format: str, messages_field: str, prompt_field: str,
                 completion_field: str, chat_template: dict[str, Any] | None, loss_on: str,
                 block_length: int, long_examples: str, tokenizer, eos_id: int) -> None:
        from raylm.chat import DefaultTemplate, JinjaTemplate

        self.format, self.loss_on = example_format, loss_on
        self.template = JinjaTemplate(**chat_template) if chat_template else DefaultTemplate()
        self.block_length, self.long_examples = block_length, long_examples
        self.tok, self.eos_id = tokenizer, eos_id

    def __call__(self, table: pa.Table) -> pa.Table:
        from raylm.chat import conversation_segments, encode, prompt_completion_segments

        texts = table.column("text").to_pylist()
        reasons = table.column("reason").to_pylist()
        ids_out, masks_out, truncated = [], [], []
        for i, text in enumerate(texts):
            ids = mask = np.zeros(0, np.int32)
            cut = False
            if text is not None:
                messages = json.loads(text)
                segments = (prompt_completion_segments(messages)
                            if self.format == "prompt_completion" else
                            conversation_segments(self.template, messages, loss_on=self.loss_on))
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
        return (table.drop_columns(["text", "reason"])
                .append_column("reason", pa.array(reasons, pa.string()))
                .append_column("ids", _list_array(ids_out, pa.int32()))
                .append_column("loss_mask", _list_array(masks_out, pa.uint8()))
                .append_column("truncated", pa.array(truncated, pa.bool_())))


def _list_array(pieces: list[np.ndarray], value_type) -> pa.ListArray:
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = (np.concatenate(pieces) if pieces else np.zeros(0)).astype(value_type.to_pandas_dtype())
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=value_type))


def _cluster_cpus() -> int:
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def build_tokenized_dataset(files: list[SourceFile], cfg: Config, tokenizer_path: str | Path):
    """The lazy Ray Data dataset of tokenized records, in file order."""
    import ray

    backend, eos = load_backend(tokenizer_path)
    d = cfg.data
    cpus = _cluster_cpus()
    # Several read tasks per CPU balance files of very different sizes; more would only add
    # per-task overhead (an 11k-file builtin corpus in 11k tasks is mostly scheduling).
    num_tasks = min(len(files), cpus * 8)
    items = [{"path": f.path, "format": f.format, "file_id": i} for i, f in enumerate(files)]
    ds = ray.data.from_items(items, override_num_blocks=num_tasks)
    ds.context.execution_options.preserve_order = True
    examples = None
    if d.examples:
        examples = dict(**example_fields(d), chat_template=chat_template(tokenizer_path),
                        loss_on=d.trains_on, block_length=d.seq_len + 1,
                        long_examples=d.long_examples)
    return ds.map_batches(
        _read_and_tokenize,
        fn_kwargs=dict(
            tokenizer_json=backend.to_str(), eos_id=eos, text_field=d.text_field,
            text_unit=d.text_unit, min_chars=d.min_chars, batch_size=d.tokenize_batch_size,
            examples=examples),
        batch_size=math.ceil(len(files) / num_tasks),
        compute=ray.data.TaskPoolStrategy(size=d.tokenize_concurrency or None),
        # Custom resources of the data node group (if any): see scaling.data_resources.
        resources=dict(cfg.scaling.data_resources) or None,
    )


# --------------------------------------------------------------------------------------------
# Preparation: the driver side (dedup, split, pack, write)
# --------------------------------------------------------------------------------------------


class BlockWriter:
    """Writes blocks of one split as Parquet, in row groups of exactly ``group_rows`` rows (the
    last may be short) so that row groups are the unit :class:`SampleOrder` permutes."""

    def __init__(self, directory: Path, *, block_length: int, group_rows: int,
                 loss_mask: bool = False) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.block_length = block_length
        self.group_rows = group_rows
        fields = [("input_ids", pa.list_(pa.int32())), ("doc_starts", pa.list_(pa.int32()))]
        if loss_mask:
            fields.append(("loss_mask", pa.list_(pa.uint8())))
        self.schema = pa.schema(fields)
        self.loss_mask = loss_mask
        self._blocks: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._starts: list[np.ndarray] = []
        self._pending = 0
        self._writer: pq.ParquetWriter | None = None
        self._groups_in_file = 0
        self.files: list[str] = []
        self.group_sizes: list[int] = []

    def add(self, blocks: np.ndarray, doc_starts: list[np.ndarray],
            masks: np.ndarray | None = None) -> None:
        assert (masks is not None) == self.loss_mask
        if len(blocks):
            self._blocks.append(blocks)
            if masks is not None:
                self._masks.append(masks)
            self._starts.extend(doc_starts)
            self._pending += len(blocks)
        while self._pending >= self.group_rows:
            self._flush(self.group_rows)

    def _flush(self, n: int) -> None:
        stacked = np.concatenate(self._blocks)
        rows, rest = stacked[:n], stacked[n:]
        starts, self._starts = self._starts[:n], self._starts[n:]
        self._blocks = [rest] if len(rest) else []
        columns = []
        if self.loss_mask:
            all_masks = np.concatenate(self._masks)
            mask_rows, mask_rest = all_masks[:n], all_masks[n:]
            self._masks = [mask_rest] if len(mask_rest) else []
            m_off = pa.array(np.arange(n + 1, dtype=np.int32) * self.block_length)
            columns.append(pa.ListArray.from_arrays(m_off, pa.array(mask_rows.reshape(-1),
                                                                     type=pa.uint8())))
        self._pending -= n
        if self._writer is None or self._groups_in_file >= ROW_GROUPS_PER_FILE:
            self._open()
        offsets = pa.array(np.arange(n + 1, dtype=np.int32) * self.block_length)
        ids = pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1)))
        lens = np.fromiter((len(s) for s in starts), dtype=np.int32, count=n)
        s_off = pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        flat = np.concatenate(starts).astype(np.int32) if starts else np.zeros(0, np.int32)
        doc = pa.ListArray.from_arrays(s_off, pa.array(flat, type=pa.int32()))
        self._writer.write_table(pa.table([ids, doc, *columns], schema=self.schema),
                                 row_group_size=n)
        self._groups_in_file += 1
        self.group_sizes.append(n)

    def _open(self) -> None:
        if self._writer is not None:
            self._writer.close()
        name = f"part-{len(self.files):05d}.parquet"
        self.files.append(name)
        self._writer = pq.ParquetWriter(self.dir / name, self.schema)
        self._groups_in_file = 0

    def close(self) -> None:
        if self._pending:
            self._flush(self._pending)
        if self._writer is not None:
            self._writer.close()


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
    (the corpus is in the fingerprint separately)."""
    t = cfg.tokenizer
    given = given_tokenizer(cfg)
    if given is not None:
        return str(given)
    return f"bpe:{t.vocab_size}:{t.min_frequency}:{t.train_chars}"


def prepared_fingerprint(corpus_fp: str, cfg: Config) -> str:
    """Names the cached preparation and is the manifest's ``fingerprint``."""
    d = cfg.data
    tokenizer_id = _tokenizer_id(cfg)
    examples = {}
    if d.examples:
        examples = dict(**example_fields(d), loss_on=d.trains_on,
                        long_examples=d.long_examples)
    return tokenizer_fingerprint(
        corpus_fp, tokenizer=tokenizer_id, seq_len=d.seq_len, min_chars=d.min_chars,
        dedup=d.dedup, val_fraction=d.val_fraction, text_field=d.text_field,
        text_unit=d.text_unit, rows_per_row_group=d.rows_per_row_group, format=1, **examples,
    )


def resolve_tokenizer(cfg: Config, files: list[SourceFile], corpus_fp: str, log) -> Path:
    t = cfg.tokenizer
    given = given_tokenizer(cfg)
    if given is not None:
        load_backend(given)  # fail now, on the driver, with the tokenizer's own message
        return given
    return build_tokenizer(
        files, corpus_fingerprint=corpus_fp, cache_dir=cache_dir(cfg),
        vocab_size=t.vocab_size, min_frequency=t.min_frequency, train_chars=t.train_chars,
        text_field=cfg.data.text_field, text_unit=cfg.data.text_unit,
        examples=example_fields(cfg.data), log=log,
    )


def example_fields(d) -> dict[str, str] | None:
    """How fine-tuning examples are read (:func:`raylm.corpus.read_examples`); None for text."""
    if not d.examples:
        return None
    return dict(example_format=d.format, messages_field=d.messages_field,
                prompt_field=d.prompt_field, completion_field=d.completion_field)


def prepare(cfg: Config, output: str | os.PathLike, *, log: Callable[[str], None] = print
            ) -> dict[str, Any]:
    """Run the pipeline once; write ``output/{train,val}/*.parquet``, ``layout.json`` and
    ``manifest.json`` (last, so a directory with a manifest is complete). Needs ``ray.init``."""
    d = cfg.data
    out = Path(output).expanduser().resolve()
    ours = {PREPARED_MANIFEST, LAYOUT, *SPLITS, f".{PREPARED_MANIFEST}.tmp"}
    if out.exists() and any(p.name not in ours for p in out.iterdir()):
        raise ValueError(f"--output {out} holds files raylm did not write; choose a new or "
                         f"empty directory (an earlier `raylm prepare` output is replaced).")
    files = resolve_sources(d.source, builtin_packages=d.builtin_packages, hf_split=d.hf_split)
    if d.examples:
        check_example_files(files, d.format)
    corpus_fp = fingerprint_files(files)
    tok_path = resolve_tokenizer(cfg, files, corpus_fp, log)
    _, eos = load_backend(tok_path)
    fp = prepared_fingerprint(corpus_fp, cfg)

    for name in (PREPARED_MANIFEST, LAYOUT, *SPLITS):
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    L = d.seq_len + 1
    writers = {s: BlockWriter(out / s, block_length=L, group_rows=d.rows_per_row_group,
                              loss_mask=d.examples) for s in SPLITS}
    packers = {s: ExamplePacker(L, pad_id=eos) if d.examples else Packer(L) for s in SPLITS}
    val_cut = int(d.val_fraction * 2**64)

    read = kept = truncated = 0
    dropped = dict.fromkeys(DROP_REASONS + (EXAMPLE_DROP_REASONS if d.examples else ()), 0)
    bad_records: list[dict[str, Any]] = []
    seen: set[int] = set()
    t0 = last_log = time.monotonic()
    log(f"prepare: {len(files)} files, tokenizer {tok_path}, blocks of {L} tokens")
    ds = build_tokenized_dataset(files, cfg, tok_path)
    for table in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        reasons = table.column("reason").to_pylist()
        hashes = table.column("hash").to_numpy()
        lines = table.column("line").to_numpy()
        file_ids = table.column("file_id").to_numpy()
        ids = table.column("ids").combine_chunks()
        flat, offsets = ids.values.to_numpy(), ids.offsets.to_numpy()
        if d.examples:
            mask_list = table.column("loss_mask").combine_chunks()
            masks, mask_offsets = mask_list.values.to_numpy(), mask_list.offsets.to_numpy()
            cut = table.column("truncated").to_numpy(zero_copy_only=False)
        docs: dict[str, list] = {s: [] for s in SPLITS}
        for i, reason in enumerate(reasons):
            read += 1
            if reason is None and d.dedup:
                h = int(hashes[i])
                if h in seen:
                    reason = "duplicate"
                else:
                    seen.add(h)
            if reason is not None:
                dropped[reason] += 1
                if is_bad(reason, int(lines[i])):
                    where = {"file": files[file_ids[i]].path, "line": int(lines[i]),
                             "reason": reason}
                    if d.on_bad_record == "error":
                        raise BadRecordError(
                            f"{where['file']}:{where['line']}: {reason} record. "
                            f"Fix the input, or set data.on_bad_record=skip to drop and count "
                            f"such records."
                        )
                    if len(bad_records) < d.max_bad_records_listed:
                        bad_records.append(where)
                continue
            kept += 1
            split = "val" if int(hashes[i]) < val_cut else "train"
            doc = flat[offsets[i]:offsets[i + 1]]
            if d.examples:
                truncated += int(cut[i])
                doc = (doc, masks[mask_offsets[i]:mask_offsets[i + 1]])
            docs[split].append(doc)
        for s in SPLITS:
            if docs[s]:
                writers[s].add(*packers[s].add(docs[s]))
        now = time.monotonic()
        if now - last_log >= 5:
            last_log = now
            tokens = sum(p.tokens_in for p in packers.values())
            log(f"prepare: {read:,} documents read, {kept:,} kept, {tokens:,} tokens, "
                f"{sum(p.blocks_out for p in packers.values()):,} blocks "
                f"({tokens / (now - t0):,.0f} tokens/s)")
    if d.examples:
        for s in SPLITS:
            writers[s].add(*packers[s].finish())
    for w in writers.values():
        w.close()

    tokens = sum(p.tokens_in for p in packers.values())
    blocks = sum(p.blocks_out for p in packers.values())
    tail = 0 if d.examples else sum(p.tail_tokens for p in packers.values())
    padding = sum(p.padding_tokens for p in packers.values()) if d.examples else 0
    assert tokens + padding == blocks * L + tail and read == kept + sum(dropped.values())
    if d.examples and not packers["train"].blocks_out:
        raise ValueError(f"no fine-tuning example of {d.source!r} was kept (dropped: "
                         f"{ {k: v for k, v in dropped.items() if v} }); check data.format "
                         f"and its fields, or data.seq_len for too_long.")
    manifest = {
        "documents_read": read,
        "documents_kept": kept,
        "dropped": dropped,
        "bad_records": bad_records,
        "tokens": tokens,
        "block_length": L,
        "blocks": blocks,
        "tail_tokens_dropped": tail,
        "tokenizer_path": str(tok_path),
        "fingerprint": fp,
    }
    if d.examples:
        manifest.update({
            "format": d.format, "loss_on": d.trains_on,
            "trained_tokens": sum(p.trained_tokens for p in packers.values()),
            "padding_tokens": padding, "truncated": truncated})
    layout = {
        "block_length": L,
        "eos_id": eos,
        "seq_len": d.seq_len,
        "loss_mask": d.examples,
        "splits": {s: {"blocks": packers[s].blocks_out,
                       "tail_tokens_dropped": packers[s].tail_tokens,
                       "files": writers[s].files,
                       "row_group_sizes": writers[s].group_sizes} for s in SPLITS},
    }
    (out / LAYOUT).write_text(json.dumps(layout))
    tmp = out / f".{PREPARED_MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / PREPARED_MANIFEST)
    elapsed = time.monotonic() - t0
    log(f"prepare: done in {elapsed:.1f}s: {read:,} read, {kept:,} kept, dropped "
        f"{ {k: v for k, v in dropped.items() if v} }, {tokens:,} tokens -> {blocks:,} blocks "
        f"(train {packers['train'].blocks_out:,}, val {packers['val'].blocks_out:,}), "
        f"{tail:,} tail tokens dropped")
    return manifest


def check_example_files(files: list[SourceFile], example_format: str) -> None:
    """Fine-tuning examples are rows with fields: text files cannot hold them."""
    other = [f for f in files if f.format not in EXAMPLE_FORMATS]
    if other:
        raise SourceError(f"data.format={example_format} reads examples from JSONL, Parquet, "
                          f"Arrow or saved datasets; {other[0].path} is {other[0].format} "
                          f"({len(other)} such files in data.source).")


def prepared_dir(cfg: Config, *, log: Callable[[str], None] = print) -> Path:
    """The packed data for ``cfg``: ``data.source`` itself when it is a prepared directory,
    else a cached preparation (made now if missing). Needs ``ray.init``."""
    d = cfg.data
    if is_prepared_dir(d.source):
        path = Path(str(d.source)).expanduser().resolve()
        layout = json.loads((path / LAYOUT).read_text())
        if layout["seq_len"] != d.seq_len:
            raise ValueError(f"data.seq_len={d.seq_len} but the prepared directory {path} "
                             f"holds blocks for seq_len={layout['seq_len']}; set data.seq_len="
                             f"{layout['seq_len']} or prepare again.")
        return path
    files = resolve_sources(d.source, builtin_packages=d.builtin_packages, hf_split=d.hf_split)
    corpus_fp = fingerprint_files(files)
    target = cache_dir(cfg) / "prepared" / prepared_fingerprint(corpus_fp, cfg)
    if (target / PREPARED_MANIFEST).is_file():
        log(f"data: reusing prepared data {target}")
        return target
    prepare(cfg, target, log=log)
    return target


# --------------------------------------------------------------------------------------------
# Training side: one ordered stream per worker
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedSplit:
    """Where one split's blocks are stored: files and row groups in storage order."""

    directory: str
    files: list[str]
    row_group_sizes: list[int]
    block_length: int
    loss_mask: bool = False
    """Blocks of fine-tuning examples carry a loss mask (1: a trained target)."""

    @classmethod
    def load(cls, prepared: str | os.PathLike, split: str) -> "PackedSplit":
        root = Path(prepared)
        layout = json.loads((root / LAYOUT).read_text())
        info = layout["splits"][split]
        if not info["blocks"]:
            raise ValueError(f"The prepared data in {root} has no {split} blocks; use a larger "
                             f"corpus, a smaller data.seq_len, or a larger data.val_fraction.")
        return cls(str(root / split), info["files"], info["row_group_sizes"],
                   layout["block_length"], layout.get("loss_mask", False))

    @property
    def num_blocks(self) -> int:
        return sum(self.row_group_sizes)

    def group_locations(self) -> list[tuple[str, int]]:
        """(file path, row group index in file) for every row group, in storage order."""
        out = []
        for name in self.files:
            n = pq.ParquetFile(os.path.join(self.directory, name)).num_row_groups
            out.extend((os.path.join(self.directory, name), g) for g in range(n))
        assert len(out) == len(self.row_group_sizes)
        return out


class _ReadBlocks:
    """A rank's local sample indices in, its blocks out (in order): the map function of each
    training stream's Ray Data actor, and called directly for the validation blocks."""

    def __init__(self, split: PackedSplit, *, mode: str, seed: int, window: int, rank: int,
                 world_size: int, start_step: int = 0, global_batch: int = 1) -> None:
        self.split = split
        self.mode, self.rank, self.world = mode, rank, world_size
        self.start_step, self.global_batch = start_step, global_batch
        self.order = SampleOrder(split.row_group_sizes, seed=seed, window=window)
        self.locations = split.group_locations()
        self.cache: OrderedDict[int, tuple[np.ndarray, list, np.ndarray | None]] = OrderedDict()
        self.cache_size = window + 1

    def _group(self, g: int) -> tuple[np.ndarray, list, np.ndarray | None]:
        if g not in self.cache:
            path, idx = self.locations[g]
            t = pq.ParquetFile(path).read_row_group(idx)
            L = self.split.block_length
            tokens = t.column("input_ids").combine_chunks().values.to_numpy().reshape(-1, L)
            masks = None
            if self.split.loss_mask:
                masks = t.column("loss_mask").combine_chunks().values.to_numpy().reshape(-1, L)
            self.cache[g] = (tokens, t.column("doc_starts").to_pylist(), masks)
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        self.cache.move_to_end(g)
        return self.cache[g]

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        local = batch["id"]
        if self.mode == "train":
            positions = rank_positions(local, start_step=self.start_step,
                                       global_batch=self.global_batch, rank=self.rank,
                                       world_size=self.world)
            rows = self.order.rows(positions)
        else:  # evaluation: storage order, round robin over ranks
            positions = local * self.world + self.rank
            rows = positions
        groups = np.searchsorted(self.order.group_offsets, rows, side="right") - 1
        L = self.split.block_length
        tokens = np.empty((len(rows), L), dtype=np.int64)
        pos_ids = np.empty((len(rows), L), dtype=np.int64)
        masks = np.empty((len(rows), L), dtype=np.uint8) if self.split.loss_mask else None
        for i, (row, g) in enumerate(zip(rows, groups, strict=True)):
            block, starts, mask = self._group(int(g))
            r = int(row - self.order.group_offsets[g])
            tokens[i] = block[r]
            pos_ids[i] = position_ids(np.asarray(starts[r]), L)
            if masks is not None:
                masks[i] = mask[r]
        out = {"input_ids": tokens, "position_ids": pos_ids, "sample_position": positions,
               "row": rows}
        if masks is not None:
            out["loss_mask"] = masks
        return out


def eval_samples_per_rank(split: PackedSplit, world_size: int, limit: int | None = None) -> int:
    """Equal for all ranks (collectives need it): at most ``limit``, at most N // world."""
    n = split.num_blocks // world_size
    return n if limit is None else min(n, limit)


# Reading a cached row group is cheap next to a training step: a small CPU share lets a reader
# run beside workers that hold most CPUs of their node.
READER_CPUS = 0.1


def build_train_stream(prepared: str | os.PathLike, *, rank: int, world_size: int,
                       start_step: int, num_steps: int, seed: int, window: int,
                       global_batch: int, resources: dict[str, float]):
    """Rank ``rank``'s training stream, built by the worker itself once it has restored its
    train state: the samples of steps ``[start_step, num_steps)`` in the global order, its
    slice of each global batch. Its reader asks for ``resources`` (CPU and custom Ray resources,
    as :func:`raylm.launch.plan_resources` decided)."""
    import ray

    train = PackedSplit.load(prepared, "train")
    num_samples = max(0, num_steps - start_step) * rank_share(global_batch, world_size)
    # Sample indices as in-memory blocks of 256. No remote task may be needed to make them:
    # a read, and even from_arrow's metadata task, asks for a whole CPU, which training
    # workers holding every CPU of their node do not leave (the stream then waits forever).
    # from_blocks computes the metadata here. Small blocks keep the stream streaming: an
    # output block is only handed on once its input block is done.
    chunks = [pa.table({"id": np.arange(i, min(i + 256, num_samples), dtype=np.int64)})
              for i in range(0, num_samples, 256)] or [pa.table({"id": np.zeros(0, np.int64)})]
    ds = ray.data.from_blocks(chunks)
    ds.context.execution_options.preserve_order = True
    # One stream per worker, each with its own progress bars, would bury the training log.
    ds.context.enable_progress_bars = False
    return ds.map_batches(
        _ReadBlocks,
        fn_constructor_kwargs=dict(split=train, mode="train", seed=seed, window=window,
                                   rank=rank, world_size=world_size, start_step=start_step,
                                   global_batch=global_batch),
        batch_size=64,
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=resources.get("CPU", 0.0),
        resources={k: v for k, v in resources.items() if k != "CPU"} or None,
    )


def read_val_blocks(prepared: str | os.PathLike, *, rank: int, world_size: int,
                    eval_samples: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s validation blocks, read in this process: up to ``eval_samples`` (the same
    count on every rank, as collectives need), round robin in storage order. They are few (8 x
    8 blocks of 2,049 tokens, 1 MB, with the defaults) and read once per worker group, where a
    Ray Data stream would start a reader actor for them (about 2 s here)."""
    val = PackedSplit.load(prepared, "val")
    n = eval_samples_per_rank(val, world_size, eval_samples)
    reader = _ReadBlocks(val, mode="eval", seed=0, window=1, rank=rank, world_size=world_size)
    return reader({"id": np.arange(n, dtype=np.int64)})
