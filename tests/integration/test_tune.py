"""`raylm tune` on a local Ray cluster: 4 trials of the tiny preset, one worker each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raylm.config import load_config
from tests.conftest import make_docs, write_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("tune_cluster")]


@pytest.fixture(scope="module")
def tune_cluster():
    """With the dashboard: Ray Train's placement-group cleaner asks the state API whether the
    controller of a trial that Tune stopped is gone."""
    import ray

    ray.init(num_cpus=4, include_dashboard=True, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("tune")
    write_jsonl(root / "corpus.jsonl", make_docs(400))
    return [f"--data.source={root / 'corpus.jsonl'}", f"--tokenizer.path={tokenizer_dir}",
            "--data.seq_len=32", "--data.val_fraction=0.1", f"--run.cache_dir={root}/cache",
            f"--run.storage_path={root}/runs", "--model.preset=tiny", "--train.precision=fp32",
            "--train.global_batch_size=8", "--train.micro_batch_size=4", "--train.steps=30",
            "--train.eval_every=5", "--train.eval_batches=2", "--scaling.num_workers=1",
            "--optim.warmup_steps=2",
            # Grid over 4 peak LRs from 1e-2 down to 1e-6: the last cannot learn in 30 steps.
            "--tune.search=grid", "--tune.lr_points=4", "--tune.lr_min=1e-6",
            "--tune.lr_max=1e-2", "--tune.schedules=[constant]", "--tune.max_concurrent=2"]


@pytest.fixture(scope="module")
def swept(base):
    from raylm.tune import sweep

    return sweep(load_config(None, [*base, "--run.name=sweep"]), log=print)


def test_sweep_stops_bad_trials_early_and_picks_the_best(base, swept):
    trials = swept["trials"]
    assert len(trials) == 4
    lrs = sorted(t["config"]["optim.lr"] for t in trials)
    assert lrs == pytest.approx([1e-6, 1e-6 * 1e4 ** (1 / 3), 1e-6 * 1e4 ** (2 / 3), 1e-2])
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


def test_mlflow_holds_one_parent_and_a_child_per_trial(swept):
    from mlflow import MlflowClient

    client = MlflowClient(swept["mlflow_tracking_uri"])
    parent = client.get_run(swept["mlflow_parent_run_id"])
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == 4
    best = [c for c in children if c.data.tags.get("raylm.best") == "true"]
    assert len(best) == 1 and parent.data.tags["raylm.best_run_id"] == best[0].info.run_id
    assert parent.data.metrics["best_val_loss"] == pytest.approx(swept["best"]["val_loss"])
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"tune_summary.json", "val_loss.png"} <= artifacts
    for child in children:
        history = client.get_metric_history(child.info.run_id, "val_loss")
        assert history and history[0].step == 5


def test_bad_sweeps_fail_before_any_trial(base):
    from raylm.config import ConfigError
    from raylm.tune import sweep

    with pytest.raises(ConfigError, match="tune.lr_min/tune.lr_max"):
        load_config(None, [*base, "--tune.lr_min=1e-2", "--tune.lr_max=1e-3"])
    with pytest.raises(ConfigError, match="tune.schedules"):
        load_config(None, [*base, "--tune.schedules=[cosine, zigzag]"])
    with pytest.raises(ValueError, match="Not even one trial fits the cluster"):
        sweep(load_config(None, [*base, "--run.name=huge", "--scaling.num_workers=2",
                                 "--scaling.cpus_per_worker=3"]), log=print)

