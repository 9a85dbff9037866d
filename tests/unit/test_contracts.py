"""The records read back by a process other than their writer's (raylm.contracts): each
round-trips through its JSON, refuses what is not of its shape, and reads what raylm wrote
before it had versions: tests/fixtures/run-6ef9b7a is a run directory written by raylm at
commit 6ef9b7a (a 4-step tiny run on one worker, its checkpoint's DCP shards left out), and its
lease.json one that release's driver held; tests/fixtures/run-cb5e3f1-grpo one of commit
cb5e3f1 (`raylm train --config jobs/configs/grpo_larger_digit.yaml --train.steps=4
--checkpoint.every=2 --rl.max_staleness=1 --rl.group_size=4`, the task's model warmed 20
steps), its step-2 checkpoint's shards left out and the rollouts it kept for step 3 in."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import pytest

from raylm import faults, rundir
from raylm.contracts import LEASE, LeaseRecord, Malformed, Marker, RunInfo

OLD = Path(__file__).resolve().parents[1] / "fixtures" / "run-6ef9b7a"
GRPO = Path(__file__).resolve().parents[1] / "fixtures" / "run-cb5e3f1-grpo"
MARKER = Marker(state={"step": 7, "tokens_seen": 896, "clock": {"t": 1.5}},
                model={"model_type": "llama", "hidden_size": 64}, files={"__0_0.distcp": 10},
                hashes={"__0_0.distcp": "ab"}, world_size=2, adapters={"r": 8},
                identity={"data": "d", "tokenizer": "t"})
HOLDER = LeaseRecord(host="h", pid=42, started=1.0e9, beat=1.0e9 + 5, token="t", owner="trial")
INFO = RunInfo(config={"train": {"steps": 4}}, vocab_size=400, eos_id=0, prepared="p",
               default_template=2)


@pytest.mark.parametrize("record", [MARKER, HOLDER, INFO], ids=["marker", "lease", "run-info"])
def test_a_record_round_trips_through_its_json_with_its_version(record):
    text = record.to_json()
    assert json.loads(text)["version"] == type(record).VERSION == 2
    assert type(record).from_json(text) == record
    assert type(record).from_json(text.encode()) == record


@pytest.mark.parametrize("damage, why", [
    ({"state": {"step": -1}}, "state is not an object with a step number"),
    ({"files": {}}, "files is not an object of sizes, not empty"),
    ({"files": {"a": True}}, "files is not an object of sizes"),
    ({"world_size": 0}, "world_size is not a number of ranks"),
    ({"identity": {"data": 3}}, "identity is not an object of strings"),
    ({"model": None}, "model is not an object"),
    ({"version": 3}, "of version 3, newer than this raylm reads: upgrade raylm"),
])
def test_a_marker_not_of_its_shape_is_refused_naming_what(damage, why):
    data = {**json.loads(MARKER.to_json()), **damage}
    with pytest.raises(Malformed, match=why):
        Marker.from_json(json.dumps(data))


def test_a_record_missing_a_field_or_not_an_object_of_a_version_is_refused():
    with pytest.raises(Malformed, match="state is missing"):
        Marker.from_json(json.dumps({"model": {}, "files": {"a": 1}}))
    with pytest.raises(Malformed, match="not a JSON object"):
        Marker.from_json("[1]")
    with pytest.raises(Malformed, match="not a JSON object of a version"):
        Marker.from_json(json.dumps({**json.loads(MARKER.to_json()), "version": "2"}))


@pytest.mark.parametrize("damage", [{"beat": math.nan}, {"beat": math.inf}, {"started": 1e300},
                                    {"started": None}, {"pid": 0}, {"pid": "7"},
                                    {"token": None}, {"owner": 5}])
def test_a_lease_not_of_its_shape_is_refused(damage):
    data = {**json.loads(HOLDER.to_json()), **damage}
    text = json.dumps(data, allow_nan=True)
    with pytest.raises(Malformed, match=f"{LEASE} is malformed"):
        LeaseRecord.from_json(text)


def test_a_lease_given_back_names_no_holder():
    assert LeaseRecord.from_json(LeaseRecord.RELEASED) is None


@pytest.fixture
def old(tmp_path) -> Path:
    return Path(shutil.copytree(OLD, tmp_path / "old"))


def test_a_run_directory_of_6ef9b7a_reads_back(old):
    from raylm.api import Run
    from raylm.run import record

    marker = Marker.from_json((old / "checkpoint_000004" / "raylm_checkpoint.json").read_text())
    assert marker.step == 4 and marker.world_size == 1 and marker.adapters == {}
    assert set(marker.identity) == {"data", "format", "tokenizer", "base_model"}
    assert rundir.check_same_run(marker, marker.identity, "old", accept=[]) == []
    samples = rundir.load_samples(old / "checkpoint_000004")
    assert samples.shape == (4, 4)
    run = Run(old)
    assert run.summary["status"] == "finished" and run.summary["final_step"] == 4
    assert run.config.train.steps == 4 and run.config.scaling.num_workers == 1
    info = rundir.read_run_info(str(old))  # version 1: no version, no template version
    assert (info.vocab_size, info.default_template) == (400, 1)
    assert list(run.history["step"]) == [2, 4]
    # Its events, read again by today's account (which names more causes than it had).
    shares = run.goodput["share"]
    assert 0 < shares["productive"] < 0.1 and shares.sum() == pytest.approx(1, abs=0.01)
    assert record.interruptions(record.read(str(old))) == []


def test_a_lease_of_6ef9b7a_is_read_as_its_holder(old, monkeypatch):
    from raylm.run import lease
    from raylm.run.lease import Lease

    held = LeaseRecord.from_json((old / LEASE).read_text())
    assert held.host == "vm" and held.owner is None and held.beat > held.started > 1.7e9
    faults.check_lease(str(old), held.token)
    with pytest.raises(faults.LeaseLost, match=f"held by pid {held.pid} on vm"):
        faults.check_lease(str(old), "another")
    # Its holder stopped renewing it long ago: a driver of today on another machine (whatever
    # runs as that pid here) watches it unrenewed for the expiry, shortened here, and takes it.
    monkeypatch.setattr(lease.socket, "gethostname", lambda: "not-vm")
    monkeypatch.setattr(lease, "EXPIRES_S", 0.2)
    taken = Lease(str(old), log=lambda m: None).take()
    try:
        now = LeaseRecord.from_json((old / LEASE).read_text())
        assert now.token == taken.token and now.beat > time.time() - 60
        assert dataclasses.replace(now, beat=taken.holder.beat) == taken.holder
    finally:
        taken.release()


def test_a_grpo_run_directory_of_cb5e3f1_reads_back_and_resumes_with_its_kept_rollouts(
        tmp_path, capsys):
    """Its checkpoint's rollouts.json (version 1: no version, no sampling) reads as the groups
    it kept, which a resumed run trains as kept; a file that says it was sampled otherwise than
    the resumed run samples (rl.group_size 4 -> 8) is sampled again, said on the console."""
    from raylm.api import Run
    from raylm.contracts.rollouts import SavedRollouts
    from raylm.workers.grpo import Reinforce

    old = Path(shutil.copytree(GRPO, tmp_path / "old"))
    ckpt = old / "checkpoint_000002"
    marker = Marker.from_json((ckpt / "raylm_checkpoint.json").read_text())
    assert marker.step == 2 and "rollouts.json" in marker.files
    assert rundir.check_same_run(marker, marker.identity, "old", accept=[]) == []
    saved = SavedRollouts.from_json((ckpt / "rollouts.json").read_bytes())
    assert saved.sampling is None and saved.through_step == 2
    assert len(saved.groups) == 8 and {len(g.completions) for g in saved.groups} == {4}
    run = Run(old)
    assert run.summary["status"] == "finished" and run.summary["final_step"] == 4
    assert run.config.train.objective == "grpo" and run.config.rl.group_size == 4
    assert rundir.read_run_info(str(old)).default_template == 2
    assert list(run.history["step"]) == [1, 2, 3, 4] and "rl_reward" in run.history

    def resumed(group_size: int) -> Reinforce:
        cfg = dataclasses.replace(run.config, rl=dataclasses.replace(run.config.rl,
                                                                     group_size=group_size))
        return Reinforce(cfg, prepared=str(old), eos_id=0, vocab_size=300, rank=1)

    again = resumed(4)
    kept = again.kept_groups(str(ckpt / "rollouts.json"), step=2, vocab_size=300)
    assert again.asked == 2 and kept == {g.position: g for g in saved.groups}
    # Written today, the file says how its groups were sampled.
    today = tmp_path / "rollouts.json"
    today.write_text(SavedRollouts(2, saved.groups, again.sampling).to_json())
    assert resumed(4).kept_groups(str(today), step=2, vocab_size=300) == kept
    other = resumed(8)
    assert other.kept_groups(str(today), step=2, vocab_size=300) == {} and other.asked == -1
    assert "sampled otherwise than this run samples (group_size 4 -> 8)" in capsys.readouterr().out


@pytest.mark.parametrize("run", [OLD, GRPO], ids=["6ef9b7a", "cb5e3f1-grpo"])
def test_a_summary_of_an_older_release_reads_as_its_record_and_writes_back_the_same(run):
    """summary.json of version 1 (no version key): its keys, their order and values come back
    unchanged through Summary, an objective's and the validation's figures among them; what
    6ef9b7a did not account yet (a start's phases) is written as null."""
    from raylm.contracts.summary import Summary

    text = (run / "summary.json").read_text()
    summary = rundir.read_summary(str(run))
    assert summary.ended and summary.finished and summary.final_step == 4
    assert list(json.loads(summary.to_json())) == list(json.loads(text))
    written = summary.to_dict()
    if run == OLD:
        assert written["goodput"].pop("startup_phases") is None
    assert written == json.loads(text)
    if run == GRPO:
        assert set(summary.figures) >= {"val_reward", "rl_reward", "rl_kl"}
    running = dataclasses.replace(summary, status="running", wall_s=None, samples=None)
    assert list(running.to_dict()) == [k for k in json.loads(text) if k not in Summary.FINAL]
    assert Summary.from_json(running.to_json()) == running


@pytest.mark.parametrize("damage, why", [
    ({"version": 2}, "of version 2, which this raylm does not read"),
    ({"status": "paused"}, "status 'paused' is not one of"),
    ({"final_step": "4"}, "final_step is '4'"),
    ({"rl_reward": "high"}, "rl_reward is 'high'"),
    ({"restarts": True}, "restarts is True"),
    ({"tokens_per_second": 1.0}, "holds 'tokens_per_second', which raylm's Summary does not"),
])
def test_a_summary_not_of_its_shape_is_refused_naming_what(tmp_path, damage, why):
    data = {**json.loads((OLD / "summary.json").read_text()), **damage}
    (tmp_path / "summary.json").write_text(json.dumps(data))
    with pytest.raises(Malformed, match=why):
        rundir.read_summary(str(tmp_path))
    (tmp_path / "summary.json").write_text('{"invocation": "1"}')
    with pytest.raises(Malformed, match="status is missing"):
        rundir.read_summary(str(tmp_path))
    assert rundir.read_summary(str(tmp_path / "none")) is None


@pytest.mark.parametrize("run", [OLD, GRPO], ids=["6ef9b7a", "cb5e3f1-grpo"])
def test_events_of_an_older_release_read_as_their_records_and_write_back_the_same(run):
    """Each line of events.jsonl is a record of its kind; written again, it is the line it
    was, but for a field that release did not write yet, which is written as null."""
    from raylm.contracts.events import GroupStart, Progress
    from raylm.run import record

    lines = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    records = record.read(str(run))
    assert [r.KIND for r in records] == [line["event"] for line in lines]
    for line, r in zip(lines, records, strict=True):
        written = r.to_dict()
        assert {k: v for k, v in written.items() if k in line} == line
        assert all(written[k] is None for k in set(written) - set(line)), (r.KIND, written)
        assert [k for k in written if k in line] == list(line)
    progress = [r for r in records if isinstance(r, Progress)]
    assert [p.step for p in progress] == ([2, 4] if run == OLD else [1, 2, 3, 4])
    assert isinstance(records[4], GroupStart) and records[4].from_step == 0
    if run == GRPO:
        assert progress[1].figures["val_reward"] is not None and progress[0].loss > 0


@pytest.mark.parametrize("line, why", [
    ({"event": "restarted"}, "of kind 'restarted', which this raylm does not know"),
    ({"event": "failure", "invocation": "1", "time": 1.0, "cause": "x"},
     "a record of kind failure holds 'cause', which raylm's Failure does not name"),
    ({"event": "placed", "invocation": "1", "time": "now"},
     "a record of kind placed: its time is 'now'"),
    ({"event": "end", "invocation": "1", "time": 1.0}, "a record of kind end lacks status"),
    ({"event": "progress", "invocation": "1", "time": 1.0, "step": 2}, "lacks step_time"),
])
def test_an_event_not_of_its_kinds_shape_is_refused_naming_what(line, why):
    from raylm.contracts.events import event_from_dict

    with pytest.raises(Malformed, match=why):
        event_from_dict(line)


def test_the_final_model_the_lost_tracking_and_an_exports_record_round_trip():
    from raylm.contracts import ExportInfo
    from raylm.contracts.events import TrackingLost
    from raylm.contracts.summary import LoggedModel, Summary

    summary = rundir.read_summary(str(OLD))
    logged = dataclasses.replace(
        summary, tracking_lost=TrackingLost(step=3, error="ConnectionError: refused"),
        logged_model=LoggedModel(mlflow_model_uri="models:/m-1", registered_model="tiny",
                                 registered_version=2))
    data = json.loads(logged.to_json())
    assert list(data)[-3:] == ["mlflow_model_uri", "registered_model", "registered_version"]
    assert data["tracking_lost"] == {"step": 3, "error": "ConnectionError: refused"}
    back = Summary.from_json(logged.to_json())
    assert back.logged_model == logged.logged_model and back.tracking_lost.step == 3
    with pytest.raises(Malformed, match="final model is malformed"):
        Summary.from_json(json.dumps({**data, "mlflow_model_uri": 3}))
    info = ExportInfo(kind="gguf-q8_0", step=4, run_dir="/runs/r", default_template=2,
                      details={"file": "model-q8_0.gguf", "bytes": 10})
    assert ExportInfo.from_json(info.to_json()) == info
    assert json.loads(info.to_json())["file"] == "model-q8_0.gguf"
    with pytest.raises(Malformed, match="step is 'four'"):
        ExportInfo.from_json(json.dumps({"kind": "model", "step": "four"}))


def test_a_sweeps_summary_round_trips_with_its_metric_under_its_name():
    from raylm.contracts.summary import SweepSummary, Trial

    def trial(i, ranked, scores=None):  # ranked by the loss, its best loss is its figure
        return Trial(trial_id=i, config={"optim.lr": 1e-3}, ranked=ranked,
                     val_loss=ranked if metric == "val_loss" else 0.5,
                     steps=8, stopped_early=False, error=None, checkpoint_path=f"/t/{i}",
                     history=[[4, 0.6], [8, 0.5]], scores=scores)

    for metric in ("val_loss", "eval/arc_easy/acc"):
        swept = SweepSummary(trials=[trial("a", 0.5, [[8, 0.3]]), trial("b", 0.4)],
                             metric=metric, best_trial="b", trials_dir="/t")
        data = json.loads(swept.to_json())
        assert data["best"] == {"trial_id": "b", "config": {"optim.lr": 1e-3},
                                "val_loss": 0.5 if metric != "val_loss" else 0.4,
                                metric: 0.4, "checkpoint_path": "/t/b"}
        assert data["trials"][0][metric] == 0.5 and "ranked" not in data["trials"][0]
        back = SweepSummary.from_json(swept.to_json())
        assert back.best.trial_id == "b" and back.metric == metric
        assert [t.ranked for t in back.trials] == [0.5, 0.4]
    with pytest.raises(Malformed, match="tune_summary.json is malformed"):
        SweepSummary.from_json('{"trials": [{"trial_id": "a"}]}')
