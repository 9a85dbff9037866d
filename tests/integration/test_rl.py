"""Reinforcement learning (train.objective=grpo) end to end on the local Ray cluster: a model
warmed up here on a task's format learns the task from its rewards, with completions from
generator actors; a generator killed mid-run is replaced while the trainers go on, and a
trainer killed after a checkpoint resumes to the same rewards and losses."""

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
        "--rl.generators=2", '--rl.generator_resources={"CPU": 0.5}',
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
    from mlflow import MlflowClient

    client = MlflowClient(summary["mlflow_tracking_uri"])
    for name in ("rl_reward", "rl_truncated", "val_reward"):
        assert client.get_metric_history(summary["mlflow_run_id"], name), name
