"""The stored reference of a DPO full fine-tune (raylm.workers.scorer, the scorer of the
reference pass, and its figures read beside the blocks): a file for each row group of blocks,
figures that follow their blocks whatever the order and resume point, and a step that equals
DPO against a second, frozen copy of the starting model."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from raylm.config import DpoConfig, load_config
from raylm.contracts import REFERENCE_COLUMN
from raylm.data.preparation import BlockWriter
from raylm.data.streams import PackedSplit, _ReadBlocks, reference_file
from raylm.model.assemble import build_training_model
from raylm.workers.preference import (
    answer_segments,
    pair_losses,
    pair_terms,
    preference_step,
    scored,
)
from raylm.workers.scorer import ReferenceScorer
from tests.pairs import pair_blocks

VOCAB, SEQ, BLOCKS, GROUP = 96, 64, 10, 4


# The scorer builds what training builds from the run's config; build() is that model.
CONFIG = load_config(None, ["--model.preset=tiny", "--train.precision=fp32",
                            "--data.format=preference", "--train.objective=dpo",
                            "--dpo.loss=simpo",
                            "--train.micro_batch_size=3", "--train.global_batch_size=6",
                            "--scaling.cpus_per_worker=1"])


def build():
    return build_training_model(preset="tiny", path=None, vocab_size=VOCAB, eos_id=0,
                                device=torch.device("cpu"), precision="fp32", seed=0,
                                cross_document=CONFIG.data.across_documents)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """Ten blocks of pairs in row groups of 4, 4 and 2, and their reference figures as the
    pass writes them, scored by the model :func:`build` makes."""
    root = tmp_path_factory.mktemp("reference")
    batch = pair_blocks(BLOCKS, seq=SEQ, vocab=VOCAB, seed=3)
    writer = BlockWriter(root / "prepared" / "train", block_length=SEQ + 1, group_rows=GROUP,
                         loss_mask=True)
    starts = [np.nonzero(p.numpy() == 0)[0] for p in batch["position_ids"]]
    writer.add(batch["input_ids"].numpy().astype(np.int32), starts,
               [np.zeros(len(s), np.int64) for s in starts], batch["loss_mask"].numpy())
    writer.close()
    # Micro-batches of 3: not a divisor of the row groups, so the last of a group is short.
    scorer = ReferenceScorer(config=CONFIG.to_dict(), prepared=str(root / "prepared"),
                             out=str(root / "ref"), vocab_size=VOCAB, eos_id=0,
                             block_length=SEQ + 1)
    (name,) = writer.files
    # Groups in any order, as the pass's actors take them.
    out = scorer({"split": np.array(["train"] * 3), "file": np.array([name] * 3),
                  "group": np.array([2, 0, 1])})
    split = PackedSplit(str(root / "prepared" / "train"), writer.files, writer.group_sizes,
                        writer.file_groups, SEQ + 1, loss_mask=True,
                        reference=str(root / "ref" / "train"))
    return batch, split, out


def test_each_row_group_gets_a_file_of_each_trained_targets_logp(stored):
    batch, split, out = stored
    (name,) = split.files
    files = [pq.ParquetFile(reference_file(split.reference, name, g)) for g in range(3)]
    assert [f.metadata.num_rows for f in files] == split.row_group_sizes == [4, 4, 2]
    assert all(f.num_row_groups == 1 for f in files)
    trained = batch["loss_mask"][:, 1:] > 0
    assert out["group"].tolist() == [2, 0, 1] and out["blocks"].tolist() == [2, 4, 4]
    assert out["targets"].sum() == int(trained.sum())
    ref = torch.tensor([row for f in files for row in f.read().column(REFERENCE_COLUMN)
                        .to_pylist()], dtype=torch.float32)
    assert ref.shape == (BLOCKS, SEQ) and (ref[~trained] == 0).all() and (ref[trained] < 0).all()
    # The answers' sums are the model's, as the step scores them in one batch.
    segments, pairs = answer_segments(batch["position_ids"], batch["loss_mask"])
    model = build()
    model.model.eval()
    with torch.no_grad():
        direct = scored(model, batch, segments, pairs)
    logp = torch.log_softmax(model.model(input_ids=batch["input_ids"][:, :-1],
                                         position_ids=batch["position_ids"][:, :-1]
                                         ).logits, -1)
    picked = logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(ref[trained], picked[trained].detach(), rtol=0, atol=1e-5)
    sums = torch.zeros(2 * pairs).index_add(0, segments[trained], ref[trained])
    torch.testing.assert_close(sums[0::2], direct.chosen, rtol=0, atol=1e-4)
    torch.testing.assert_close(sums[1::2], direct.rejected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("world, rank, start_step", [(1, 0, 0), (2, 1, 3), (3, 2, 1)])
def test_the_figures_come_with_their_blocks_in_any_order_and_from_any_step(
        stored, world, rank, start_step):
    batch, split, _ = stored
    reader = _ReadBlocks(split, mode="train", seed=7, window=2, rank=rank, world_size=world,
                         start_step=start_step, global_batch=6)
    got = reader({"id": np.arange(6, dtype=np.int64)})
    direct = _ReadBlocks(split, mode="eval", seed=0, window=1, rank=0, world_size=1)(
        {"id": np.arange(BLOCKS, dtype=np.int64)})
    for i, row in enumerate(got["row"]):
        assert (got["input_ids"][i] == batch["input_ids"][row].numpy()).all()
        assert (got[REFERENCE_COLUMN][i] == direct[REFERENCE_COLUMN][row]).all()


# The first loss, where the policy is its reference: ln 2 for DPO, (1 / (2 beta))^2 for IPO.
FIRST = {"sigmoid": math.log(2), "ipo": 1.0}


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_on_the_stored_reference_equals_dpo_against_a_frozen_copy(stored, loss):
    """Two steps of a full fine-tune: the first loss is the one of a policy equal to its
    reference, and the second step's loss and gradients are those scored against a second
    model held frozen at the starting weights (the way a trainer with a reference model
    computes it)."""
    _, split, _ = stored
    reader = _ReadBlocks(split, mode="eval", seed=0, window=1, rank=0, world_size=1)
    batch = {k: torch.from_numpy(v) for k, v in reader({"id": np.arange(6)}).items()}
    objective = DpoConfig(loss=loss, beta=0.5)
    built = build()
    frozen = copy.deepcopy(built.model).eval()
    sgd = torch.optim.SGD(built.model.parameters(), lr=0.5)
    first, _, figures = preference_step(built, sgd, [batch], accumulation=1,
                                        objective=objective, grad_clip=0.0)
    assert float(first) == pytest.approx(FIRST[loss], abs=1e-5)
    assert abs(float(figures["margin"])) < 1e-5
    summed, _ = pair_terms(built, batch, objective)
    built.model.zero_grad()
    summed.backward()
    stored_grads = [p.grad.clone() for p in built.model.parameters()]
    segments, pairs = answer_segments(batch["position_ids"], batch["loss_mask"])
    with torch.no_grad():
        reference = scored(dataclasses.replace(built, model=frozen), batch, segments, pairs)
    policy = scored(built, batch, segments, pairs)
    losses, _ = pair_losses(policy, reference, DpoConfig(loss=loss, beta=0.5))
    assert float(losses.sum().detach()) == pytest.approx(float(summed), abs=1e-5)
    assert float(summed) / pairs < FIRST[loss] - 1e-3  # the first step moved the policy
    built.model.zero_grad()
    losses.sum().backward()
    for a, b in zip(stored_grads, (p.grad for p in built.model.parameters()), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
