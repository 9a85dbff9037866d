"""Packed preference pairs made up of random tokens, as preparation packs them
(:class:`raylm.data.packing.ExamplePacker`): for tests of the preference step without a corpus."""

from __future__ import annotations

import numpy as np
import torch

from raylm.data.packing import ExamplePacker, position_ids


def random_pair(gen: np.random.Generator, vocab: int, *, prompt: int, answer: int
                ) -> tuple[np.ndarray, np.ndarray, int]:
    """One pair: the same prompt twice, each half ending in its own answer (chosen marked 1,
    rejected 2)."""
    p = gen.integers(1, vocab, prompt)
    c, r = gen.integers(1, vocab, answer), gen.integers(1, vocab, answer + 1)
    ids = np.concatenate([p, c, p, r]).astype(np.int32)
    mask = np.concatenate([np.zeros(prompt), np.ones(answer), np.zeros(prompt),
                           np.full(answer + 1, 2)]).astype(np.uint8)
    return ids, mask, prompt + answer


def pair_blocks(n: int, *, seq: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n`` blocks of ``seq + 1`` tokens holding whole pairs of varied lengths (so blocks hold
    different numbers of pairs), with their position ids and loss masks."""
    gen = np.random.default_rng(seed)
    packer = ExamplePacker(seq + 1, pad_id=0)
    blocks, starts, masks = [], [], []
    while len(blocks) < n:
        pairs = [random_pair(gen, vocab, prompt=int(gen.integers(2, 6)),
                             answer=int(gen.integers(2, 8))) for _ in range(4)]
        b, s, m, _ = packer.add(pairs)
        blocks += list(b)
        starts += s
        masks += list(m)
    return {"input_ids": torch.from_numpy(np.stack(blocks[:n]).astype(np.int64)),
            "position_ids": torch.from_numpy(np.stack([position_ids(s, seq + 1)
                                                       for s in starts[:n]])),
            "loss_mask": torch.from_numpy(np.stack(masks[:n]))}
