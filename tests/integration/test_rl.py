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
        "--rl.generators=[1, 2]", '--rl.generator_resources={"CPU": 0.5}', "--rl.max_staleness=1",
        "--rl.updates_per_step=2",
        "--train.global_batch_size=8", "--train.micro_batch_size=4", "--train.steps=100",
        "--train.log_every=1", "--train.eval_every=20", "--train.eval_batches=4",
        "--checkpoint.every=20", "--optim.lr=1e-3", "--optim.warmup_steps=2",
        "--train.precision=fp32", "--data.val_fraction=0.2", "--scaling.num_workers=1",
        f"--run.storage_path={tmp_path}/runs", f"--run.cache_dir={tmp_path}/cache",
        "--run.name=grpo", "--tracking.enabled=true",
        f"--tracking.uri=sqlite:///{tmp_path}/mlflow.db", "--tracking.log_model=false"])
    run_dir = tmp_path / "runs" / "grpo"

    killed_after: list[int] = []

    def kill_a_generator_then_the_trainer() -> None:
        """A generator as soon as the group has started; then the trainer, once the record
        holds a step after the newest checkpoint, stopped first to see that no save landed
        meanwhile. Reports reach the record at the controller's polls, a second or more behind
        training, when the steps take 50 ms: from the first checkpoint on, the trainer is held
        (stopped 0.2 s in every 0.25 s) so that the record catches up before the next one."""
        (victim, *_) = generator_processes()
        victim.send_signal(signal.SIGKILL)
        deadline = time.time() + 240
        while True:
            assert time.time() < deadline, "no step reported after a checkpoint in time"
            reported = max((r["step"] for r in record.read(str(run_dir))
                            if r["event"] == "progress"), default=0)
            newest = faults.checkpoint_step(run_dir)
            if newest <= 0:
                time.sleep(0.02)
                continue
            (trainer,) = faults.train_workers()
            trainer.send_signal(signal.SIGSTOP)
            if newest < reported < 100 and faults.checkpoint_step(run_dir) == newest:
                trainer.send_signal(signal.SIGKILL)
                killed_after.append(newest)
                return
            time.sleep(0.2)
            trainer.send_signal(signal.SIGCONT)
            time.sleep(0.05)

    summary = faults.run_and_interfere(lambda: train(cfg, log=print), run_dir,
                                       acts=[(0, kill_a_generator_then_the_trainer)])
    assert summary["status"] == "finished" and summary["final_step"] == 100
    assert summary["restarts"] == 1  # the trainer's loss; the generator's cost no restart
    (restart,) = [i for i in summary["interruptions"] if i["event"] == "restart"]
    (k,) = killed_after
    assert restart["resumed_from_step"] == k
    groups: list[dict[int, dict]] = []
    for r in record.read(str(run_dir)):
        if r["event"] == "group_start":
            groups.append({})
        elif r["event"] == "progress":
            groups[-1][r["step"]] = r
    first, second = groups
    assert max(r["rl_generators_replaced"] for r in first.values()) >= 1
    # rl.generators=[1, 2]: the steps went on with one while the lost one's replacement
    # started, and the run ended with two.
    assert min(r["rl_generators"] for r in first.values()) == 1
    assert second[100]["rl_generators"] == 2
    again = sorted(set(first) & set(second))
    assert again and again[0] == k + 1, (k, sorted(first), sorted(second))
    # Off-policy (rl.max_staleness=1): step k + 1 trains the completions version k - 1
    # sampled, which the resumed group, holding version k, has only from the checkpoint.
    assert second[k + 1]["rl_weight_version_min"] == k - 1
    assert second[k + 1]["rl_staleness_max"] == 1
    for step in again:  # the same completions, rewards and update from the step-k weights
        for key in ("rl_reward", "rl_completion_len", "loss"):
            assert second[step][key] == pytest.approx(first[step][key], abs=1e-6), (step, key)
    assert summary["samples"]["duplicated"] == 0 and summary["samples"]["skipped"] == 0
    # Two updates a step (rl.updates_per_step=2): the second trains completions the first
    # moved the policy from, and the clip binds on some of their tokens.
    path = [second.get(step, first.get(step)) for step in range(1, 101)]
    assert max(r["rl_clip_low"] + r["rl_clip_high"] for r in path) > 0
    assert summary["samples"]["trained"] == 100 * 8
    # It learned: from about half right (either digit of the question, at random) to the
    # larger one, on the training prompts and on held-out ones.
    rewards = [r["rl_reward"] for r in path]
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
    # tokens_seen counts the rows trained, prompt and completion (the task's prompts all have
    # one length): 100 steps of 64 rows less their completions leave 6,400 such prompts.
    seen = max(client.get_metric_history(summary["mlflow_run_id"], "tokens_seen"),
               key=lambda m: m.step).value
    completions = 64 * sum(second.get(s, first.get(s))["rl_completion_len"]
                           for s in range(1, 101))
    prompt_len = (seen - completions) / 6400
    assert prompt_len > 5 and prompt_len == pytest.approx(round(prompt_len), abs=1e-6), prompt_len


def test_off_policy_groups_keep_the_weights_that_asked_for_them_and_a_checkpoint_keeps_them(
        tokenizer_dir):
    """Generator actors on the cluster, as an off-policy run's rank 0 drives them: groups asked
    for before a new version is loaded are sampled by the old one; the groups a checkpoint
    keeps are trained as kept, whatever the generators hold by then; a generator lost is
    replaced, and its share sampled again by the weights it was asked of."""
    import ray
    import torch

    from raylm.rollout.buffer import Buffer, load_saved
    from raylm.rollout.generator import Generator, Prompt, Sampling
    from raylm.rollout.pool import GeneratorPool

    init = generator_init(tokenizer_dir)
    local = Generator(**init)
    torch.manual_seed(0)
    versions = [{n: p.detach() + 0.3 * k * torch.randn_like(p)
                 for n, p in local.built.model.named_parameters()} for k in range(3)]
    sampling = Sampling(group_size=3, temperature=1.0, max_tokens=5)

    def prompts(*positions: int) -> list[Prompt]:
        return [Prompt(p, [5, 17, 23, 40 + p], f"say {p}", {"answer": "x"}) for p in positions]

    pool = GeneratorPool(count=2, resources={"CPU": 0.5}, init=init, keep=2)
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

        # Lost holding a share asked of a version older than the newest: sampled again by
        # that version, the groups the lost generator would have returned.
        intact = pool.generate(prompts(10, 11), sampling)
        ray.kill(pool.actors[1], no_restart=True)
        asked = pool.submit(prompts(10, 11), sampling)
        pool.load(3, versions[0])
        again = pool.collect(asked)
        assert [g.version for g in again] == [2, 2] and pool.replaced == 2
        assert [g.completions for g in again] == [g.completions for g in intact]
    finally:
        pool.shutdown()


def test_generators_join_as_the_cluster_places_them_and_the_others_take_a_lost_ones_share(
        tokenizer_dir):
    """rl.generators=[1, 2] on a cluster with room for one: the pool samples with that one,
    and the second joins, with the newest weights, once a CPU frees; one lost while the cluster
    has no room for its replacement leaves its share to the other, and the replacement joins
    later. The groups are the same at every count."""
    import ray
    import torch

    from raylm.rollout.generator import Generator, Prompt, Sampling
    from raylm.rollout.pool import GeneratorPool

    init = generator_init(tokenizer_dir)
    torch.manual_seed(0)
    local = list(Generator(**init).built.model.named_parameters())
    versions = [{n: p.detach() + 0.3 * k * torch.randn_like(p) for n, p in local}
                for k in range(2)]
    prompts = [Prompt(p, [5, 17, 23, 40 + p], f"say {p}", {"answer": "x"}) for p in range(3)]
    sampling = Sampling(group_size=3, temperature=1.0, max_tokens=5)

    @ray.remote
    class Holder:  # another job's actor, holding CPUs the generators would take
        def ping(self) -> bool:
            return True

    def hold(cpus: float):
        holder = Holder.options(num_cpus=cpus).remote()
        ray.get(holder.ping.remote())
        return holder

    def until(what, ok) -> None:
        deadline = time.monotonic() + 60
        while not ok():
            assert time.monotonic() < deadline, f"waited 60 s for {what}"
            time.sleep(0.2)

    free = ray.available_resources()["CPU"]
    holder = hold(free - 1.5)  # room for one generator of one CPU
    pool = GeneratorPool(count=(1, 2), resources={"CPU": 1.0}, init=init)
    try:
        pool.load(0, versions[0])
        pool.started()
        assert len(pool.actors) == 1 and len(pool.waiting) == 1
        pool.load(1, versions[1])
        alone = pool.generate(prompts, sampling)
        assert [g.version for g in alone] == [1, 1, 1]

        ray.kill(holder)
        until("the second generator to join", lambda: pool.join()
              or len(pool.actors) == 2)
        both = pool.generate(prompts, sampling)  # the joined one loaded version 0 first
        assert [g.version for g in both] == [1, 1, 1]
        assert [g.completions for g in both] == [g.completions for g in alone]

        lost = pool.actors[1]
        before = ray.available_resources().get("CPU", 0)
        ray.kill(lost, no_restart=True)
        until("the lost generator's CPU", lambda: ray.available_resources().get("CPU", 0)
              >= before + 1)
        holder = hold(ray.available_resources()["CPU"] - 0.5)  # no room for a replacement
        shared = pool.generate(prompts, sampling)
        assert [g.completions for g in shared] == [g.completions for g in alone]
        assert pool.replaced == 1 and lost not in pool.actors and len(pool.actors) == 1
        assert len(pool.waiting) == 1
        ray.kill(holder)
        until("the replacement to join", lambda: pool.join()
              or len(pool.actors) == 2)
    finally:
        pool.shutdown()


def generator_init(tokenizer_dir) -> dict:
    """A tiny model's generator, as a run's rank 0 makes it."""
    from tests.conftest import tokenizer_vocab

    return dict(config={"model": {"preset": "tiny"}, "train": {"precision": "fp32"}},
                vocab_size=tokenizer_vocab(tokenizer_dir), eos_id=0, reward="exact_match",
                tokenizer_json=(tokenizer_dir / "tokenizer.json").read_text())


def test_generators_that_cannot_start_are_named_not_waited_for_in_silence(tokenizer_dir):
    from raylm.rollout.pool import GeneratorPool

    init = generator_init(tokenizer_dir)
    said: list[str] = []
    pool = GeneratorPool(count=1, resources={"CPU": 0.5, "accelerator_x": 1}, init=init,
                         timeout_s=0.5, log=said.append)
    try:
        pool.load(0, {})
        with pytest.raises(RuntimeError, match=r"1 generator actor\(s\) asking for \{'CPU': "
                                               r"0.5, 'accelerator_x': 1\} each not started "
                                               r"after \d+ s \(0 running, rl.generators asks "
                                               r"for at least 1\); the cluster has free: CPU"):
            pool.started()
        assert not said  # no autoscaler to wait for: it stops at once
    finally:
        pool.shutdown()
