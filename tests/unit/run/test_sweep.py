"""The sweep's search space and trial configs (no Ray cluster)."""

from __future__ import annotations

import pytest

from raylm.config import load_config
from raylm.contracts.summary import SweepSummary, Trial
from raylm.run.sweep import concurrent_trials, search_space, trial_config


def ranked_trial(trial_id, config, *, val_loss, ranked):
    return Trial(trial_id=trial_id, config=config, val_loss=val_loss, ranked=ranked, steps=10,
                 stopped_early=False, error=None, checkpoint_path=None, history=[])

def test_grid_space_spans_the_lr_range_largest_first():
    cfg = load_config(None, ["--tune.search=grid", "--tune.lr_points=3", "--tune.lr_min=1e-4",
                             "--tune.lr_max=1e-2", "--tune.schedules=[cosine, wsd]",
                             "--tune.weight_decays=[0.0, 0.1]"])
    space = search_space(cfg)
    assert space["optim.lr"]["grid_search"] == pytest.approx([1e-2, 1e-3, 1e-4])
    assert space["optim.schedule"]["grid_search"] == ["cosine", "wsd"]
    assert space["optim.weight_decay"]["grid_search"] == [0.0, 0.1]
    # Lists left empty keep the base config's value.
    assert space["optim.warmup_steps"]["grid_search"] == [cfg.optim.warmup_steps]


def test_random_and_optuna_spaces_are_accepted_by_tunes_searchers():
    from ray.tune.search.optuna import OptunaSearch

    cfg = load_config(None, ["--tune.search=optuna", "--tune.lr_min=1e-4", "--tune.lr_max=1e-2"])
    space = search_space(cfg)
    assert space["optim.lr"].lower == 1e-4 and space["optim.lr"].upper == 1e-2
    searcher = OptunaSearch(seed=0)
    assert searcher.set_search_properties("val_loss", "min", space)
    suggestion = searcher.suggest("trial-1")
    assert 1e-4 <= suggestion["optim.lr"] <= 1e-2
    assert suggestion["optim.schedule"] in cfg.tune.schedules


def test_trial_config_applies_params_and_aligns_reports_with_evaluations(tmp_path):
    base = load_config(None, ["--train.eval_every=25", "--train.log_every=10",
                              "--checkpoint.every=100"]).to_dict()
    cfg = trial_config(base, {"optim.lr": 3e-3, "optim.schedule": "wsd"},
                       trials_dir=str(tmp_path), trial_id="abc_00001", prepared="/data/p")
    assert (cfg.optim.lr, cfg.optim.schedule) == (3e-3, "wsd")
    # Every report carries val_loss, which Tune requires of each result.
    assert cfg.train.log_every == cfg.checkpoint.every == cfg.train.eval_every == 25
    assert cfg.run.name == "abc_00001" and cfg.run.storage_path == str(tmp_path)
    assert cfg.data.source == "/data/p"


# The sweep decides the device before it counts (raylm.run.launch.choose_device).
CPU = "--scaling.use_gpu=false"


def test_concurrent_trials_counts_worker_resources():
    cfg = load_config(None, ["--scaling.num_workers=2", "--tune.max_concurrent=0", CPU])
    # 2 workers x (1 CPU + 0.1 for the reader) = 2.2 CPUs per trial.
    assert concurrent_trials(cfg, {"CPU": 8}) == 3
    assert concurrent_trials(load_config(None, ["--scaling.num_workers=2",
                                                "--tune.max_concurrent=2", CPU]),
                             {"CPU": 8}) == 2
    # On 2 CPUs the readers share their workers' CPUs: one trial at a time.
    assert concurrent_trials(cfg, {"CPU": 2}) == 1
    with pytest.raises(ValueError, match=r"the run needs 2 CPU: scaling.num_workers=2 starts 2 "
                                         r"workers x \(1 for the worker\), but the cluster has "
                                         r"1; scaling.num_workers=1 or "
                                         r"scaling.cpus_per_worker=0.5 would fit"):
        concurrent_trials(cfg, {"CPU": 1})
    elastic = load_config(None, ["--scaling.num_workers=[1, 4]", "--tune.max_concurrent=0", CPU,
                                 "--train.global_batch_size=12"])
    with pytest.raises(ValueError, match="Not even one trial fits the cluster: a trial needs "
                                         "CPU 4, the cluster has CPU 2"):
        concurrent_trials(elastic, {"CPU": 2})
    gpu = load_config(None, ["--scaling.num_workers=4", "--scaling.use_gpu=true"])
    assert concurrent_trials(gpu, {"CPU": 64, "GPU": 8}) == 2


def test_autoscaling_cluster_queues_trials_instead_of_refusing():
    # Nothing fits the nodes running now; the autoscaler adds them as Tune queues trials.
    cfg = load_config(None, ["--scaling.num_workers=2", "--scaling.wait_for_nodes=true",
                             "--tune.num_samples=6"])
    assert concurrent_trials(cfg, {"CPU": 1}) == 6
    capped = load_config(None, ["--scaling.wait_for_nodes=true", "--tune.max_concurrent=2"])
    assert concurrent_trials(capped, {}) == 2


def test_lora_ranks_and_alphas_are_swept_beside_the_schedule(tmp_path):
    from raylm.config import ConfigError

    model = ["--model.path=/models/base", "--lora.rank=8"]
    cfg = load_config(None, [*model, "--tune.search=grid", "--tune.lr_points=1",
                             "--tune.schedules=[constant]", "--tune.lora_ranks=[4, 16]",
                             "--tune.lora_alphas=[8, 32]"])
    space = search_space(cfg)
    assert space["lora.rank"]["grid_search"] == [4, 16]
    assert space["lora.alpha"]["grid_search"] == [8.0, 32.0]
    trial = trial_config(cfg.to_dict(), {"optim.lr": 1e-3, "lora.rank": 16, "lora.alpha": 32.0},
                         trials_dir=str(tmp_path), trial_id="t_00001", prepared="/data/p")
    assert (trial.lora.rank, trial.lora.alpha) == (16, 32.0)
    # Without the lists, every trial keeps the base config's adapters.
    assert search_space(load_config(None, model))["lora.rank"].categories == [8]
    with pytest.raises(ConfigError, match="tune.lora_ranks"):
        load_config(None, ["--tune.lora_ranks=[4]"])  # no model.path to adapt


def test_a_dpo_sweep_varies_beta_and_ranks_trials_by_preference_accuracy(tmp_path):
    from raylm.config import ConfigError
    from raylm.run.sweep import ranking, table

    dpo = ["--model.path=/models/base", "--lora.rank=8", "--train.objective=dpo",
           "--data.format=preference"]
    cfg = load_config(None, [*dpo, "--tune.dpo_betas=[0.05, 0.5]", "--tune.search=grid"])
    assert search_space(cfg)["dpo.beta"]["grid_search"] == [0.05, 0.5]
    assert ranking(cfg) == ("val_accuracy", "max")
    trial = trial_config(cfg.to_dict(), {"optim.lr": 1e-3, "dpo.beta": 0.5},
                         trials_dir=str(tmp_path), trial_id="t_00001", prepared="/data/p")
    assert trial.dpo.beta == 0.5
    # The loss moves with beta; the accuracy decides, the best first.
    summary = SweepSummary(metric="val_accuracy", trials=[
        ranked_trial("a", {"dpo.beta": 0.5}, val_loss=0.2, ranked=0.7),
        ranked_trial("b", {"dpo.beta": 0.05}, val_loss=0.6, ranked=0.9)])
    lines = table(summary).splitlines()
    assert lines[0].split() == ["trial", "beta", "val_loss", "val_accuracy", "steps", "stopped"]
    assert lines[1].startswith("b ")
    # Next-token sweeps neither vary nor show beta.
    assert "dpo.beta" not in search_space(load_config(None, []))
    assert ranking(load_config(None, [])) == ("val_loss", "min")
    with pytest.raises(ConfigError, match="tune.dpo_betas"):
        load_config(None, ["--tune.dpo_betas=[0.1]"])


def test_a_sweep_resumes_tunes_experiment_in_its_own_folder_or_in_an_older_sweeps_run_dir(
        tmp_path):
    """Tune's experiment is RUN_DIR/tune (Tune writes restore-time copies of its experiment
    folder's top-level .json files back at its syncs, so raylm's own files stay out of it);
    a sweep laid out before, with tuner.pkl in RUN_DIR itself, still resumes there."""
    from raylm.rundir import tune_experiment

    rd = tmp_path / "sweep"
    rd.mkdir()
    assert tune_experiment(str(rd)) is None
    (rd / "tuner.pkl").write_bytes(b"")
    assert tune_experiment(str(rd)) == str(rd)
    (rd / "tune").mkdir()
    (rd / "tune" / "tuner.pkl").write_bytes(b"")
    assert tune_experiment(str(rd)) == str(rd / "tune")


def test_a_grpo_sweep_ranks_by_held_out_reward_counts_its_generators_and_sweeps_rl_settings(
        tmp_path):
    from raylm.run.sweep import ranking, table, trial_resources

    grpo = ["--train.objective=grpo", "--data.format=prompt", "--rl.reward=exact_match", CPU,
            "--rl.generators=2", '--rl.generator_resources={"CPU": 0.5}']
    cfg = load_config(None, [*grpo, "--tune.search=grid",
                             '--tune.choices={"rl.clip_high": [0.2, 0.28]}'])
    assert ranking(cfg) == ("val_reward", "max")
    assert search_space(cfg)["rl.clip_high"]["grid_search"] == [0.2, 0.28]
    trial = trial_config(cfg.to_dict(), {"optim.lr": 1e-3, "rl.clip_high": 0.28},
                         trials_dir=str(tmp_path), trial_id="t_00001", prepared="/data/p")
    assert trial.rl.clip_high == 0.28 and trial.tune.choices == cfg.tune.choices
    # A trial holds its worker and its reader, and its two generators of half a CPU.
    from raylm.run.launch import plan_resources

    assert trial_resources(cfg, plan_resources(cfg, {"CPU": 8})) == {"CPU": 2.1}
    assert concurrent_trials(cfg, {"CPU": 8}) == 3
    # No validation loss to show: the reward decides, the best first.
    summary = SweepSummary(metric="val_reward", trials=[
        ranked_trial("a", {"rl.clip_high": 0.2}, val_loss=None, ranked=0.6),
        ranked_trial("b", {"rl.clip_high": 0.28}, val_loss=None, ranked=0.8)])
    lines = table(summary).splitlines()
    assert lines[0].split() == ["trial", "clip_high", "val_reward", "steps", "stopped"]
    assert lines[1].startswith("b ")
