"""Reinforcement learning (train.objective=grpo) end to end on the local Ray cluster: a model
warmed up here on a task's format learns the task from its rewards, with completions from
generator actors one step ahead of the trainers (off-policy); a generator killed mid-run is
replaced while the trainers go on, and a trainer killed after a checkpoint resumes to the same
rewards and losses, training the completions the checkpoint kept."""

from __future__ import annotations

import signal
import time

import pytest

from raylm.config import load_config
from tests.integration import faults

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """The task's prompts and its tiny model, taught in this process to answer with one of
    the question's two digits at random (:mod:`raylm.examples.larger_digit`)."""
    from raylm.examples.larger_digit import write

    root = tmp_path_factory.mktemp("rl")
    write(root)
    return root


def generator_processes():
    import psutil

    return [p for p in psutil.process_iter(["cmdline"])
            if any(part.startswith("ray::Generator") for part in (p.info["cmdline"] or []))]


def test_grpo_learns_replaces_a_lost_generator_and_resumes_a_lost_trainer_exactly(warmed,
                                                                                  tmp_path):
    from raylm import api
    from raylm.run import record
    from raylm.run.launch import train

    cfg = load_config(None, [
        f"--model.path={warmed / 'model'}", f"--data.source={warmed / 'prompts.jsonl'}",
        "--data.format=prompt", "--train.objective=grpo", "--rl.reward=exact_match",
        "--data.seq_len=40", "--rl.max_completion_tokens=4", "--rl.group_size=8",
        "--rl.generators=2", '--rl.generator_resources={"CPU": 0.5}', "--rl.max_staleness=1",
        "--train.global_batch_size=8", "--train.micro_batch_size=4", "--train.steps=100",
        "--train.log_every=1", "--train.eval_every=20", "--train.eval_batches=4",
        "--checkpoint.every=20", "--optim.lr=1e-3", "--optim.warmup_steps=2",
        "--train.precision=fp32", "--data.val_fraction=0.2", "--scaling.num_workers=1",
        f"--run.storage_path={tmp_path}/runs", f"--run.cache_dir={tmp_path}/cache",
        "--run.name=grpo", "--tracking.enabled=true",
        f"--tracking.uri=sqlite:///{tmp_path}/mlflow.db", "--tracking.log_model=false"])
    run_dir = tmp_path / "runs" / "grpo"

    def kill_a_generator_then_the_trainer() -> None:
        """A generator as soon as the group has started; then, once the record holds step 21
        (reports reach it at the controller's polls, several steps behind training), the
        trainer, stopped first so that no save lands meanwhile, if the newest checkpoint is
        still step 20's."""
        (victim, *_) = generator_processes()
        victim.send_signal(signal.SIGKILL)
        deadline = time.time() + 240
        while not any(r["event"] == "progress" and r["step"] >= 21
                      for r in record.read(str(run_dir))):
            assert time.time() < deadline, "the controller never had step 21"
            time.sleep(0.02)
        (trainer,) = faults.train_workers()
        trainer.send_signal(signal.SIGSTOP)
        newest = faults.checkpoint_step(run_dir)
        trainer.send_signal(signal.SIGKILL if newest == 20 else signal.SIGCONT)
        assert newest == 20, f"the run reached its step-{newest} checkpoint before the kill"

    summary = faults.run_and_interfere(lambda: train(cfg, log=print), run_dir,
                                       acts=[(0, kill_a_generator_then_the_trainer)])
    assert summary["status"] == "finished" and summary["final_step"] == 100
    assert summary["restarts"] == 1  # the trainer's loss; the generator's cost no restart
    (restart,) = [i for i in summary["interruptions"] if i["event"] == "restart"]
    assert restart["resumed_from_step"] == 20
    groups: list[dict[int, dict]] = []
    for r in record.read(str(run_dir)):
        if r["event"] == "group_start":
            groups.append({})
        elif r["event"] == "progress":
            groups[-1][r["step"]] = r
    first, second = groups
    assert max(r["rl_generators_replaced"] for r in first.values()) >= 1
    again = sorted(set(first) & set(second))
    assert again and again[0] == 21, (sorted(first), sorted(second))
    # Off-policy (rl.max_staleness=1): step 21 trains the completions version 19 sampled,
    # which the resumed group, holding version 20, has only from the step-20 checkpoint.
    assert second[21]["rl_weight_version_min"] == 19 and second[21]["rl_staleness_max"] == 1
    for step in again:  # the same completions, rewards and update from the step-20 weights
        for key in ("rl_reward", "rl_completion_len", "loss"):
            assert second[step][key] == pytest.approx(first[step][key], abs=1e-6), (step, key)
    assert summary["samples"]["duplicated"] == 0 and summary["samples"]["skipped"] == 0
    assert summary["samples"]["trained"] == 100 * 8
    # It learned: from about half right (either digit of the question, at random) to the
    # larger one, on the training prompts and on held-out ones.
    rewards = [second.get(step, first.get(step))["rl_reward"] for step in range(1, 101)]
    assert sum(rewards[:5]) / 5 < 0.65 and sum(rewards[-10:]) / 10 >= 0.8, rewards
    assert summary["val_reward"] >= 0.8
    history = api.Run(str(run_dir)).history
    assert {"rl_reward", "rl_reward_std", "rl_no_signal", "rl_clip_low", "rl_kl",
            "rl_generate_s", "rl_transfer_s", "val_reward"} <= set(history)
    assert "rl_reward" in summary and "rl_clip_high" in summary
    causes = summary["goodput"]["seconds"]
    assert causes["generation"] > 0 and causes["weight_transfer"] > 0, causes
    from mlflow import MlflowClient

    client = MlflowClient(summary["mlflow_tracking_uri"])
    for name in ("rl_reward", "rl_truncated", "val_reward"):
        assert client.get_metric_history(summary["mlflow_run_id"], name), name


def test_off_policy_groups_keep_the_weights_that_asked_for_them_and_a_checkpoint_keeps_them(
        tokenizer_dir):
    """Generator actors on the cluster, as an off-policy run's rank 0 drives them: groups asked
    for before a new version is loaded are sampled by the old one; the groups a checkpoint
    keeps are trained as kept, whatever the generators hold by then; a generator lost before
    a step is replaced with the newest weights."""
    import ray
    import torch

    from raylm.rollout.buffer import Buffer, load_saved
    from raylm.rollout.generator import Generator, Prompt, Sampling
    from raylm.rollout.pool import GeneratorPool
    from tests.conftest import tokenizer_vocab

    init = dict(config={"model": {"preset": "tiny"}, "train": {"precision": "fp32"}},
                vocab_size=tokenizer_vocab(tokenizer_dir), eos_id=0, reward="exact_match",
                tokenizer_json=(tokenizer_dir / "tokenizer.json").read_text())
    local = Generator(**init)
    torch.manual_seed(0)
    versions = [{n: p.detach() + 0.3 * k * torch.randn_like(p)
                 for n, p in local.built.model.named_parameters()} for k in range(3)]
    sampling = Sampling(group_size=3, temperature=1.0, max_tokens=5)

    def prompts(*positions: int) -> list[Prompt]:
        return [Prompt(p, [5, 17, 23, 40 + p], f"say {p}", {"answer": "x"}) for p in positions]

    pool = GeneratorPool(count=2, resources={"CPU": 0.5}, init=init)
    try:
        pool.load(0, versions[0])
        buffer = Buffer(pool)
        buffer.ask(prompts(0, 1, 2), sampling)  # the step ahead, while version 0 trains
        pool.load(1, versions[1])
        first = buffer.take(prompts(0, 1, 2), sampling)
        assert [g.version for g in first] == [0, 0, 0] and not buffer.ready
        buffer.ask(prompts(3, 4, 5), sampling)
        through, kept = load_saved(buffer.saved(through_step=7), where="rollouts.json")
        assert through == 7 and sorted(kept) == [3, 4, 5]

        # A resumed run: the kept groups, not new ones from the weights it now holds.
        resumed = Buffer(pool, ready=kept)
        pool.load(2, versions[2])
        again = resumed.take(prompts(3, 4, 5), sampling)
        assert [g.version for g in again] == [1, 1, 1]
        assert [g.completions for g in again] == [kept[p].completions for p in (3, 4, 5)]
        with pytest.raises(RuntimeError, match="position 6 answer another prompt"):
            Buffer(pool, ready={6: kept[3]}).take(prompts(6), sampling)

        # A lost generator: its share generated again, by its replacement, with version 2.
        ray.kill(pool.actors[0], no_restart=True)
        fresh = resumed.take(prompts(8, 9), sampling)
        assert [g.version for g in fresh] == [2, 2] and pool.replaced == 1
        twice = pool.generate(prompts(8, 9), sampling)
        assert [g.completions for g in twice] == [g.completions for g in fresh]
    finally:
        pool.shutdown()


def test_generators_that_cannot_start_are_named_not_waited_for_in_silence(tokenizer_dir):
    from raylm.rollout.pool import GeneratorPool
    from tests.conftest import tokenizer_vocab

    init = dict(config={"model": {"preset": "tiny"}, "train": {"precision": "fp32"}},
                vocab_size=tokenizer_vocab(tokenizer_dir), eos_id=0, reward="exact_match",
                tokenizer_json=(tokenizer_dir / "tokenizer.json").read_text())
    pool = GeneratorPool(count=1, resources={"CPU": 0.5, "accelerator_x": 1}, init=init)
    said: list[str] = []
    try:
        pool.load(0, {})
        with pytest.raises(RuntimeError, match=r"1 generator actor\(s\) asking for \{'CPU': "
                                               r"0.5, 'accelerator_x': 1\} each not all "
                                               r"started after \d+ s; the cluster has free: CPU"):
            pool.started(timeout_s=0.5, keep_waiting=False, log=said.append)
        assert not said  # no autoscaler to wait for: it stops at once
    finally:
        pool.shutdown()
