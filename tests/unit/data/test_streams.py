"""What a training rank reads from the packed files, without Ray: its own share of the bytes,
and the blocks of exactly its samples."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from raylm.bench.scale import rank_reads
from raylm.data.packing import rank_positions, source_key
from raylm.data.preparation import BlockWriter
from raylm.data.streams import PackedSplit, _ReadBlocks

L, GROUP_ROWS, WINDOW, BATCH = 257, 64, 8, 16


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """94 row groups of 64 blocks, the last one short, in files of 64 row groups (4 MB)."""
    root = tmp_path_factory.mktemp("packed")
    writer = BlockWriter(root, block_length=L, group_rows=GROUP_ROWS)
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 32_000, size=(5990, L), dtype=np.int32)
    # Block i holds the end of the record on line i of file 0 and the start of line i + 1.
    writer.add(blocks, [np.array([40]) for _ in blocks],
               [source_key(0, np.array([i, i + 1])) for i in range(len(blocks))])
    writer.close()
    return PackedSplit(str(root), writer.files, writer.group_sizes, writer.file_groups, L), blocks


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_rank_reads_about_its_own_share(split, world):
    train, _ = split
    steps = train.num_blocks // BATCH
    per_rank = [rank_reads(train, rank=r, world=world, steps=steps, window=WINDOW,
                           global_batch=BATCH) for r in range(world)]
    for x in per_rank:
        # Its samples' bytes, plus each file's footer and the ends of runs in row groups.
        assert x["own_bytes"] <= x["bytes_read"] <= 1.2 * x["own_bytes"]
    # Together, about the split once, whatever the worker count.
    total = sum(x["bytes_read"] for x in per_rank)
    assert total <= 1.2 * per_rank[0]["split_bytes"]


def test_the_reader_returns_the_stored_blocks_of_its_positions(split):
    train, blocks = split
    reader = _ReadBlocks(train, mode="train", seed=3, window=WINDOW, rank=1, world_size=2,
                         start_step=7, global_batch=BATCH)
    out = reader({"id": np.arange(40)})
    want = rank_positions(np.arange(40), start_step=7, global_batch=BATCH, rank=1,
                          world_size=2)
    assert out["sample_position"].tolist() == want.tolist()
    assert (out["input_ids"] == blocks[out["row"]]).all()
    assert out["position_ids"][0].tolist() == [*range(40), *range(L - 40)]
    # The bytes counted are the column chunks of the row groups it read, and each footer
    # (its length and magic, 8 bytes, included) once.
    locations = train.group_locations()
    chunks = 0
    for g in reader.cache:
        md = pq.ParquetFile(locations[g][0]).metadata.row_group(locations[g][1])
        chunks += sum(md.column(c).total_compressed_size for c in range(md.num_columns))
    footers = sum(pq.ParquetFile(path).metadata.serialized_size + 8 for path in reader.metadata)
    assert len(reader.cache) < len(train.row_group_sizes)  # not everything
    assert reader.bytes_read == chunks + footers


def test_a_block_names_the_records_it_holds(split):
    from dataclasses import replace

    train, _ = split
    assert train.documents(np.array([5])) is None  # a split whose layout lists no sources
    named = replace(train, sources=["a.jsonl"])
    got = named.documents(np.array([4000, 5, 6]))
    assert got == [{"file": "a.jsonl", "line": line} for line in (4000, 4001, 5, 6, 7)]
