"""The preparation's pieces and its exact deduplication, without Ray."""

from __future__ import annotations

import numpy as np

from raylm.data.preparation import find_duplicates, piece_bytes, plan_pieces, record_key


def test_pieces_are_runs_of_files_of_at_least_the_piece_size():
    sizes = [300, 500, 100, 900, 50, 50, 1000]
    assert plan_pieces(sizes, 800) == [0, 2, 4]  # 800, 1000, 1100 bytes
    assert plan_pieces(sizes, 1) == list(range(7))  # a file is never split
    assert plan_pieces(sizes, 10**9) == [0]
    assert piece_bytes(sizes, None) == 4 * 2**20  # a small corpus: the 4 MB floor
    assert piece_bytes([2**30] * 16, None) == 4 * 2**20  # 16 GB / 4096 = 4 MB
    assert piece_bytes([2**30] * 64, None) == 16 * 2**20  # 64 GB / 4096
    assert piece_bytes(sizes, 0.5) == 2**19


def test_duplicates_keep_the_first_occurrence_whatever_the_partition_and_input_order():
    """Three pieces (files 0-1, 2, 3-4). Hash 7 occurs in files 3, 0 and 2: the file 0 copy is
    kept; hash 9 twice in file 2: the earlier record is kept; hash 5 once."""
    pairs = {
        0: [(7, record_key(0, 4)), (5, record_key(1, 0))],
        1: [(9, record_key(2, 3)), (7, record_key(2, 1)), (9, record_key(2, 0))],
        2: [(7, record_key(3, 2))],
    }
    arrays = {p: np.array(v, dtype=np.uint64) for p, v in pairs.items()}
    want = [[], [record_key(2, 1), record_key(2, 3)], [record_key(3, 2)]]
    for order in ([0, 1, 2], [2, 0, 1]):
        got = find_duplicates([0, 2, 3], *(arrays[p] for p in order))
        assert [g.tolist() for g in got] == want
    empty = find_duplicates([0, 2, 3], np.zeros((0, 2), np.uint64))
    assert [len(g) for g in empty] == [0, 0, 0]
    # One piece: the one array itself (Ray's single return object).
    assert find_duplicates([0], arrays[1]).tolist() == [record_key(2, 3)]
