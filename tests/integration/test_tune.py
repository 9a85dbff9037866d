"""`raylm tune` on a local Ray cluster: trials of the tiny preset, one worker each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raylm.config import load_config
from tests.conftest import save_tiny_llama, tiny_run, tokenizer_vocab
from tests.integration import faults

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
    from raylm.run.sweep import sweep

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
    from raylm.run.sweep import sweep

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


def test_an_interrupted_dpo_lora_sweep_resumes_its_trial_from_its_checkpoint(
        base, pretrained, tmp_path):
    """`raylm tune` of a DPO trial on LoRA adapters (the sweep choosing dpo.beta and the
    rank), stopped with Ctrl-C once the trial has a checkpoint; the same sweep run again goes
    on with that trial from its newest checkpoint rather than from the start. The sweep ranks
    trials by a benchmark, an lm-eval task of held-out pairs scored beside the trial at its
    checkpoints of steps 40 and 80: each is scored once over both invocations, and Tune
    ranks by the score. The trial's adapters have the rank the sweep gave it (2), not the
    config's (4): the trial's settings reached its workers."""
    import os
    import random
    import signal
    import subprocess
    import sys
    import time

    import ray
    import torch.distributed.checkpoint as dcp

    from raylm.run.sweep import sweep

    root = Path(next(a for a in base if a.startswith("--run.storage_path=")).split("=", 1)[1])
    rng = random.Random(0)
    words = "river mill grain window letter winter village market bread garden".split()
    pairs = tmp_path / "pairs.jsonl"
    with pairs.open("w") as f:
        for _ in range(200):
            w = rng.sample(words, 3)
            f.write(json.dumps({"prompt": [{"role": "user", "content": "Reverse: " + " ".join(w)}],
                                "chosen": " ".join(reversed(w)), "rejected": " ".join(w)})
                    + "\n")
    # The benchmark: 16 more pairs as lm-eval multiple choice, rendered as training renders a
    # one-turn prompt.
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    rows = [rng.sample(words, 3) for _ in range(16)]
    (tasks / "pairs.jsonl").write_text("".join(json.dumps(
        {"words": " ".join(w), "choices": [" ".join(w), " ".join(reversed(w))], "answer": 1})
        + "\n" for w in rows))
    (tasks / "pairs.yaml").write_text(
        f"task: held_out_pairs\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tasks / 'pairs.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"User: Reverse: {{words}}\\n\\nAssistant:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\nmetric_list:\n"
        "  - metric: acc\n")
    args = [sys.executable, "-m", "raylm", "tune", *base, "--run.name=resumed",
            f"--model.path={pretrained}", "--lora.rank=4", "--tune.lr_points=1",
            "--tune.lora_ranks=[2]", "--tune.max_concurrent=1", f"--data.source={pairs}",
            "--data.format=preference", "--data.seq_len=95", "--train.objective=dpo",
            "--tune.dpo_betas=[0.3]", "--eval.tasks=[held_out_pairs]",
            f"--eval.include_path={tasks}", "--eval.every=8", "--eval.resources={CPU: 0.5}",
            "--tune.metric=eval/held_out_pairs/acc",
            # Ranked by a benchmark, a trial reports to Tune only with its scores, so nothing
            # paces its steps: 80 of them keep it training when the interrupt comes.
            "--train.steps=80"]
    # The interrupted driver joins the suite's cluster (a local one would take ~10 s to start);
    # what its trial holds goes with it. Ray Train's poll at Ray's 2 s (one report each;
    # raylm would poll every 0.5 s) paces the trial at a report per 2 s (each carries a
    # checkpoint, and those are never held back), so it is still training when the interrupt
    # comes.
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}
    trials = root / "resumed" / "trials"

    def newest_step() -> int:
        return max((faults.checkpoint_step(d) for d in trials.glob("*") if d.is_dir()),
                   default=0)

    first = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    deadline = time.time() + 300
    while time.time() < deadline and newest_step() < 5 and first.poll() is None:
        time.sleep(0.2)
    assert newest_step() >= 5, "the trial made no checkpoint"
    first.send_signal(signal.SIGINT)
    out, _ = first.communicate(timeout=120)
    (trial_dir,) = [d for d in trials.glob("*") if d.is_dir()]
    interrupted_at = newest_step()
    assert 5 <= interrupted_at < 40, out[-3000:]

    # The same sweep again, from this process (a second interpreter would start and import
    # everything once more): it resumes, and the trial goes on from its checkpoint.
    said: list[str] = []
    sweep(load_config(None, args[4:]), log=said.append)
    assert any("resuming the sweep" in line for line in said), said
    # Tune's experiment has a folder of its own, so Tune's syncs never write the copies it
    # took at the restore over the sweep's lease or summary.
    assert (root / "resumed" / "tune" / "tuner.pkl").is_file()
    assert not (root / "resumed" / "tuner.pkl").exists()
    summary = json.loads((root / "resumed" / "tune_summary.json").read_text())
    (trial,) = summary["trials"]
    assert trial["trial_id"] == trial_dir.name and trial["config"]["lora.rank"] == 2
    metric = "eval/held_out_pairs/acc"
    assert trial["config"]["dpo.beta"] == 0.3 and summary["metric"] == metric
    assert summary["best"][metric] == trial[metric]
    assert trial["steps"] == 80 and not trial["stopped_early"]
    ran = json.loads((trial_dir / "summary.json").read_text())
    assert ran["status"] == "finished" and ran["resumed_from_step"] == interrupted_at
    records = [json.loads(line) for line in (trial_dir / "events.jsonl").read_text()
               .splitlines()]
    assert len({r["invocation"] for r in records}) == 2
    scored = [r for r in records if r["event"] == "benchmark"]
    assert [r["step"] for r in scored] == [40, 80], records
    # Tune ranked by the scores as they came: its best is the best of the two.
    assert trial[metric] == max(r["scores"][metric] for r in scored)
    assert ran["benchmarks"]["scores"][metric]["best"] == trial[metric]
    # The sweep's record and plot hold the score at each scored step.
    assert [s for s, _ in trial["scores"]] == [40, 80]
    assert ran["samples"]["duplicated"] == 0 and ran["samples"]["skipped"] == 0
    meta = dcp.FileSystemReader(trial["checkpoint_path"]).read_metadata()
    ranks = {v.size[0] for k, v in meta.state_dict_metadata.items()
             if k.startswith("model.") and k.endswith("lora_A.default.weight")}
    assert ranks == {2}
