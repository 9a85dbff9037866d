"""The numerical check (raylm.workers.health): non-finite steps and loss spikes found on the
device, and what a report window's faults make the group do."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raylm.data.packing import Skips, step_positions
from raylm.rundir import empty_manifest
from raylm.workers.health import Fault, Health, decide

CPU = torch.device("cpu")


def run(health: Health, losses: list[float], norms: list[float] | None = None) -> list[float]:
    norms = norms or [1.0] * len(losses)
    return [float(health.check(torch.tensor(x), torch.tensor(n)))
            for x, n in zip(losses, norms, strict=True)]


def test_non_finite_losses_and_norms_are_faults_and_read_at_the_report():
    h = Health(device=CPU, start_step=10, report_every=5)
    flags = run(h, [2.0, math.nan, 2.0, 2.0], [1.0, 1.0, math.inf, 1.0])
    assert flags == [0.0, 1.0, 1.0, 0.0]
    faults = h.read()
    assert [(f.step, f.cause) for f in faults] == [(12, "nonfinite"), (13, "nonfinite")]
    assert math.isnan(faults[0].loss) and math.isinf(faults[1].grad_norm)
    assert h.read() == []  # read once
    run(h, [1.0] * 5)
    assert h.read() == []
    run(h, [1.0] * 5)
    with pytest.raises(RuntimeError, match="without a report"):
        run(h, [1.0])


def test_a_spike_over_the_running_median_after_warmup_and_a_full_window():
    h = Health(device=CPU, start_step=0, report_every=20, spikes=True, factor=2.0, window=4,
               spikes_from=2)
    # The window fills over steps 1-4 (no spike can be called before): 9.0 is not one.
    flags = run(h, [3.0, 9.0, 3.0, 2.9, 2.8, 6.0, 5.0, 2.7, 2.6])
    # At step 6 the window holds 2.8, 9.0, 3.0, 2.9, whose median (the lower middle value)
    # is 2.9: 6.0 > 5.8 is a spike. Its place then stays empty, so at step 7 the median of
    # 2.8, 3.0, 2.9 is 2.9 again, and 5.0 is not one.
    assert flags == [0, 0, 0, 0, 0, 1, 0, 0, 0]
    (spike,) = h.read()
    assert (spike.step, spike.cause, spike.loss) == (6, "spike", 6.0)
    # Spikes off: the same losses make no fault.
    off = Health(device=CPU, start_step=0, report_every=20, window=4)
    assert run(off, [3.0, 9.0, 3.0, 2.9, 2.8, 6.0]) == [0] * 6


B = 4


def decide_for(faults, *, policy, manifest=None, resumed=None, skips=None, max_rewinds=2,
               culprits=None):
    return decide(faults, policy=policy,
                  positions_of=lambda s: step_positions(s, global_batch=B, skips=skips or Skips()),
                  rows_of=lambda p: np.asarray(p) * 10, manifest=manifest or empty_manifest(),
                  max_rewinds=max_rewinds, resumed=resumed,
                  culprits_of=lambda step: (culprits or {}).get(step),
                  # Row r holds line r of c.jsonl.
                  documents_of=lambda rows: [{"file": "c.jsonl", "line": int(r)} for r in rows])


NAN = Fault(step=7, cause="nonfinite", loss=math.nan, grad_norm=math.nan)
SPIKE = Fault(step=9, cause="spike", loss=8.0, grad_norm=2.0)
BOTH = {"nonfinite": "rewind", "spike": "skip"}


def test_skip_records_positions_and_rows():
    d = decide_for([NAN, SPIKE], policy={"nonfinite": "skip", "spike": "skip"})
    assert d.action == "skip" and d.manifest is None
    assert [r["positions"] for r in d.records] == [[[24, 28]], [[32, 36]]]
    assert d.records[0]["rows"] == [240, 250, 260, 270]


def test_a_rewind_leaves_out_the_rewound_steps_and_a_repeat_stops():
    d = decide_for([NAN, SPIKE], policy=BOTH, resumed=("checkpoint_b", 4))
    assert d.action == "rewind"
    assert d.manifest["ranges"] == [[24, 28]]  # the spike's action was skip: trained again
    assert d.manifest["faults"][0]["left_out"] == [[24, 28]]
    # The same step faults again after the rewind (on the positions after those left out).
    again = Fault(step=7, cause="nonfinite", loss=math.inf, grad_norm=1.0)
    d2 = decide_for([again], policy=BOTH, manifest=d.manifest, resumed=("checkpoint_b", 4),
                    skips=Skips(d.manifest["ranges"]))
    assert d2.action == "rewind" and d2.records[0]["positions"] == [[28, 32]]
    assert d2.manifest["ranges"] == [[24, 32]]
    d3 = decide_for([again], policy=BOTH, manifest=d2.manifest, resumed=("checkpoint_b", 4),
                    skips=Skips(d2.manifest["ranges"]))
    assert d3.action == "stop" and "after 2 rewinds" in d3.message
    assert "train.max_rewinds=2" in d3.message


def test_a_non_finite_first_step_after_a_restore_marks_the_checkpoint_bad():
    d = decide_for([NAN], policy=BOTH, resumed=("checkpoint_b", 6))
    assert d.action == "rewind" and d.manifest["bad_checkpoints"] == ["checkpoint_b"]
    assert d.manifest["ranges"] == [] and "marked bad" in d.message
    # From the checkpoint before it, the data is at fault after all: it is left out.
    d2 = decide_for([NAN], policy=BOTH, manifest=d.manifest, resumed=("checkpoint_a", 2))
    assert d2.manifest["ranges"] == [[24, 28]]


def test_a_second_checkpoint_failing_at_once_stops_instead_of_marking_every_one_bad():
    """A device whose loss is not finite at every step fails right after each restore: the
    first checkpoint is marked bad, the one before it failing at once as well stops the run
    (keeping it), rather than marking them all and starting over from step 0."""
    d = decide_for([NAN], policy=BOTH, resumed=("checkpoint_b", 6))
    first_after_a = Fault(step=3, cause="nonfinite", loss=math.nan, grad_norm=math.nan)
    d2 = decide_for([first_after_a], policy=BOTH, manifest=d.manifest,
                    resumed=("checkpoint_a", 2))
    assert d2.action == "stop" and d2.manifest is None
    assert "as after checkpoint_b before it" in d2.message and "checkpoint_a kept" in d2.message


def test_a_skip_manifest_that_does_not_hold_together_is_refused(tmp_path):
    import json

    from raylm.rundir import check_manifest, describe_manifest, read_manifest

    d = decide_for([NAN], policy=BOTH, resumed=("checkpoint_b", 4))
    good = d.manifest
    check_manifest(good, where="m")
    assert describe_manifest(good) == ("skipped_samples.json leaves out 4 sample positions "
                                       "(1 ranges, from 1 rewinds)")
    assert describe_manifest(empty_manifest()) is None
    broken = [
        ({**good, "ranges": [[0, 10 ** 12]]}, "its ranges are not those its faults left out"),
        ({**good, "faults": [{**good["faults"][0], "left_out": [[100, 104]]}],
          "ranges": [[100, 104]]}, "leaves out positions its step did not train"),
        ({**good, "bad_checkpoints": ["checkpoint_b"]}, "marks checkpoint_b bad with no fault"),
        ({**good, "faults": [{"step": 7}]}, r"a record is malformed \(KeyError"),
        ([], "lacks the lists"),
    ]
    for manifest, why in broken:
        with pytest.raises(ValueError, match=why):
            check_manifest(manifest, where="m")
    (tmp_path / "skipped_samples.json").write_text(json.dumps(broken[0][0]))
    with pytest.raises(ValueError, match="skipped_samples.json: its ranges are not those"):
        read_manifest(str(tmp_path))


def test_stop_names_the_setting_and_the_step():
    d = decide_for([SPIKE], policy={"nonfinite": "skip", "spike": "stop"})
    assert d.action == "stop" and "train.on_spike=stop" in d.message and "step 9" in d.message


def test_a_rewind_leaves_out_only_the_samples_at_fault_on_their_own():
    d = decide_for([NAN, SPIKE], policy={"nonfinite": "rewind", "spike": "rewind"},
                   culprits={7: np.array([25, 27])})
    assert d.manifest["ranges"] == [[25, 26], [27, 28], [32, 36]]  # the spike: its step
    assert d.records[0]["culprits"] == [[25, 26], [27, 28]]
    # The documents of the samples at fault; of the whole step where none is known.
    assert [x["line"] for x in d.records[0]["documents"]] == [250, 270]
    assert d.records[1]["documents_total"] == 4 and d.manifest["faults"][0]["documents"]
    assert "leaves out sample positions 25-25, 27-27, 32-35" in d.message
    # What the run's record keeps of each (raylm.contracts.events), every field named.
    from raylm.contracts.events import NumericalFault

    assert [NumericalFault(**r).culprits for r in d.records] == [[[25, 26], [27, 28]], None]
    # No sample at fault on its own (a fault of the whole batch): the step is left out.
    d = decide_for([NAN], policy=BOTH, culprits={7: np.array([], dtype=np.int64)})
    assert d.manifest["ranges"] == [[24, 28]] and "culprits" not in d.records[0]
