"""The arithmetic and bookkeeping behind restarts and resizes (no Ray)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raylm.events import RunEvents, summarize
from raylm.ledger import account, gather
from raylm.packing import SampleOrder
from raylm.train import batch_plan, check_positions


def test_batch_plan_keeps_the_global_batch_for_every_worker_count():
    # 16 sequences, micro-batches of at most 8.
    assert batch_plan(16, 8, 1) == (8, 2)
    assert batch_plan(16, 8, 2) == (8, 1)
    assert batch_plan(16, 8, 4) == (4, 1)
    assert batch_plan(16, 8, 16) == (1, 1)
    # 24 on 2 workers: 12 each, no 8 divides 12, so 2 x 6 rather than memory above 8.
    assert batch_plan(24, 8, 2) == (6, 2)
    for world in (1, 2, 3, 4, 6, 8, 12, 24):
        micro, acc = batch_plan(24, 8, world)
        assert micro * acc * world == 24 and micro <= 8
    with pytest.raises(ValueError, match="global_batch_size=16 does not divide by 3 workers"):
        batch_plan(16, 8, 3)


def test_check_positions_accepts_only_the_ranks_slice_of_the_step():
    # Global batch 8 on 2 workers: step 3 is positions 24..31, rank 1 holds 28..31.
    check_positions(np.arange(28, 32), step=3, global_batch=8, rank=1, world_size=2)
    with pytest.raises(RuntimeError, match="step 3 needs 28..31"):
        check_positions(np.arange(24, 28), step=3, global_batch=8, rank=1, world_size=2)


def group(started, workers, from_step):
    return {"started": started, "workers": workers, "from_step": from_step}


def test_run_events_tell_restarts_from_resizes_with_steps_and_time_lost():
    ev = RunEvents("inv")
    assert ev.group_started(group(1.0, 2, 0), now=90.0)["event"] == "start"
    ev.report({"step": 10, "elapsed_s": 10.0}, now=100.0)
    ev.report({"step": 20, "elapsed_s": 20.0}, now=110.0)  # 1 s per step
    ev.failure(ranks=[1], error="ActorDiedError: node lost", now=113.0)
    # A group of 1 worker is ready at t=125, resuming from the step-20 checkpoint: 15 s
    # without progress since the report of step 20, nothing to train again.
    restart = ev.group_started(group(2.0, 1, 20), now=125.0)
    assert restart == {"invocation": "inv", "event": "restart", "time": 125.0,
                       "from_workers": 2, "to_workers": 1, "at_step": 20,
                       "resumed_from_step": 20, "steps_redone": 0, "time_lost_s": 15.0,
                       "failures": 1, "cause": "ActorDiedError: node lost"}
    ev.report({"step": 30, "elapsed_s": 20.0}, now=145.0)  # 2 s per step
    # Grown without a failure, back to the step-25 checkpoint after step 30 was reported:
    # 5 s idle plus 5 steps x 2 s to train again.
    resize = ev.group_started(group(3.0, 2, 25), now=150.0)
    assert resize["event"] == "resize" and resize["steps_redone"] == 5
    assert (resize["from_workers"], resize["to_workers"]) == (1, 2)
    assert resize["time_lost_s"] == 15.0
    s = summarize(ev.records)
    assert (s["restarts"], s["resizes"], s["failures"]) == (1, 2, 1)
    assert [i["event"] for i in s["interruptions"]] == ["restart", "resize"]


def test_ledger_accounting_counts_duplicates_and_gaps():
    sizes, seed, window, batch = [4, 4, 4, 4, 4], 3, 2, 4  # 5 steps = one epoch
    rows = SampleOrder(sizes, seed=seed, window=window).rows(np.arange(5 * batch))
    ledger = rows.reshape(5, batch).astype(np.int32)
    got = account(ledger, group_sizes=sizes, seed=seed, window=window)
    assert got == {"steps": 5, "trained": 20, "duplicated": 0, "skipped": 0, "in_order": True}
    # Step 4 trained on step 3's rows: 4 samples twice, 4 never.
    bad = ledger.copy()
    bad[3] = bad[2]
    got = account(bad, group_sizes=sizes, seed=seed, window=window)
    assert (got["duplicated"], got["skipped"], got["in_order"]) == (4, 4, False)
    # The same samples in another order are neither duplicated nor skipped, but not in order.
    got = account(ledger[::-1], group_sizes=sizes, seed=seed, window=window)
    assert (got["duplicated"], got["skipped"], got["in_order"]) == (0, 0, False)


def test_ledger_gathers_rank_slices_into_position_order():
    # One process: its slices are the whole batch.
    out = gather([np.array([5, 6]), np.array([7, 8])], torch.device("cpu"))
    assert out.dtype == np.int32 and out.tolist() == [[5, 6], [7, 8]]
