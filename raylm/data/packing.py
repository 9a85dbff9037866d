"""Packing token streams into fixed-length blocks, and the one global order blocks are read in.

Packing concatenates tokenized documents (each already ending in EOS) and cuts the stream into
blocks of ``block_length = seq_len + 1`` tokens: no padding, every token trains, and a document
may continue into the next block. The tokens after the last full block are dropped and counted
(``tokens == blocks * block_length + tail_tokens_dropped``). Each block remembers where documents
start inside it, so attention can be kept within documents. Fine-tuning examples are packed
whole instead (:class:`ExamplePacker`), with padding and a loss mask
(``tokens + padding_tokens == blocks * block_length``).

:class:`SampleOrder` defines the training stream: global position ``p`` of epoch ``p // N`` maps
to one stored block, through a permutation that depends only on the seed, the data and the
global batch. Global step ``s`` consumes positions ``[s*B, (s+1)*B)`` and rank ``r`` of ``w``
takes the slice ``[r*B/w, (r+1)*B/w)`` of it, so a checkpoint that stores the next position
resumes exactly, on any number of workers.

The permutation keeps reads sequential and lets each rank read about its own share. Row groups
are permuted, and ``window`` consecutive row groups form a window: every 4,096 consecutive
positions (16 row groups of 256 blocks) come from 16 random row groups spread over the corpus.
Inside a window, a position's *column* ``p mod B`` is its place in the global batch, and the
window's rows (its row groups one after the other, the rows of each shuffled) are dealt out
column by column: column 0's positions in the window take the first rows, column 1's the next,
and so on. A rank's slice is a run of consecutive columns whatever the worker count, so the
rows it trains on in a window are one contiguous run of that sequence: it reads only the row
groups of its run, which hold its share plus the rest of the two row groups the run starts and
ends in (nothing more when the window's row groups are full, the worker count divides their
number and ``B`` divides their rows). Every global batch still draws from across its window:
each column's rows come from one or two row groups, so a batch takes rows from ``min(B,
window)`` row groups or more. A reader holds at most the window's row groups in memory; the
order itself costs one int per row group and one per row of the windows in use.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

UNKNOWN_SOURCE = -1


def source_key(file_id: int | np.ndarray, line: int | np.ndarray) -> int | np.ndarray:
    """Where a document comes from, as one int64: its file's index in the corpus and its line
    (or row) in that file (lines below 2^40, files below 2^23)."""
    return (np.int64(file_id) << 40) | np.int64(line)


def source_of(key: int) -> tuple[int, int] | None:
    """(file index, line) of a :func:`source_key`; None for an unknown source."""
    key = int(key)
    return None if key < 0 else (key >> 40, key & ((1 << 40) - 1))


def _lead(starts: np.ndarray, sources: np.ndarray, before: int) -> tuple[np.ndarray, np.ndarray]:
    """A block's document starts and the sources of its segments: one per start, and first
    the source of the document it continues (``before``) when none starts at 0."""
    if len(starts) and starts[0] == 0:
        return starts, sources
    return starts, np.concatenate([[before], sources]).astype(np.int64)


class Packer:
    """Streams documents in, full blocks out; holds less than one block between calls. Each
    block comes with where documents start in it and where each of its segments came from
    (:func:`source_key`; :data:`UNKNOWN_SOURCE` when not given)."""

    def __init__(self, block_length: int) -> None:
        self.block_length = block_length
        self._rest = np.zeros(0, dtype=np.int32)
        self._rest_starts = np.zeros(0, dtype=np.int64)
        self._rest_sources = np.zeros(0, dtype=np.int64)
        self._carry = UNKNOWN_SOURCE  # the source of the document _rest begins inside
        self.tokens_in = 0
        self.blocks_out = 0

    def add(self, docs: list[np.ndarray], sources: np.ndarray | None = None
            ) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """Append ``docs`` (from ``sources``, one key each); return the blocks completed,
        shape (n, block_length), for each block the offsets inside it where a document starts,
        and the sources of its segments (see :meth:`add_stream`)."""
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        tokens = np.concatenate([np.zeros(0, np.int32),
                                 *[np.asarray(d, dtype=np.int32) for d in docs]])
        return self.add_stream(tokens, np.cumsum(lengths) - lengths, sources)

    def add_stream(self, tokens: np.ndarray, starts: np.ndarray,
                   sources: np.ndarray | None = None
                   ) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """Append a run of ``tokens`` in which documents start at ``starts`` (from
        ``sources``); as :meth:`add`. A block's segments are its document starts, preceded by
        position 0 when a document continues into it."""
        L = self.block_length
        self.tokens_in += len(tokens)
        if sources is None:
            sources = np.full(len(starts), UNKNOWN_SOURCE, dtype=np.int64)
        stream = np.concatenate([self._rest, np.asarray(tokens, dtype=np.int32)])
        starts = np.concatenate([self._rest_starts,
                                 len(self._rest) + np.asarray(starts, dtype=np.int64)])
        sources = np.concatenate([self._rest_sources, np.asarray(sources, dtype=np.int64)])
        n = len(stream) // L
        blocks = stream[: n * L].reshape(n, L)
        cut = np.searchsorted(starts, np.arange(n + 1) * L)

        def before(i: int) -> int:  # the source of the document running at cut i
            return int(sources[cut[i] - 1]) if cut[i] > 0 else self._carry

        segments = [_lead(starts[cut[i]:cut[i + 1]] - i * L, sources[cut[i]:cut[i + 1]],
                          before(i)) for i in range(n)]
        self._carry = before(n)
        self._rest = stream[n * L :].copy()
        self._rest_starts = starts[cut[n] :] - n * L
        self._rest_sources = sources[cut[n] :]
        self.blocks_out += n
        return blocks, [a for a, _ in segments], [b for _, b in segments]

    @property
    def tail_tokens(self) -> int:
        """Tokens that did not fill a block (dropped when the stream ends)."""
        return len(self._rest)

    def tail(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The tokens that did not fill a block, where documents start among them, and their
        sources; its first token counts as a start (it may continue a document whose beginning
        is in the last block: on its own, it is the start of what is left of it)."""
        starts, sources = self._rest_starts, self._rest_sources
        if len(self._rest) and (not len(starts) or starts[0] != 0):
            starts = np.concatenate([[0], starts])
            sources = np.concatenate([[self._carry], sources])
        return self._rest.copy(), starts.astype(np.int64), sources.astype(np.int64)


class ExamplePacker:
    """Fine-tuning examples in, full blocks out: each example whole in one block (an example cut
    in two would train its second half without the first), as many as fit, in arrival order;
    the rest of a block is padding, masked out and a document of its own. Every example's first
    token is masked as a target too: it would be predicted from the example before it, which
    it cannot see. Examples must be at most ``block_length`` tokens (the caller drops or cuts
    longer ones). A preference pair is one example of two documents, ``(ids, mask, split)``:
    the prompt and chosen answer, then from ``split`` on the prompt and rejected answer, so
    both halves always share a block. Holds at most one block between calls; :meth:`finish`
    pads out the last."""

    def __init__(self, block_length: int, *, pad_id: int, one_per_block: bool = False) -> None:
        # One per block: prompts, each a sample of its own (a step answers a known number).
        self.block_length, self.pad_id, self.one_per_block = block_length, pad_id, one_per_block
        self._ids: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._sources: list[int] = []
        self._splits: list[int] = []
        self._used = 0
        self.tokens_in = self.blocks_out = self.padding_tokens = self.trained_tokens = 0

    def add(self, examples: list[tuple[np.ndarray, np.ndarray]],
            sources: np.ndarray | None = None
            ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, list[np.ndarray]]:
        """Append ``(ids, mask)`` examples (from ``sources``, one :func:`source_key` each);
        return the blocks completed (n, block_length), the example starts inside each, their
        loss masks (n, block_length; 1: a trained target) and the sources of their segments
        (the padding's unknown)."""
        if sources is None:
            sources = np.full(len(examples), UNKNOWN_SOURCE, dtype=np.int64)
        blocks, starts, masks, block_sources = [], [], [], []
        for example, source in zip(examples, sources, strict=True):
            ids, mask, split = example if len(example) == 3 else (*example, 0)
            n = len(ids)
            assert 0 < n <= self.block_length and len(mask) == n and 0 <= split < n
            if self._used + n > self.block_length or (self.one_per_block and self._ids):
                closed = self._close()
                for out, part in zip((blocks, starts, masks, block_sources), closed,
                                     strict=True):
                    out.append(part)
            mask = np.asarray(mask, dtype=np.uint8).copy()
            mask[0] = mask[split] = 0
            self._ids.append(np.asarray(ids, dtype=np.int32))
            self._mask.append(mask)
            self._sources.append(int(source))
            self._splits.append(int(split))
            self._used += n
            self.tokens_in += n
            self.trained_tokens += int(np.count_nonzero(mask))
        return self._stack(blocks, starts, masks, block_sources)

    tail_tokens = 0
    """Nothing is dropped at the end: :meth:`finish` pads out the last block."""

    def finish(self) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, list[np.ndarray]]:
        """The last, partly filled block (padded), if any."""
        if not self._ids:
            return self._stack([], [], [], [])
        return self._stack(*([part] for part in self._close()))

    def _close(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        L = self.block_length
        lengths = [len(i) for i in self._ids]
        firsts = np.cumsum([0, *lengths])[:-1]
        starts, sources = [], []
        for first, split, source in zip(firsts, self._splits, self._sources, strict=True):
            starts += [first, first + split] if split else [first]
            sources += [source, source] if split else [source]
        pad = L - self._used
        ids = np.concatenate([*self._ids, np.full(pad, self.pad_id, np.int32)])
        mask = np.concatenate([*self._mask, np.zeros(pad, np.uint8)])
        if pad:
            starts.append(self._used)
            sources.append(UNKNOWN_SOURCE)
        starts, sources = np.array(starts, np.int64), np.array(sources, np.int64)
        self.padding_tokens += pad
        self.blocks_out += 1
        self._ids, self._mask, self._sources, self._splits, self._used = [], [], [], [], 0
        return ids, starts.astype(np.int64), mask, sources

    def _stack(self, blocks, starts, masks, sources):
        L = self.block_length
        if not blocks:
            return np.zeros((0, L), np.int32), [], np.zeros((0, L), np.uint8), []
        return np.stack(blocks), starts, np.stack(masks), sources


def position_ids(doc_starts: np.ndarray, block_length: int) -> np.ndarray:
    """Per-token position inside its document, restarting at every document start."""
    pos = np.arange(block_length, dtype=np.int64)
    if len(doc_starts) == 0:
        return pos
    # For each token, the most recent document start at or before it (0 if none).
    starts = np.concatenate([[0], np.asarray(doc_starts, dtype=np.int64)])
    last = starts[np.searchsorted(starts, pos, side="right") - 1]
    return pos - last


class SampleOrder:
    """Global position -> stored row, for rows stored in row groups of ``group_sizes`` and read
    ``global_batch`` positions per step."""

    def __init__(self, group_sizes: list[int], *, seed: int, window: int,
                 global_batch: int) -> None:
        if not group_sizes or min(group_sizes) < 1:
            raise ValueError("SampleOrder needs at least one non-empty row group")
        self.group_sizes = np.asarray(group_sizes, dtype=np.int64)
        self.group_offsets = np.concatenate([[0], np.cumsum(self.group_sizes)])
        self.num_rows = int(self.group_offsets[-1])
        self.seed, self.window, self.global_batch = seed, window, global_batch
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._windows: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray,
                                                          np.ndarray]] = OrderedDict()

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(row-group permutation, start position of each window) for ``epoch``."""
        if epoch not in self._epochs:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.group_sizes))
            sizes = self.group_sizes[perm]
            window_sizes = np.add.reduceat(sizes, np.arange(0, len(sizes), self.window))
            self._epochs[epoch] = (perm, np.concatenate([[0], np.cumsum(window_sizes)]))
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def _window(self, epoch: int, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Window ``w`` of ``epoch``: its rows in dealing order, and for each column the first
        position of the window in that column and how many rows precede that column's."""
        key = (epoch, w)
        if key not in self._windows:
            perm, starts = self._epoch(epoch)
            rng = np.random.default_rng([self.seed, epoch, w])
            rows = np.concatenate([rng.permutation(np.arange(self.group_offsets[g],
                                                             self.group_offsets[g + 1]))
                                   for g in perm[w * self.window : (w + 1) * self.window]])
            a = epoch * self.num_rows + int(starts[w])  # the window's first global position
            columns = np.arange(self.global_batch)
            first = a + (columns - a) % self.global_batch
            count = np.maximum(0, -(-(a + len(rows) - first) // self.global_batch))
            before = np.concatenate([[0], np.cumsum(count)[:-1]])
            self._windows[key] = (rows, first, before)
            while len(self._windows) > 4:
                self._windows.popitem(last=False)
        return self._windows[key]

    def rows(self, positions: np.ndarray) -> np.ndarray:
        """Stored row index for each global position (any epoch)."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty_like(positions)
        epochs = positions // self.num_rows
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            _, window_starts = self._epoch(int(epoch))
            within = positions[in_epoch] - epoch * self.num_rows
            w_idx = np.searchsorted(window_starts, within, side="right") - 1
            res = np.empty(len(within), dtype=np.int64)
            for w in np.unique(w_idx):
                m = w_idx == w
                rows, first, before = self._window(int(epoch), int(w))
                p = positions[in_epoch][m]
                col = p % self.global_batch
                res[m] = rows[before[col] + (p - first[col]) // self.global_batch]
            out[in_epoch] = res
        return out


class Skips:
    """Global positions left out of the training order: sorted, disjoint ranges ``[start,
    end)``. Training then reads the order with them removed: the k-th sample trained (its
    "slot", ``step x global_batch + i``) is at the k-th position not left out, so every
    worker count maps slots to the same positions, and a run that leaves a stretch out
    trains what follows it one stretch earlier."""

    def __init__(self, ranges: list[list[int]] | list[tuple[int, int]] = ()) -> None:
        merged: list[list[int]] = []
        for a, b in sorted((int(a), int(b)) for a, b in ranges):
            if not 0 <= a < b:
                raise ValueError(f"a range of sample positions to leave out must be [start, "
                                 f"end) with 0 <= start < end; got [{a}, {b})")
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.ranges = merged
        lengths = np.array([b - a for a, b in merged], dtype=np.int64)
        self._cum = np.concatenate([[0], np.cumsum(lengths)])
        # Where each range starts counted in slots (positions not left out before it).
        self._slot_starts = np.array([a for a, _ in merged], dtype=np.int64) - self._cum[:-1]

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def positions(self, slots: np.ndarray) -> np.ndarray:
        """The global position of each slot."""
        slots = np.asarray(slots, dtype=np.int64)
        if not self.ranges:
            return slots
        return slots + self._cum[np.searchsorted(self._slot_starts, slots, side="right")]

    def add(self, ranges: list[list[int]]) -> "Skips":
        return Skips([*self.ranges, *ranges])

    @property
    def total(self) -> int:
        """How many positions the ranges leave out."""
        return int(self._cum[-1])

    def overlap(self, start: int, end: int) -> int:
        """How many positions of ``[start, end)`` the ranges leave out."""
        return sum(max(0, min(end, b) - max(start, a)) for a, b in self.ranges)


def as_ranges(positions: np.ndarray) -> list[list[int]]:
    """Sorted positions as the fewest ``[start, end)`` ranges."""
    p = np.unique(np.asarray(positions, dtype=np.int64))
    if not len(p):
        return []
    breaks = np.flatnonzero(np.diff(p) != 1) + 1
    return [[int(run[0]), int(run[-1]) + 1] for run in np.split(p, breaks)]


def rank_share(global_batch: int, world_size: int) -> int:
    """Samples each rank takes of every global batch. The config guarantees every worker count
    the run may have divides the global batch (``train.global_batch_size``)."""
    assert global_batch % world_size == 0, (global_batch, world_size)
    return global_batch // world_size


def rank_positions(
    local_index: np.ndarray, *, start_step: int, global_batch: int, rank: int, world_size: int,
    skips: Skips | None = None
) -> np.ndarray:
    """Global positions of the ``local_index``-th samples rank ``rank`` of ``world_size`` reads
    from ``start_step`` on: it takes slice ``[rank*b, (rank+1)*b)`` of every global batch (of
    the order less the positions ``skips`` leaves out)."""
    per_rank = rank_share(global_batch, world_size)
    step, j = np.divmod(np.asarray(local_index, dtype=np.int64), per_rank)
    slots = (start_step + step) * global_batch + rank * per_rank + j
    return skips.positions(slots) if skips else slots


def step_positions(step: int, *, global_batch: int, skips: Skips | None = None) -> np.ndarray:
    """The global positions optimizer step ``step`` (0-based) trains, every rank's."""
    slots = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.int64)
    return skips.positions(slots) if skips else slots


def check_positions(positions: np.ndarray, *, step: int, global_batch: int, rank: int,
                    world_size: int, skips: Skips | None = None) -> None:
    """The samples a rank is about to train at ``step`` (0-based) must be its slice of that
    global batch. The stream starts where the restored train state says, so this holds unless
    a reader is broken; a mismatch would silently train on the wrong data."""
    want = rank_positions(np.arange(rank_share(global_batch, world_size)), start_step=step,
                          global_batch=global_batch, rank=rank, world_size=world_size,
                          skips=skips)
    if not np.array_equal(positions, want):
        raise RuntimeError(
            f"rank {rank}: the data stream is at positions {positions[:4].tolist()}... but step "
            f"{step} needs {want[0]}..{want[-1]}; the stream and the checkpoint disagree about "
            f"where the run is.")
