from __future__ import annotations

import numpy as np
import pytest

from raylm.data.packing import Packer, SampleOrder, position_ids, rank_positions

EOS = 0


def docs_of(lengths, start=1):
    out, tok = [], start
    for n in lengths:
        body = np.arange(tok, tok + n - 1, dtype=np.int32)
        out.append(np.concatenate([body, [EOS]]).astype(np.int32))
        tok += n
    return out


def test_packing_has_no_padding_and_exact_accounting():
    L = 8
    docs = docs_of([3, 5, 9, 1, 4, 7])  # 29 tokens incl. one EOS each
    p = Packer(L)
    blocks1, starts1, _ = p.add(docs[:2])
    blocks2, starts2, _ = p.add(docs[2:])
    blocks = np.concatenate([blocks1, blocks2])
    assert blocks.shape == (3, L)
    assert p.tokens_in == 29 == blocks.size + p.tail_tokens
    stream = np.concatenate(docs)
    assert (blocks.reshape(-1) == stream[: 3 * L]).all()  # order kept, nothing padded
    # EOS closes every document, so documents are separated inside blocks.
    assert (stream == EOS).sum() == 6
    # Document starts inside each block: docs start at 0, 3, 8, 17, 18, 22 in the stream.
    assert [s.tolist() for s in starts1 + starts2] == [[0, 3], [0], [1, 2, 6]]


def test_packer_with_empty_calls_and_long_documents():
    p = Packer(4)
    b, s, _ = p.add([])
    assert b.shape == (0, 4) and s == []
    b, s, _ = p.add(docs_of([10]))
    assert b.shape == (2, 4) and [x.tolist() for x in s] == [[0], []]
    assert p.tail_tokens == 2


def test_position_ids_restart_per_document():
    assert position_ids(np.array([0, 3]), 6).tolist() == [0, 1, 2, 0, 1, 2]
    # A block that starts mid-document counts from 0, then restarts at the next start.
    assert position_ids(np.array([2]), 5).tolist() == [0, 1, 0, 1, 2]
    assert position_ids(np.array([], dtype=np.int64), 3).tolist() == [0, 1, 2]


@pytest.mark.parametrize("sizes, window, batch",
                         [([4, 4, 4, 2], 2, 4), ([256] * 10 + [7], 3, 16), ([5], 1, 8),
                          ([16] * 6, 4, 6)])
def test_sample_order_is_a_permutation_per_epoch(sizes, window, batch):
    order = SampleOrder(sizes, seed=3, window=window, global_batch=batch)
    n = sum(sizes)
    for epoch in range(3):
        rows = order.rows(np.arange(epoch * n, (epoch + 1) * n))
        assert sorted(rows.tolist()) == list(range(n))
    again = SampleOrder(sizes, seed=3, window=window, global_batch=batch)
    assert (again.rows(np.arange(2 * n)) == order.rows(np.arange(2 * n))).all()
    # Random access agrees with sequential access (resume reads positions out of order).
    probe = np.array([n + 1, 0, 2 * n - 1, 3]) % (3 * n)
    fresh = SampleOrder(sizes, seed=3, window=window, global_batch=batch)
    assert (order.rows(probe) == fresh.rows(probe)).all()


def test_sample_order_depends_on_seed_and_epoch():
    sizes = [64] * 8
    a = SampleOrder(sizes, seed=0, window=2, global_batch=8).rows(np.arange(1024))
    b = SampleOrder(sizes, seed=1, window=2, global_batch=8).rows(np.arange(1024))
    assert (a != b).any()
    assert (a[:512] != a[512:]).any()  # epochs are shuffled differently


def _groups_read(order: SampleOrder, *, rank: int, world: int, steps: int) -> set[int]:
    b = order.global_batch
    positions = rank_positions(np.arange(steps * b // world), start_step=0, global_batch=b,
                               rank=rank, world_size=world)
    rows = order.rows(positions)
    return set((np.searchsorted(order.group_offsets, rows, side="right") - 1).tolist())


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_each_rank_reads_its_own_row_groups(world):
    # Full row groups, a batch dividing the window and worker counts dividing the window's
    # groups: every row group is read by exactly one rank per epoch.
    sizes, window, batch = [32] * 64, 8, 16
    order = SampleOrder(sizes, seed=5, window=window, global_batch=batch)
    steps = sum(sizes) // batch  # one epoch
    read = [_groups_read(order, rank=r, world=world, steps=steps) for r in range(world)]
    assert sum(len(g) for g in read) == len(sizes)
    assert set().union(*read) == set(range(len(sizes)))


def test_uneven_row_groups_cost_at_most_two_extra_row_groups_per_window():
    # Short row groups (each preparation piece ends in one), a batch that does not divide the
    # window, and a rank count that does not divide it either.
    rng = np.random.default_rng(0)
    sizes = [int(x) for x in rng.choice([64, 64, 64, 17], size=90)]
    window, batch, world = 6, 12, 4
    order = SampleOrder(sizes, seed=1, window=window, global_batch=batch)
    n = sum(sizes)
    steps = n // batch
    windows = -(-len(sizes) // window)
    for r in range(world):
        rows_read = sum(sizes[g] for g in _groups_read(order, rank=r, world=world, steps=steps))
        share = steps * batch // world
        assert rows_read <= share + windows * 2 * max(sizes)


def test_every_global_batch_mixes_its_window():
    sizes, window, batch = [32] * 16, 8, 16
    order = SampleOrder(sizes, seed=2, window=window, global_batch=batch)
    rows = order.rows(np.arange(sum(sizes))).reshape(-1, batch)
    groups = np.searchsorted(order.group_offsets, rows, side="right") - 1
    # Each step takes two rows from each of the window's 8 row groups.
    assert all(len(set(step.tolist())) == window for step in groups)


def test_rank_positions_partition_every_global_batch():
    B, world, steps = 8, 4, 5
    per_rank = [rank_positions(np.arange(steps * B // world), start_step=2, global_batch=B,
                               rank=r, world_size=world) for r in range(world)]
    allpos = np.concatenate(per_rank)
    assert len(set(allpos.tolist())) == len(allpos)
    assert sorted(allpos.tolist()) == list(range(2 * B, (2 + steps) * B))
    # Resuming on a different world size continues with the same next position.
    two = [rank_positions(np.arange(4), start_step=7, global_batch=B, rank=r, world_size=2)
           for r in range(2)]
    assert two[0].tolist() == [56, 57, 58, 59] and two[1].tolist() == [60, 61, 62, 63]
    # Unequal shares are refused with the config (train.global_batch_size); here they are a
    # broken invariant.
    with pytest.raises(AssertionError):
        rank_positions(np.arange(2), start_step=0, global_batch=6, rank=0, world_size=4)


def test_example_packer_keeps_examples_whole_and_masks_padding_and_starts():
    from raylm.data.packing import ExamplePacker

    p = ExamplePacker(8, pad_id=0)
    ex = [(np.array([1, 2, 3]), np.array([0, 1, 1])),
          (np.array([4, 5, 6, 7]), np.array([0, 0, 1, 1])),
          (np.array([8, 9]), np.array([1, 1])), (np.array([10] * 8), np.array([1] * 8))]
    blocks, starts, masks, sources = p.add(ex, np.array([11, 12, 13, 14]))
    # [1 2 3 4 5 6 7 pad] | [8 9 pad x6] | [10 x8] still open
    assert blocks.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0], [8, 9, 0, 0, 0, 0, 0, 0]]
    assert [s.tolist() for s in starts] == [[0, 3, 7], [0, 2]]
    # Each example's first token is never a target; padding never is.
    assert masks.tolist() == [[0, 1, 1, 0, 0, 1, 1, 0], [0, 1, 0, 0, 0, 0, 0, 0]]
    # Each segment's source; the padding's unknown (-1).
    assert [x.tolist() for x in sources] == [[11, 12, -1], [13, -1]]
    last, last_starts, last_mask, last_sources = p.finish()
    assert last_sources[0].tolist() == [14]
    assert last.tolist() == [[10] * 8] and last_starts[0].tolist() == [0]
    assert last_mask.tolist() == [[0] + [1] * 7]
    assert p.blocks_out == 3 and p.tokens_in == 17 and p.padding_tokens == 7
    assert p.tokens_in + p.padding_tokens == p.blocks_out * 8
    assert p.trained_tokens == 4 + 1 + 7 == int(masks.sum() + last_mask.sum())
    assert p.finish()[0].shape == (0, 8)


def test_each_block_knows_the_documents_its_segments_came_from():
    """Sources follow documents across block boundaries, calls and the tail a piece leaves
    for the driver to pack on."""
    from raylm.data.packing import source_key, source_of

    L = 8
    docs = docs_of([3, 5, 9, 1, 4, 7])  # documents start at 0, 3, 8, 17, 18, 22
    keys = source_key(np.zeros(6, np.int64), np.arange(1, 7))
    p = Packer(L)
    b1, s1, src1 = p.add(docs[:2], keys[:2])
    b2, s2, src2 = p.add(docs[2:], keys[2:])
    lines = [[source_of(k)[1] for k in x] for x in src1 + src2]
    # Block 0: documents 1 and 2 start in it; block 1: document 3 starts at its beginning;
    # block 2 continues document 3, then documents 4, 5 and 6 start at 1, 2 and 6.
    assert [x.tolist() for x in s1 + s2] == [[0, 3], [0], [1, 2, 6]]
    assert lines == [[1, 2], [3], [3, 4, 5, 6]]
    tokens, starts, sources = p.tail()  # 29 - 24 = 5 tokens: the rest of document 6
    assert starts.tolist() == [0] and [source_of(k)[1] for k in sources] == [6]
    q = Packer(4)
    _, qs, qsrc = q.add_stream(tokens, starts, sources)
    assert qs[0].tolist() == [0] and [source_of(k)[1] for k in qsrc[0]] == [6]
    assert source_of(source_key(3, 12345)) == (3, 12345) and source_of(-1) is None
