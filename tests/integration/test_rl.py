"""Generator actors of reinforcement learning (train.objective=grpo) on the local Ray cluster,
as a run's rank 0 drives them, without a worker group: off-policy groups keep the weights that
asked for them, a checkpoint keeps them, a lost generator's share comes back the same, a range
of generators grows and shrinks with the room the cluster has, and generators that cannot be
placed are named. The run itself (learning, a lost generator, a lost trainer node and the
resize after it) is in test_elastic, on a cluster of several nodes."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]


def test_off_policy_groups_keep_the_weights_that_asked_for_them_and_a_checkpoint_keeps_them(
        tokenizer_dir):
    """Generator actors on the cluster, as an off-policy run's rank 0 drives them: groups asked
    for before a new version is loaded are sampled by the old one; the groups a checkpoint
    keeps are trained as kept, whatever the generators hold by then; a generator lost is
    replaced, and its share sampled again by the weights it was asked of."""
    import ray
    import torch

    from raylm.contracts.rollouts import Prompt, Sampling, SavedRollouts
    from raylm.rollout.buffer import Buffer
    from raylm.rollout.generator import Generator
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
        saved = SavedRollouts.from_json(buffer.saved(through_step=7, sampling=sampling))
        kept = {g.position: g for g in saved.groups}
        assert saved.through_step == 7 and saved.sampling == sampling and sorted(kept) == [3, 4, 5]

        # A resumed run: the kept groups, not new ones from the weights it now holds.
        resumed = Buffer(pool, ready=kept)
        pool.load(2, versions[2])
        again = resumed.take(prompts(3, 4, 5), sampling)
        assert [g.version for g in again] == [1, 1, 1]
        assert [g.completions for g in again] == [kept[p].completions for p in (3, 4, 5)]
        # Kept for another prompt than the data holds there: sampled again, not trained.
        (other,) = Buffer(pool, ready={6: kept[3]}).take(prompts(6), sampling)
        assert other.prompt_ids == prompts(6)[0].ids and other.version == 2

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


def test_generators_outlive_the_rank_0_that_drove_them_and_serve_the_next_one(tokenizer_dir):
    """The generators are the run's keeper's (the driver's), not the rank 0 that drove them: a
    rank 0 SIGKILLed with a generation in flight (its process, as a trainer dies) leaves them
    running, models and all; the next group's rank 0 takes the same ones, which finish what
    the lost one asked and then sample the groups they sampled for it, from the weights it
    loads. Ending the keeper (the driver, as the run ends) ends them."""
    import os
    import signal

    import ray

    from raylm.contracts.rollouts import Prompt, Sampling
    from raylm.rollout.generator import Generator
    from raylm.rollout.keeper import start_keeper
    from raylm.rollout.pool import GeneratorPool
    from tests.integration.faults import generator_processes

    init = generator_init(tokenizer_dir)
    weights = {n: p.detach() for n, p in Generator(**init).built.model.named_parameters()}
    prompts = [Prompt(p, [5, 17, 23, 40 + p], f"say {p}", {"answer": "x"}) for p in range(4)]
    sampling = Sampling(group_size=3, temperature=1.0, max_tokens=5)
    long = Sampling(group_size=8, temperature=1.0, max_tokens=200)

    @ray.remote(num_cpus=0)
    class Rank0:
        def __init__(self, keeper) -> None:
            self.pool = GeneratorPool(count=2, resources={"CPU": 0.5}, init=init, keeper=keeper)

        def generate(self, weights, sampling, *, wait: bool = True):
            self.pool.load(0, weights)
            if not wait:  # asked, and left in flight
                self.pool.submit(prompts, sampling)
                return os.getpid()
            groups = self.pool.generate(prompts, sampling)
            return ([g.completions for g in groups], self.pool.replaced,
                    sorted(a._actor_id.hex() for a in self.pool.actors))

    keeper = start_keeper()
    try:
        first = Rank0.remote(keeper)
        before, replaced, actors = ray.get(first.generate.remote(weights, sampling))
        pids = {p.pid for p in generator_processes()}
        assert len(pids) == 2 and replaced == 0
        os.kill(ray.get(first.generate.remote(weights, long, wait=False)), signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(first.generate.remote(weights, sampling))
        after, replaced, again = ray.get(Rank0.remote(keeper).generate.remote(weights, sampling))
        assert again == actors and replaced == 0
        assert {p.pid for p in generator_processes()} == pids
        assert after == before
    finally:
        ray.kill(keeper)
    deadline = time.monotonic() + 30
    while generator_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not generator_processes(), "the generators outlived their keeper"


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
    from raylm.faults import Mistake
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
    # One that fails as it starts (its reward does not import where it runs) is a mistake,
    # not a lost machine to replace.
    broken = GeneratorPool(count=1, resources={"CPU": 0.5}, init={**init, "reward": "nope:f"})
    try:
        broken.load(0, {})
        with pytest.raises(Mistake, match=r"a generator failed as it started: ValueError: "
                                          r"rl.reward='nope:f': module 'nope' does not import"):
            broken.started()
        assert broken.replaced == 0
    finally:
        broken.shutdown()


def test_a_stalled_generation_is_said_and_prompts_that_kill_generators_stop_the_run(
        tokenizer_dir):
    """A generation that has not returned after the pool's timeout is said with its prompts'
    positions; prompts whose reward ends every generator's process that scores them stop the
    run as a mistake after three generators, rather than being handed on forever."""
    from raylm.faults import Mistake
    from raylm.rollout.generator import Generator, Prompt, Sampling
    from raylm.rollout.pool import GeneratorPool

    init = {**generator_init(tokenizer_dir),
            "reward": "tests.integration.faults:reward_that_stalls_or_exits"}
    weights = {n: p.detach() for n, p in Generator(**init).built.model.named_parameters()}
    sampling = Sampling(group_size=3, temperature=1.0, max_tokens=3)
    said: list[str] = []
    pool = GeneratorPool(count=(1, 2), resources={"CPU": 0.5}, init=init, timeout_s=1.0,
                         keep_waiting=True, log=said.append)
    try:
        pool.load(0, weights)
        pool.started()
        said.clear()
        slow = pool.generate([Prompt(7, [5, 17, 23], "q", {"answer": "slow"})], sampling)
        assert len(slow) == 1 and any(
            "for the groups of the prompts at positions [7] from a generator" in m
            for m in said), said
        with pytest.raises(Mistake, match=r"3 generators in a row died sampling or scoring the "
                                          r"prompts at positions \[8\]"):
            pool.generate([Prompt(8, [5, 17, 23], "q", {"answer": "exit"}),
                           Prompt(9, [5, 17, 24], "q", {"answer": "fine"})], sampling)
        assert pool.replaced >= 2
    finally:
        pool.shutdown()


def test_a_reward_in_a_process_of_its_own_is_bounded_and_replaced():
    """rl.reward_timeout_s: a call past the limit scores as an error and ends its process; a
    reward that ends its process fails after the second; one killed from outside mid-call is
    replaced and the call made again, to the same result."""
    import threading

    import psutil

    from raylm.rollout.rewards import Isolated, RewardFailed, score

    spec = "tests.integration.faults:reward_that_stalls_or_exits"
    quick = Isolated(spec, timeout_s=0.3)
    assert quick("q", "a", answer="fine") == {"reward": 0.0}
    with pytest.raises(TimeoutError, match="no result after rl.reward_timeout_s=0.3 s"):
        quick("q", "a", answer="slow")
    with pytest.raises(RuntimeError, match="died on this completion twice"):
        quick("q", "a", answer="exit")
    with pytest.raises(RewardFailed, match="^TypeError: .*answer"):
        quick("q", "a")
    scores = score(quick, ["q"] * 3, ["a"] * 3, [{"answer": "fine"}, {"answer": "slow"}, {}],
                   spec=spec)
    assert scores.rewards == [0.0, 0.0, 0.0] and scores.failed == 2
    assert scores.first_error.startswith("TimeoutError: no result after")

    def servers():
        return [p for p in psutil.process_iter(["cmdline"])
                if any("_RewardServer" in part for part in (p.info["cmdline"] or []))]

    before = {p.pid for p in servers()}
    patient = Isolated(spec, timeout_s=30)
    assert patient("q", "a", answer="fine") == {"reward": 0.0}
    (first,) = [p for p in servers() if p.pid not in before]
    killer = threading.Timer(0.2, lambda: first.kill())
    killer.start()
    assert patient("q", "a", answer="slow") == {"reward": 0.0}  # 0.6 s, killed at 0.2
    killer.join()
    # Its call was made again in a new process (one is started at a call, not before).
    assert not first.is_running()
    assert [p for p in servers() if p.pid not in before | {first.pid}]
    quick.close()
    patient.close()
    from raylm.faults import Mistake

    with pytest.raises(Mistake, match=r"rl.reward='nope:f' failed to load in its own process: "
                                      r"ValueError: rl.reward='nope:f': module 'nope'"):
        score(Isolated("nope:f", timeout_s=1), ["q"], ["a"], [{}], spec="nope:f")
