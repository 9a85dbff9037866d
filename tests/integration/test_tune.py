"""`raylm tune` on a local Ray cluster: trials of the tiny preset, one worker each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raylm.config import load_config
from tests.conftest import save_tiny_llama, tiny_run, tokenizer_vocab

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("tune")
    return [*tiny_run(root, tokenizer_dir), "--train.global_batch_size=8",
            "--train.micro_batch_size=4", "--train.steps=30",
            "--train.eval_every=5", "--train.eval_batches=2", "--scaling.num_workers=1",
            "--optim.warmup_steps=2",
            # Grid over 3 peak LRs from 1e-2 down to 1e-6: the last cannot learn in 30 steps.
            "--tune.search=grid", "--tune.lr_points=3", "--tune.lr_min=1e-6",
            "--tune.lr_max=1e-2", "--tune.schedules=[constant]", "--tune.max_concurrent=2"]


@pytest.fixture(scope="module")
def swept(base):
    from raylm.sweep import sweep

    return sweep(load_config(None, [*base, "--run.name=sweep"]), log=print)


def test_sweep_stops_bad_trials_early_and_picks_the_best(base, swept):
    trials = swept["trials"]
    assert len(trials) == 3
    lrs = sorted(t["config"]["optim.lr"] for t in trials)
    assert lrs == pytest.approx([1e-6, 1e-4, 1e-2])
    assert any(t["stopped_early"] for t in trials), trials
    finished = [t for t in trials if not t["stopped_early"]]
    assert finished and all(t["steps"] == 30 for t in finished)
    best = min(trials, key=lambda t: t["val_loss"])
    assert swept["best"]["trial_id"] == best["trial_id"]
    assert swept["best"]["val_loss"] == best["val_loss"]
    assert best["config"]["optim.lr"] >= 1e-3  # the slow LRs cannot win in 30 steps
    assert swept["best"]["checkpoint_path"]
    worst = min(trials, key=lambda t: t["config"]["optim.lr"])
    assert worst["stopped_early"] and worst["steps"] < 30
    root = next(a for a in base if a.startswith("--run.storage_path=")).split("=", 1)[1]
    rd = Path(root) / "sweep"
    assert json.loads((rd / "tune_summary.json").read_text()) == swept
    assert (rd / "val_loss.png").stat().st_size > 10_000
    # best.yaml is a config that loads as it is, with the best trial's values.
    best_cfg = load_config(rd / "best.yaml")
    assert best_cfg.optim.lr == pytest.approx(best["config"]["optim.lr"])
    assert best_cfg.run.name == "sweep-best"
    # The Python API reads the same sweep back: trials and curves as DataFrames.
    import raylm

    opened = raylm.Sweep(rd)
    frame = opened.trials
    assert len(frame) == 3 and {"optim.lr", "val_loss", "stopped_early"} <= set(frame)
    assert frame.loc[frame["val_loss"].idxmin(), "trial_id"] == best["trial_id"]
    curves = opened.curves
    assert set(curves["trial_id"]) == {t["trial_id"] for t in trials}
    assert curves.groupby("trial_id")["val_loss"].min().min() == best["val_loss"]
    assert opened.best_config.optim.lr == pytest.approx(best["config"]["optim.lr"])


def test_mlflow_holds_one_parent_and_a_child_per_trial(swept):
    from mlflow import MlflowClient

    client = MlflowClient(swept["mlflow_tracking_uri"])
    parent = client.get_run(swept["mlflow_parent_run_id"])
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == 3
    best = [c for c in children if c.data.tags.get("raylm.best") == "true"]
    assert len(best) == 1 and parent.data.tags["raylm.best_run_id"] == best[0].info.run_id
    assert parent.data.metrics["best_val_loss"] == pytest.approx(swept["best"]["val_loss"])
    assert float(parent.data.tags["raylm.best.optim.lr"]) == pytest.approx(
        swept["best"]["config"]["optim.lr"])
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"tune_summary.json", "val_loss.png"} <= artifacts
    stopped = {t["trial_id"] for t in swept["trials"] if t["stopped_early"]}
    for child in children:
        history = client.get_metric_history(child.info.run_id, "val_loss")
        assert history and history[0].step == 5
        early = child.data.tags["raylm.run_name"] in stopped
        assert child.info.status == ("KILLED" if early else "FINISHED")


def test_bad_sweeps_fail_before_any_trial(base):
    from raylm.config import ConfigError
    from raylm.sweep import sweep

    with pytest.raises(ConfigError, match="tune.lr_min/tune.lr_max"):
        load_config(None, [*base, "--tune.lr_min=1e-2", "--tune.lr_max=1e-3"])
    with pytest.raises(ConfigError, match="tune.schedules"):
        load_config(None, [*base, "--tune.schedules=[cosine, zigzag]"])
    with pytest.raises(ValueError, match="the run needs 6 CPU: .* but the cluster has 4"):
        sweep(load_config(None, [*base, "--run.name=huge", "--scaling.num_workers=2",
                                 "--scaling.cpus_per_worker=3"]), log=print)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, tokenizer_dir):
    """A tiny Llama for the test tokenizer, saved with save_pretrained: the model a LoRA sweep
    adapts."""
    return save_tiny_llama(tmp_path_factory.mktemp("pretrained"),
                           vocab_size=tokenizer_vocab(tokenizer_dir))


def test_an_interrupted_lora_sweep_resumes(base, pretrained, tmp_path):
    """`raylm tune` over LoRA ranks, stopped with Ctrl-C once its first trial is done; the same
    sweep run again finishes it without training that trial a second time, and each
    trial's checkpoint holds adapters of its own rank."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import torch.distributed.checkpoint as dcp

    root = Path(next(a for a in base if a.startswith("--run.storage_path=")).split("=", 1)[1])
    args = [sys.executable, "-m", "raylm", "tune", *base, "--run.name=resumed",
            f"--model.path={pretrained}", "--lora.rank=4", "--tune.lr_points=1",
            "--tune.lora_ranks=[2, 8]", "--tune.max_concurrent=1", "--train.steps=10"]
    import ray

    # The interrupted driver joins the suite's cluster (a local one would take ~10 s to start);
    # what its trials hold goes with it.
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    trials = root / "resumed" / "trials"
    first = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    # Interrupt once the second trial has begun (it writes run.json first): only then has
    # Tune recorded the first one as finished. A trial stopped between writing its summary
    # and Tune hearing that it returned is, rightly, resumed (and trained 0 more steps).
    deadline = time.time() + 300
    while time.time() < deadline and len(list(trials.glob("*/run.json"))) < 2:
        time.sleep(0.5)
    assert len(list(trials.glob("*/run.json"))) == 2, "the second trial did not start"
    first.send_signal(signal.SIGINT)
    out, _ = first.communicate(timeout=120)
    # A trial's summary is kept current while it runs; the finished one says so.
    done = [p.parent.name for p in trials.glob("*/summary.json")
            if json.loads(p.read_text())["status"] == "finished"]
    assert len(done) == 1, out[-3000:]

    # The same sweep again, from this process (a second interpreter would start and import
    # everything once more): it resumes.
    from raylm.sweep import sweep

    said: list[str] = []
    sweep(load_config(None, args[4:]), log=said.append)
    assert any("resuming the sweep" in line for line in said), said
    summary = json.loads((root / "resumed" / "tune_summary.json").read_text())
    assert len(summary["trials"]) == 2
    assert {t["trial_id"] for t in summary["trials"]} >= set(done)
    # The trial finished before the interruption trained once: one invocation in its log.
    records = [json.loads(line) for line in (trials / done[0] / "events.jsonl").read_text()
               .splitlines()]
    assert len({r["invocation"] for r in records}) == 1
    for trial in summary["trials"]:
        meta = dcp.FileSystemReader(trial["checkpoint_path"]).read_metadata()
        ranks = {v.size[0] for k, v in meta.state_dict_metadata.items()
                 if k.startswith("model.") and k.endswith("lora_A.default.weight")}
        assert ranks == {trial["config"]["lora.rank"]}
    assert sorted(t["config"]["lora.rank"] for t in summary["trials"]) == [2, 8]
