"""The training side of the data: packed blocks on disk -> one ordered stream per worker.

Blocks are written once per corpus and settings by :mod:`raylm.data.preparation`, as Parquet files
under ``{train,val}/`` with ``layout.json`` naming the files and row groups in storage order.

Training (``build_train_stream``) never uses ``streaming_split``: it hands out blocks to
whichever worker asks first, so two runs see different orders (measured: two runs of
``streaming_split(2, equal=True)`` over 2,000 rows gave each rank a different sequence). Instead
each worker builds its own Ray Data stream of exactly the positions it owns in the global order
(:mod:`raylm.data.packing`), read from the packed Parquet, starting at the step its restored
checkpoint holds. No Ray Train ``DataConfig`` is involved: it runs before the workers load the
checkpoint, so it would have to guess the resume point. The order deals each window's rows out
so that a rank's rows are a contiguous run of the window (see :mod:`raylm.data.packing`): a rank
reads only the row groups that hold its rows, about its own share of the data per epoch
whatever the worker count, and counts the bytes it reads (``_ReadBlocks.bytes_read``).
"""

from __future__ import annotations

import io
import json
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raylm.contracts import LAYOUT, REFERENCE_COLUMN
from raylm.data.packing import (
    SampleOrder,
    Skips,
    position_ids,
    rank_positions,
    rank_share,
    source_of,
)

if TYPE_CHECKING:
    import torch

# Files whose footer metadata a reader keeps (a few KiB each).
METADATA_CACHE_FILES = 1024


# ---- Training side: one ordered stream per worker ------------------------------------------


@dataclass(frozen=True)
class PackedSplit:
    """Where one split's blocks are stored: files and row groups in storage order."""

    directory: str
    files: list[str]
    row_group_sizes: list[int]
    file_groups: list[int]
    """How many of the row groups each file holds."""
    block_length: int
    loss_mask: bool = False
    """Blocks of fine-tuning examples carry a loss mask (1: a trained target)."""
    sources: list[str] | None = None
    """The corpus files by index (None: prepared before blocks kept their sources)."""
    reference: str | None = None
    """The folder of this split's reference files (:mod:`raylm.run.reference`: one per row
    group of the blocks, :func:`reference_file`), read beside them; None: no stored
    reference."""

    @classmethod
    def load(cls, prepared: str | os.PathLike, split: str, *,
             reference: str | os.PathLike | None = None) -> "PackedSplit":
        root = Path(prepared)
        layout = json.loads((root / LAYOUT).read_text())
        info = layout["splits"][split]
        if not info["blocks"]:
            raise ValueError(f"The prepared data in {root} has no {split} blocks; use a larger "
                             f"corpus, a smaller data.seq_len, or a larger data.val_fraction.")
        return cls(str(root / split), info["files"], info["row_group_sizes"],
                   info["file_groups"], layout["block_length"], layout.get("loss_mask", False),
                   layout.get("sources"),
                   None if reference is None else os.path.join(reference, split))

    def row_group_of(self, row: int) -> tuple[int, int]:
        """(row group, index inside it) of the stored ``row``."""
        offsets = np.cumsum(self.row_group_sizes)
        g = int(np.searchsorted(offsets, row, side="right"))
        return g, row - (int(offsets[g - 1]) if g else 0)

    def column_of_group(self, group: int, column: str) -> list:
        """One column of row group ``group``, as Python values."""
        path, idx = self.group_locations()[group]
        return pq.ParquetFile(path).read_row_group(idx, columns=[column]).column(
            column).to_pylist()

    def documents(self, rows: np.ndarray) -> list[dict[str, object]] | None:
        """The records (corpus file and line, or row) whose tokens the stored ``rows`` hold,
        each once, in order; None when the blocks do not keep their sources. Reads only the
        sources column of the row groups holding them: for a few rows, at a fault."""
        if self.sources is None:
            return None
        offsets = np.concatenate([[0], np.cumsum(self.row_group_sizes)])
        locations = self.group_locations()
        seen: dict[int, dict[str, object]] = {}
        cells: dict[int, list] = {}
        for row in np.asarray(rows, dtype=np.int64).tolist():
            g = int(np.searchsorted(offsets, row, side="right") - 1)
            if g not in cells:
                path, idx = locations[g]
                cells[g] = pq.ParquetFile(path).read_row_group(
                    idx, columns=["doc_sources"]).column("doc_sources").to_pylist()
            for key in cells[g][row - offsets[g]]:
                found = source_of(key)
                if found is not None and key not in seen:
                    seen[key] = {"file": self.sources[found[0]], "line": found[1]}
        return list(seen.values())

    @property
    def num_blocks(self) -> int:
        return sum(self.row_group_sizes)

    def group_locations(self) -> list[tuple[str, int]]:
        """(file path, row group index in file) for every row group, in storage order."""
        out = [(os.path.join(self.directory, name), g)
               for name, n in zip(self.files, self.file_groups, strict=True) for g in range(n)]
        assert len(out) == len(self.row_group_sizes)
        return out


class _CountedFile(io.RawIOBase):
    """A local file whose reads are counted: the bytes a reader took from storage."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "rb")  # noqa: SIM115 (closed with this object)
        self.name = path
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, buffer) -> int:
        n = self._f.readinto(buffer)
        self.bytes_read += n
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def _footer(f: io.RawIOBase) -> pq.FileMetaData:
    """A Parquet file's metadata, reading its footer and nothing else (a Parquet reader
    opening the file reads its last 64 KiB, most of a row group of packed tokens)."""
    f.seek(-8, os.SEEK_END)
    tail = f.read(8)
    if tail[4:] != b"PAR1":
        raise ValueError(f"{getattr(f, 'name', f)} is not a Parquet file (no footer)")
    size = int.from_bytes(tail[:4], "little")
    f.seek(-8 - size, os.SEEK_END)
    # The footer alone, framed as a file of its own; its offsets still point into the file.
    return pq.read_metadata(pa.BufferReader(b"PAR1" + f.read(size) + tail))


def reference_file(folder: str, block_file: str, group: int) -> str:
    """Where the stored reference figures of row group ``group`` of ``block_file`` are: a
    Parquet file of one row group, the same rows in the same order."""
    return os.path.join(folder, f"{block_file.removesuffix('.parquet')}-g{group:05d}.parquet")


@dataclass(frozen=True)
class Group:
    """One row group's blocks as a reader keeps them."""

    tokens: np.ndarray
    doc_starts: list
    loss_mask: np.ndarray | None
    reference: np.ndarray | None
    """(blocks, block_length - 1): the stored reference log-probability of each target."""


class _ReadBlocks:
    """A rank's local sample indices in, its blocks out (in order): the map function of each
    training stream's Ray Data actor, and called directly for the validation blocks.

    Row groups are read whole, on first use, and kept for the rest of the window. Each file's
    footer is read once and its metadata kept. ``bytes_read`` counts every byte read."""

    def __init__(self, split: PackedSplit, *, mode: str, seed: int, window: int, rank: int,
                 world_size: int, start_step: int = 0, global_batch: int = 1,
                 skips: list[list[int]] = ()) -> None:
        self.split = split
        self.mode, self.rank, self.world = mode, rank, world_size
        self.start_step, self.global_batch = start_step, global_batch
        self.skips = Skips(skips)
        self.order = SampleOrder(split.row_group_sizes, seed=seed, window=window,
                                 global_batch=global_batch)
        self.locations = split.group_locations()
        self.cache: OrderedDict[int, Group] = OrderedDict()
        self.cache_size = window + 1
        self.metadata: OrderedDict[str, pq.FileMetaData] = OrderedDict()
        self.bytes_read = 0

    def _read(self, path: str, idx: int) -> pa.Table:
        with _CountedFile(path) as f:
            if path not in self.metadata:
                self.metadata[path] = _footer(f)
            table = pq.ParquetFile(f, metadata=self.metadata[path]).read_row_group(idx)
        self.metadata.move_to_end(path)
        while len(self.metadata) > METADATA_CACHE_FILES:
            self.metadata.popitem(last=False)
        self.bytes_read += f.bytes_read
        return table

    def _group(self, g: int) -> Group:
        if g not in self.cache:
            path, idx = self.locations[g]
            t = self._read(path, idx)
            L = self.split.block_length
            tokens = t.column("input_ids").combine_chunks().values.to_numpy().reshape(-1, L)
            masks = reference = None
            if self.split.loss_mask:
                masks = t.column("loss_mask").combine_chunks().values.to_numpy().reshape(-1, L)
            if self.split.reference is not None:
                beside = reference_file(self.split.reference, os.path.basename(path), idx)
                reference = (self._read(beside, 0).column(REFERENCE_COLUMN).combine_chunks()
                             .flatten().to_numpy().reshape(-1, L - 1))
            self.cache[g] = Group(tokens, t.column("doc_starts").to_pylist(), masks, reference)
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        self.cache.move_to_end(g)
        return self.cache[g]

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        local = batch["id"]
        if self.mode == "train":
            positions = rank_positions(local, start_step=self.start_step,
                                       global_batch=self.global_batch, rank=self.rank,
                                       world_size=self.world, skips=self.skips)
            rows = self.order.rows(positions)
        else:  # evaluation: storage order, round robin over ranks
            positions = local * self.world + self.rank
            rows = positions
        groups = np.searchsorted(self.order.group_offsets, rows, side="right") - 1
        L = self.split.block_length
        tokens = np.empty((len(rows), L), dtype=np.int64)
        pos_ids = np.empty((len(rows), L), dtype=np.int64)
        masks = np.empty((len(rows), L), dtype=np.uint8) if self.split.loss_mask else None
        reference = (np.empty((len(rows), L - 1), dtype=np.float32)
                     if self.split.reference is not None else None)
        for i, (row, g) in enumerate(zip(rows, groups, strict=True)):
            group = self._group(int(g))
            r = int(row - self.order.group_offsets[g])
            tokens[i] = group.tokens[r]
            pos_ids[i] = position_ids(np.asarray(group.doc_starts[r]), L)
            if masks is not None:
                masks[i] = group.loss_mask[r]
            if reference is not None:
                reference[i] = group.reference[r]
        out = {"input_ids": tokens, "position_ids": pos_ids, "sample_position": positions,
               "row": rows}
        if masks is not None:
            out["loss_mask"] = masks
        if reference is not None:
            out[REFERENCE_COLUMN] = reference
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
                       global_batch: int, resources: dict[str, float],
                       skips: list[list[int]] | None = None, reference: str | None = None):
    """Rank ``rank``'s training stream, built by the worker itself once it has restored its
    train state: the samples of steps ``[start_step, num_steps)`` in the global order (less
    the position ranges ``skips``), its slice of each global batch. Its reader asks for
    ``resources`` (CPU and custom Ray resources, as :func:`raylm.run.resources.plan_resources`
    decided). ``reference``: the run's reference directory, whose figures come with each
    block (``ref_logp``)."""
    import ray

    train = PackedSplit.load(prepared, "train", reference=reference)
    num_samples = max(0, num_steps - start_step) * rank_share(global_batch, world_size)
    # Sample indices as in-memory blocks made here (a read, even from_arrow's metadata task,
    # asks for a whole CPU, which workers holding every CPU of their node never leave): 256 to
    # a block for the first 4,096 (an output block is handed on once its input block is done),
    # then 4,096 (each block is a put: 10 M samples in 256s took 20 s and 280 MB to start).
    edges = [*range(0, min(num_samples, 4096), 256), *range(4096, num_samples, 4096)] or [0]
    chunks = [pa.table({"id": np.arange(a, b, dtype=np.int64)})
              for a, b in zip(edges, [*edges[1:], num_samples], strict=True)]
    ds = ray.data.from_blocks(chunks)
    ds.context.execution_options.preserve_order = True
    # One stream per worker, each with its own progress bars, would bury the training log.
    ds.context.enable_progress_bars = False
    return ds.map_batches(
        _ReadBlocks,
        fn_constructor_kwargs=dict(split=train, mode="train", seed=seed, window=window,
                                   rank=rank, world_size=world_size, start_step=start_step,
                                   global_batch=global_batch, skips=skips or []),
        batch_size=64,
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=resources.get("CPU", 0.0),
        resources={k: v for k, v in resources.items() if k != "CPU"} or None,
    )


def read_val_blocks(prepared: str | os.PathLike, *, rank: int, world_size: int,
                    eval_samples: int, reference: str | None = None) -> dict[str, np.ndarray]:
    """Rank ``rank``'s validation blocks, read in this process: up to ``eval_samples`` (the same
    count on every rank, as collectives need), round robin in storage order. They are few (8 x
    8 blocks of 2,049 tokens, 1 MB, with the defaults) and read once per worker group, where a
    Ray Data stream would start a reader actor for them (about 2 s here)."""
    val = PackedSplit.load(prepared, "val", reference=reference)
    n = eval_samples_per_rank(val, world_size, eval_samples)
    reader = _ReadBlocks(val, mode="eval", seed=0, window=1, rank=rank, world_size=world_size)
    return reader({"id": np.arange(n, dtype=np.int64)})


def read_first_blocks(prepared: str | os.PathLike, split: str, *, count: int
                      ) -> dict[str, np.ndarray]:
    """The first ``count`` blocks of ``split`` in storage order, read in this process (the
    calibration batches of pruning: :mod:`raylm.after.prune`)."""
    blocks = PackedSplit.load(prepared, split)
    reader = _ReadBlocks(blocks, mode="eval", seed=0, window=1, rank=0, world_size=1)
    return reader({"id": np.arange(min(count, blocks.num_blocks), dtype=np.int64)})


# ---- The first batch: a worker's wait for its stream, named when it lasts ------------------


class DataStall(RuntimeError):
    """A worker's training stream delivered no first batch in ``data.first_batch_timeout_s``."""


class FirstBatch:
    """A stream's first batch, fetched by a thread from the moment the stream is opened: a
    worker opens its stream before it builds and restores the model, so that starting the
    reader (an actor, its imports, the first row groups) overlaps that work."""

    def __init__(self, batches: Iterator[dict[str, torch.Tensor]]) -> None:
        self._box: queue.Queue = queue.Queue(maxsize=1)
        self._t0 = time.monotonic()

        def fetch() -> None:
            try:
                self._box.put((True, next(batches)))
            except BaseException as e:  # noqa: BLE001 (handed to the waiting thread)
                self._box.put((False, e))

        threading.Thread(target=fetch, name="raylm-first-batch", daemon=True).start()

    def wait(self, *, timeout_s: float, keep_waiting: bool, waiting_for: Callable[[], str],
             log: Callable[[str], None]) -> dict[str, torch.Tensor]:
        """The batch; a stream that has none ``timeout_s`` after this is called is named with
        what it waits for (``waiting_for()``) instead of waiting in silence. With
        ``keep_waiting`` (an autoscaling cluster, which may yet add what is missing) that is
        said every ``timeout_s`` and the wait goes on; otherwise :class:`DataStall` is
        raised."""
        while True:
            try:
                ok, value = self._box.get(timeout=timeout_s)
            except queue.Empty:
                # Counted from the stream's opening, which is when its reader was asked for.
                message = (f"no training batch after {time.monotonic() - self._t0:.0f} s: "
                           f"{waiting_for()}")
                if not keep_waiting:
                    raise DataStall(f"{message}; raise data.first_batch_timeout_s if the "
                                    f"stream is only slow to start") from None
                log(f"raylm: warning: {message}; waiting on, as scaling.wait_for_nodes asks")
                continue
            if not ok:
                raise value
            return value


def reader_wait(reader: dict[str, float], *, rank: int) -> str:
    """What rank ``rank``'s training-data reader (a Ray Data actor) waits for: the resources it
    asks for against those free on the cluster now."""
    import ray

    free = ray.available_resources()
    asks = ", ".join(f"{k} {v:g}" for k, v in reader.items() if v) or "no resources"
    short = [f"{k} {v:g} (free: {free.get(k, 0):g})" for k, v in reader.items()
             if v and free.get(k, 0) < v]
    return (f"rank {rank}'s data reader, a Ray Data actor asking for {asks}, "
            + (f"cannot be placed: the cluster lacks {', '.join(short)}" if short else
               "has not produced a batch though the cluster has room for it; look for its "
               "error in the worker logs"))
