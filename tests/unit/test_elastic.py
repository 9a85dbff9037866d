"""The arithmetic and bookkeeping behind restarts and resizes (no Ray)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raylm.config import ConfigError, load_config
from raylm.ledger import account, gather
from raylm.packing import SampleOrder, batch_plan, check_positions
from raylm.record import interruptions, summarize


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
    # Every count a run may have divides its global batch: the config refuses others.
    with pytest.raises(ConfigError, match=r"global_batch_size=16 cannot be split equally over 3 "
                                          r"workers, which scaling.num_workers=\[2, 4\] allows"
                                          r".*train.global_batch_size=12\)"):
        load_config(None, ["--scaling.num_workers=[2,4]", "--train.global_batch_size=16"])


def test_check_positions_accepts_only_the_ranks_slice_of_the_step():
    # Global batch 8 on 2 workers: step 3 is positions 24..31, rank 1 holds 28..31.
    check_positions(np.arange(28, 32), step=3, global_batch=8, rank=1, world_size=2)
    with pytest.raises(RuntimeError, match="step 3 needs 28..31"):
        check_positions(np.arange(24, 28), step=3, global_batch=8, rank=1, world_size=2)


def test_interruptions_tell_restarts_from_resizes_with_steps_and_time_lost():
    def rec(event, time, **fields):
        return {"invocation": "i", "event": event, "time": time, **fields}

    records = [
        rec("group_start", 90.0, workers=2, from_step=0),
        rec("progress", 100.0, step=10, step_time=1.0),
        rec("progress", 110.0, step=20, step_time=1.0),
        rec("failure", 113.0, ranks=[1], error="ActorDiedError: node lost"),
        # A group of 1 resumes from the step-20 checkpoint and reports step 25 at t=135:
        # 25 s since the report of step 20, of which 5 steps x 1 s were progress.
        rec("group_start", 120.0, workers=1, from_step=20),
        rec("progress", 135.0, step=25, step_time=2.0),
        rec("progress", 145.0, step=30, step_time=2.0),
        # Grown without a failure, back to the step-25 checkpoint after step 30 was reported:
        # 5 steps to train again; step 35 at t=175 is 30 s after step 30, 5 steps x 2 s of
        # which were progress.
        rec("group_start", 150.0, workers=2, from_step=25),
        rec("progress", 175.0, step=35, step_time=1.0),
        # Lost again before reporting, and a group that never reports.
        rec("failure", 180.0, ranks=[0], error="Preempted: SIGTERM"),
        rec("group_start", 190.0, workers=2, from_step=35),
    ]
    restart, resize, last = interruptions(records)
    assert restart == {"event": "restart", "from_workers": 2, "to_workers": 1, "at_step": 20,
                       "resumed_from_step": 20, "steps_redone": 0, "time_lost_s": 20.0,
                       "failures": 1, "cause": "ActorDiedError: node lost"}
    assert resize["event"] == "resize" and resize["steps_redone"] == 5
    assert (resize["from_workers"], resize["to_workers"]) == (1, 2)
    assert resize["time_lost_s"] == 20.0
    assert last["cause"] == "Preempted: SIGTERM" and last["time_lost_s"] is None
    s = summarize(records)
    assert (s["restarts"], s["resizes"], s["failures"]) == (2, 2, 2)


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


def test_ledger_gather_on_one_process_keeps_each_steps_rows():
    # One process: its slice is the whole batch. The order over 2 ranks is checked by the
    # integration runs, whose ledgers must match the seed's order sample by sample.
    out = gather([np.array([5, 6]), np.array([7, 8])], torch.device("cpu"))
    assert out.dtype == np.int32 and out.tolist() == [[5, 6], [7, 8]]


def test_capacity_check_refuses_unless_the_cluster_autoscales(monkeypatch):
    from raylm import launch

    # The cluster as it is now: one CPU.
    monkeypatch.setattr(launch, "cluster_capacity", lambda: {"CPU": 1.0})
    cfg = load_config(None, ["--scaling.num_workers=2", "--train.global_batch_size=8"])
    with pytest.raises(ValueError, match="needs 2 CPUs but the cluster has 1; .* "
                                         "scaling.wait_for_nodes=true"):
        launch.check_request(cfg)
    waits = load_config(None, ["--scaling.num_workers=2", "--train.global_batch_size=8",
                               "--scaling.wait_for_nodes=true"])
    launch.check_request(waits)
