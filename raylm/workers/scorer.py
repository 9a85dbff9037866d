"""The reference pass's scorer: the starting model's log-probability of every trained target of
packed preference pairs, written beside the blocks.

A DPO or IPO full fine-tune compares the policy with the model it started from. Holding that
model on every worker beside the policy would double the weights in memory (and under FSDP2
add a second set of all-gathers to every step); scoring the pairs with it once, before
training, costs one forward per pair for the whole run and 4 bytes per token of disk. The
driver (:mod:`raylm.run.reference`) runs this class as the actors of a Ray Data batch-inference
pass; each actor builds the model once and scores row groups of the block files, one at a
time, writing each group's figures as a file of their own with the same rows in the same order
(:func:`raylm.data.streams.reference_file`): the pass spreads over as many actors as there are
row groups, and a reader finds a block's figures at the same (file, row group, row).

The scorer builds the model as a training worker does, from the run's
:class:`raylm.model.spec.ModelSpec` without its adapters (one process, the run's precision and
attention), and sums nothing: it stores each target's log-probability, and the step sums them
with the same segments as the policy's (:func:`raylm.workers.preference.reference_sums`).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from raylm.config import config_from_dict
from raylm.console import quiet_libraries
from raylm.contracts import REFERENCE_COLUMN
from raylm.data.packing import position_ids
from raylm.data.streams import reference_file


class ReferenceScorer:
    """A Ray Data actor: ``{"split", "file", "group"}`` rows in (row groups of the block files
    of ``prepared``), each group's figures written to
    :func:`raylm.data.streams.reference_file` under ``out/{split}``; ``{"split", "file",
    "group", "blocks", "targets"}`` out."""

    def __init__(self, *, config: dict[str, Any], prepared: str, out: str, vocab_size: int,
                 eos_id: int, block_length: int) -> None:
        cfg = config_from_dict(config)
        # Before the model code is imported: its libraries' import-time lines (torchao's about
        # its installation) are quieted as in a training worker.
        quiet_libraries(cfg.run.verbose)
        from raylm.model.spec import ModelSpec

        self.prepared, self.out, self.block_length = prepared, out, block_length
        self.micro_batch = cfg.train.micro_batch_size
        if torch.cuda.is_available():
            device = torch.device("cuda", 0)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(max(1, int(cfg.scaling.cpus_per_worker)))
        # The reference is the starting model itself: no adapters on it.
        spec = ModelSpec.from_config(cfg, vocab_size=vocab_size, eos_id=eos_id)
        self.built = spec.replace(lora=None, base_quantization="none").build(device)
        self.built.model.eval()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        counts = [self.score_group(str(split), str(name), int(group))
                  for split, name, group in zip(batch["split"], batch["file"], batch["group"],
                                                strict=True)]
        return {"split": batch["split"], "file": batch["file"], "group": batch["group"],
                "blocks": np.array([c[0] for c in counts], dtype=np.int64),
                "targets": np.array([c[1] for c in counts], dtype=np.int64)}

    def score_group(self, split: str, name: str, group: int) -> tuple[int, int]:
        """Score row group ``group`` of block file ``name`` and write its figures; returns
        (blocks, trained targets) scored. A retried task writes the same file again."""
        from raylm.workers.preference import reference_logps

        L = self.block_length
        t = pq.ParquetFile(os.path.join(self.prepared, split, name)).read_row_group(
            group, columns=["input_ids", "doc_starts", "loss_mask"])
        tokens = t.column("input_ids").combine_chunks().flatten().to_numpy().reshape(-1, L)
        masks = t.column("loss_mask").combine_chunks().flatten().to_numpy().reshape(-1, L)
        starts = t.column("doc_starts").to_pylist()
        figures = []
        for i in range(0, len(tokens), self.micro_batch):
            rows = slice(i, i + self.micro_batch)
            figures.append(reference_logps(self.built, {
                "input_ids": torch.from_numpy(tokens[rows].astype(np.int64)),
                "position_ids": torch.from_numpy(np.stack(
                    [position_ids(np.asarray(s), L) for s in starts[rows]])),
                "loss_mask": torch.tensor(masks[rows])}).numpy())
        column = pa.FixedSizeListArray.from_arrays(
            pa.array(np.concatenate(figures).reshape(-1), type=pa.float32()), L - 1)
        folder = os.path.join(self.out, split)
        os.makedirs(folder, exist_ok=True)
        pq.write_table(pa.table({REFERENCE_COLUMN: column}),
                       reference_file(folder, name, group), row_group_size=len(tokens))
        return len(tokens), int((masks[:, 1:] > 0).sum())
