"""The sample ledger: the stored rows every optimizer step trained on, kept in each
checkpoint, and the accounting that shows a run with restarts and resizes trained each sample
exactly as often as an uninterrupted one.

Each rank keeps the ``row`` column of the batches it trained since the last checkpoint; at a
checkpoint they are gathered into rank 0's ledger, ``(steps, global batch)`` int32 in position
order, saved as ``samples.npy`` beside the shards. A checkpoint's ledger therefore describes
exactly the updates its weights hold: steps lost to a failure never enter it, steps
trained again after a restart enter it once, and a step whose update the numerical check kept
from the weights (:mod:`raylm.workers.health`) enters it as ``-1 - row`` for each of its rows.
:func:`raylm.rundir.account_samples` (the driver's, at the run's end) compares it with the
order the seed defines (``SampleOrder``), so it counts from the data the workers received, not
from the step arithmetic. Size: 4 bytes per sample (a 1B-token run of 2,048-token blocks:
2 MB).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist


class Ledger:
    """One rank's part of the ledger: the rows of the steps since the last checkpoint, and on
    rank 0 the whole history (what the checkpoint it continues from held)."""

    def __init__(self, *, enabled: bool, history: np.ndarray | None,
                 data_ranks: list[int] | None = None) -> None:
        self.enabled = enabled
        self.history = history
        self.data_ranks = data_ranks
        self.pending: list[np.ndarray] = []

    def add(self, rows: np.ndarray) -> None:
        if self.enabled:
            self.pending.append(rows)

    def withhold(self, steps_ago: int) -> None:
        """Mark the step ``steps_ago`` steps before the last one added (0: the last) as one
        whose update did not reach the weights."""
        if self.enabled:
            i = len(self.pending) - 1 - steps_ago
            self.pending[i] = -1 - self.pending[i]

    def collect(self, device: torch.device) -> np.ndarray | None:
        """At a checkpoint (every rank calls it): the ledger to save, on rank 0; else None."""
        if not self.enabled:
            return None
        new_rows = gather(self.pending, device, data_ranks=self.data_ranks)
        self.pending = []
        if new_rows is not None:
            self.history = np.concatenate([self.history, new_rows])
        return self.history


def gather(rows: list[np.ndarray], device: torch.device, *, data_ranks: list[int] | None = None
           ) -> np.ndarray | None:
    """Rank 0: the global rows of the steps in ``rows`` (each rank's slice per step, all
    ranks the same number of steps) as ``(steps, global batch)``; other ranks: None.
    ``data_ranks``: the ranks whose slices make up a global batch, in order (one per
    tensor-parallel group, whose ranks hold the same slice); default every rank."""
    mine = torch.as_tensor(np.stack(rows) if rows else np.zeros((0, 0)), dtype=torch.int64)
    if not dist.is_initialized():
        return mine.numpy().astype(np.int32)
    mine = mine.to(device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    if dist.get_rank() != 0:
        return None
    if data_ranks is not None:
        parts = [parts[r] for r in data_ranks]
    # Data rank r holds slice r of every global batch: concatenating along the batch dimension
    # puts each step's samples in position order.
    return torch.cat(parts, dim=1).cpu().numpy().astype(np.int32)
