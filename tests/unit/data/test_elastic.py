"""The arithmetic and bookkeeping behind restarts and resizes (no Ray)."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest
import torch

from raylm.config import ConfigError, batch_plan, load_config
from raylm.contracts.events import event_from_dict
from raylm.data.packing import (
    SampleOrder,
    Skips,
    as_ranges,
    check_positions,
    rank_positions,
    step_positions,
)
from raylm.run.record import interruptions, summarize
from raylm.rundir import account_samples as account
from raylm.workers.ledger import Ledger, gather


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
        return event_from_dict({"invocation": "i", "event": event, "time": time, **fields})

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
    assert asdict(restart) == {
        "event": "restart", "from_workers": 2, "to_workers": 1, "at_step": 20,
        "resumed_from_step": 20, "steps_redone": 0, "time_lost_s": 20.0, "failures": 1,
        "cause": "ActorDiedError: node lost"}
    assert resize.event == "resize" and resize.steps_redone == 5
    assert (resize.from_workers, resize.to_workers) == (1, 2)
    assert resize.time_lost_s == 20.0
    assert last.cause == "Preempted: SIGTERM" and last.time_lost_s is None
    s = summarize(records)
    assert (s.restarts, s.resizes, s.failures) == (2, 2, 2)


def test_ledger_accounting_counts_duplicates_and_gaps():
    sizes, seed, window, batch = [4, 4, 4, 4, 4], 3, 2, 4  # 5 steps = one epoch
    order = SampleOrder(sizes, seed=seed, window=window, global_batch=batch)
    rows = order.rows(np.arange(5 * batch))
    ledger = rows.reshape(5, batch).astype(np.int32)
    got = account(ledger, group_sizes=sizes, seed=seed, window=window)
    assert got == {"steps": 5, "trained": 20, "duplicated": 0, "skipped": 0, "withheld": 0,
                   "in_order": True, "left_out": 0}
    # Step 4 trained on step 3's rows: 4 samples twice, 4 never.
    bad = ledger.copy()
    bad[3] = bad[2]
    got = account(bad, group_sizes=sizes, seed=seed, window=window)
    assert (got["duplicated"], got["skipped"], got["in_order"]) == (4, 4, False)
    # The same samples in another order are neither duplicated nor skipped, but not in order.
    got = account(ledger[::-1], group_sizes=sizes, seed=seed, window=window)
    assert (got["duplicated"], got["skipped"], got["in_order"]) == (0, 0, False)


def test_ledger_accounting_of_withheld_steps_and_left_out_positions():
    sizes, seed, window, batch = [4, 4, 4, 4, 4], 3, 2, 4
    order = SampleOrder(sizes, seed=seed, window=window, global_batch=batch)
    # Positions 6..9 left out: step 1 trains 4, 5, 10, 11, and the run ends at position 17.
    skips = [[6, 10]]
    rows = order.rows(Skips(skips).positions(np.arange(4 * batch))).reshape(4, batch)
    ledger = rows.astype(np.int32)
    got = account(ledger, group_sizes=sizes, seed=seed, window=window, skips=skips)
    assert got == {"steps": 4, "trained": 16, "duplicated": 0, "skipped": 0, "withheld": 0,
                   "in_order": True, "left_out": 4}
    # Without the ranges, the same rows are out of order (and 4 samples trained early).
    assert not account(ledger, group_sizes=sizes, seed=seed, window=window)["in_order"]
    # Step 3's update kept from the weights: its rows stored as -1 - row.
    held = Ledger(enabled=True, history=np.zeros((0, batch), np.int32))
    for r in ledger:
        held.add(r)
    held.withhold(1)
    got = account(held.collect(torch.device("cpu")), group_sizes=sizes, seed=seed,
                  window=window, skips=skips)
    assert (got["trained"], got["withheld"], got["skipped"], got["in_order"]) == (
        12, 4, 4, True)


def test_skips_map_slots_to_the_positions_left_in():
    skips = Skips([[25, 30], [10, 20], [12, 15]])  # unsorted, overlapping: merged
    assert skips.ranges == [[10, 20], [25, 30]]
    slots = np.arange(30)
    positions = skips.positions(slots)
    kept = [p for p in range(45) if not (10 <= p < 20 or 25 <= p < 30)][:30]
    assert positions.tolist() == kept
    assert Skips().positions(slots).tolist() == slots.tolist()
    assert as_ranges(np.array([3, 4, 5, 9, 11, 12])) == [[3, 6], [9, 10], [11, 13]]
    # Every worker count reads the same positions at a step, rank slices in order.
    for world in (1, 2, 4):
        got = np.concatenate([rank_positions(np.arange(8 // world), start_step=2,
                                             global_batch=8, rank=r, world_size=world,
                                             skips=skips) for r in range(world)])
        assert got.tolist() == step_positions(2, global_batch=8, skips=skips).tolist()
        assert got.tolist() == kept[16:24]
    with pytest.raises(ValueError, match=r"\[start, end\)"):
        Skips([[5, 5]])


def test_ledger_gather_on_one_process_keeps_each_steps_rows():
    # One process: its slice is the whole batch. The order over 2 ranks is checked by the
    # integration runs, whose ledgers must match the seed's order sample by sample.
    out = gather([np.array([5, 6]), np.array([7, 8])], torch.device("cpu"))
    assert out.dtype == np.int32 and out.tolist() == [[5, 6], [7, 8]]


def test_resource_plan_counts_workers_and_readers():
    from raylm.run.resources import plan_resources

    # The device is decided first (raylm.run.resources.choose_device): CPU workers here.
    two = ["--scaling.num_workers=2", "--train.global_batch_size=8", "--scaling.use_gpu=false"]
    # Two 1-CPU workers on 3 CPUs: each reader gets its 0.1 CPU beside them.
    plan = plan_resources(load_config(None, two), {"CPU": 3.0})
    assert plan.worker == {"CPU": 1.0} and plan.reader == {"CPU": 0.1} and plan.note is None
    # On 2 CPUs (this machine, default settings) that would wait forever: the readers ask for
    # no CPU of their own, and the run says so.
    plan = plan_resources(load_config(None, two), {"CPU": 2.0})
    assert plan.reader == {"CPU": 0.0}
    assert plan.note == ("2 training workers of 1 CPU each leave less than 0.1 CPU per data "
                         "reader on the cluster's 2 CPUs; the readers ask for no CPU of their "
                         "own (data.reader_cpus=0)")
    # An elastic range decides by its largest count, so that the group can grow.
    plan = plan_resources(load_config(None, ["--scaling.num_workers=[1, 2]",
                                             "--train.global_batch_size=8", *two[2:]]),
                          {"CPU": 2.0})
    assert plan.reader_cpus == 0.0
    # What the user set is kept, and refused with the arithmetic when it does not fit.
    with pytest.raises(ValueError, match=r"^the run needs 2.2 CPU: scaling.num_workers=2 "
                                         r"starts 2 workers x \(1 for the worker \+ 0.1 for its "
                                         r"data reader\), but the cluster has 2; "
                                         r"scaling.num_workers=1 or scaling.cpus_per_worker=0.9 "
                                         r"or data.reader_cpus=0 would fit, or set "
                                         r"scaling.wait_for_nodes=true"):
        plan_resources(load_config(None, [*two, "--data.reader_cpus=0.1"]), {"CPU": 2.0})
    with pytest.raises(ValueError, match=r"needs 2 CPU: .* has 1; scaling.num_workers=1 or "
                                         r"scaling.cpus_per_worker=0.5 would fit"):
        plan_resources(load_config(None, two), {"CPU": 1.0})
    # Custom and GPU resources of workers and readers are counted alike.
    data = load_config(None, [*two, "--scaling.data_resources={data_node: 0.001}"])
    assert plan_resources(data, {"CPU": 4, "data_node": 1000}).reader == {
        "CPU": 0.1, "data_node": 0.001}
    with pytest.raises(ValueError, match=r"needs 0.002 data_node: .* \(0 for the worker \+ "
                                         r"0.001 for its data reader\), but the cluster has 0; "
                                         r"add nodes"):
        plan_resources(data, {"CPU": 4})
    gpu = load_config(None, [*two, "--scaling.use_gpu=true"])
    with pytest.raises(ValueError, match=r"needs 2 GPU: .* has 1; scaling.num_workers=1 would"):
        plan_resources(gpu, {"CPU": 16, "GPU": 1})
    # An autoscaling cluster is not checked: the autoscaler adds what the run asks for.
    waits = load_config(None, [*two, "--scaling.wait_for_nodes=true"])
    assert plan_resources(waits, None).reader_cpus == 0.1


def test_generators_are_placed_first_and_the_trainers_plan_around_them():
    from raylm.run.resources import plan_resources

    grpo = ["--train.objective=grpo", "--data.format=prompt", "--rl.reward=exact_match",
            "--scaling.use_gpu=false", "--scaling.num_workers=1"]
    # One 1-CPU generator on 2 CPUs leaves one for the trainer; its reader shares it.
    plan = plan_resources(load_config(None, grpo), {"CPU": 2.0})
    assert plan.worker == {"CPU": 1.0} and plan.reader == {"CPU": 0.0}
    with pytest.raises(ValueError, match=r"needs 1 CPU: .* but the cluster has 0"):
        plan_resources(load_config(None, [*grpo, "--rl.generators=2"]), {"CPU": 2.0})
    with pytest.raises(ValueError, match=r"^rl.generators=3 of rl.generator_resources="
                                         r"\{'CPU': 1.0\} need 3 CPU, but the cluster has 2"):
        plan_resources(load_config(None, [*grpo, "--rl.generators=3"]), {"CPU": 2.0})
    # A range: the fewest are placed beside the trainers, the rest take what is left.
    ranged = load_config(None, [*grpo, "--rl.generators=[1, 3]"])
    assert ranged.rl.generator_range == (1, 3)
    assert plan_resources(ranged, {"CPU": 2.0}).worker == {"CPU": 1.0}
