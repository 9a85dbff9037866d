"""The generators of a run, as rank 0 of its training group sees them: Ray actors on their own
resources (``rl.generators`` of ``rl.generator_resources``), handed each version of the
trainers' weights through the object store and asked for groups of completions. Asking
(:meth:`GeneratorPool.submit`) and waiting (:meth:`GeneratorPool.collect`) are apart, so that
off-policy training (``rl.max_staleness``) generates the steps ahead while the trainers train.

The count is a range, ``[fewest, most]``: the pool asks Ray for the most and samples with
those placed, as long as there are at least the fewest. One not placed yet (the cluster is
full, or an autoscaler is adding its node) joins at the first step after Ray places it, with
the newest weights; steps wait only while fewer than the fewest are placed.

A generator that dies (its process killed, its node lost) costs no training: its share of the
step's prompts goes to the others (or, below the fewest, to its replacement, asked of Ray at
once and on the same resources), and the groups that come back are the ones the lost generator
would have returned: they are sampled by the weights the share was asked of (the pool keeps
the last few versions), and seeded by prompt position (:mod:`raylm.rollout.generator`), so
which generator samples a prompt, and how many there are, changes no completion. A reward
call that fails scores 0 (:func:`raylm.rollout.rewards.score`); a reward that cannot run at
all raises :class:`raylm.faults.Mistake` in the generator, which ends the run here rather than
being retried; so do prompts whose generation or scoring ends the process of every generator
that takes them (a reward that exits or
crashes its interpreter, or runs it out of memory, on them): after
:data:`DEATHS_PER_SHARE` generators in a row, that is taken for what the prompts do, not for
machines lost. A generation that does not return is said, with its prompts' positions, every
``timeout_s`` it is waited for.

The pool belongs to the training group's rank 0; the generators belong to the run's
:class:`raylm.rollout.keeper.Keeper`, which the driver made (a pool given none makes its
own): a group that restarts takes the same generators, which load the weights of the
checkpoint it resumes from, and goes on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ray

from raylm.contracts.rollouts import Group, Prompt, Sampling
from raylm.faults import Mistake, last_line
from raylm.rollout.keeper import start_keeper

# Generators in a row that die holding the same prompts before those prompts are taken to be
# what kills them (a lost machine rarely takes two).
DEATHS_PER_SHARE = 3


@dataclass
class Submitted:
    """Prompts asked of the generators: each generator's share, the reference to its groups,
    and the generator asked (a share is asked again of another when it dies)."""

    shares: list[list[Prompt]]
    refs: list[Any]
    actors: list[Any]
    sampling: Sampling
    version: int


class GeneratorPool:
    """``count`` generator actors (a number, or ``(fewest, most)``), each made with ``init``
    (:class:`raylm.rollout.generator.Generator`'s arguments) and holding ``resources``, by
    ``keeper`` (:mod:`raylm.rollout.keeper`; None: one of the pool's own, ended with it);
    while fewer than the fewest are placed, the wait is said after ``timeout_s`` (with
    ``keep_waiting``) or stops the run (see :meth:`_placed`)."""

    def __init__(self, *, count: int | tuple[int, int], resources: dict[str, float],
                 init: dict[str, Any], keep: int = 1, timeout_s: float = 180.0,
                 keep_waiting: bool = False, keeper: Any = None, log=print) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.fewest, self.most = (count, count) if isinstance(count, int) else count
        self.asks = dict(resources)
        resources = dict(resources)
        # Outside any placement group: a Tune trial's workers run in placement groups whose
        # bundles hold nothing for a generator, and Ray would place it there to wait forever.
        self.options = {"num_cpus": resources.pop("CPU", 0.0),
                        "num_gpus": resources.pop("GPU", 0.0), "resources": resources,
                        "max_restarts": 0, "scheduling_strategy":
                        PlacementGroupSchedulingStrategy(placement_group=None)}
        self.weights: tuple[int, Any] | None = None
        # The newest ``keep`` versions' weights (an off-policy run's asked-for generations
        # are up to rl.max_staleness versions old): a share whose generator died is sampled
        # again by the version it was asked of.
        self.kept: dict[int, Any] = {}
        self.keep = keep
        self.timeout_s, self.keep_waiting, self.log = timeout_s, keep_waiting, log
        self.actors: list[Any] = []  # placed: each holds (or has queued) the newest weights
        # Asked of Ray, not placed yet: each with its first load's reference (None before the
        # first weights). Only the first load is queued on one: a generator waiting for a
        # node through many steps would otherwise hold every version in the object store.
        self.waiting: dict[Any, Any] = {}
        self.loading: list[tuple[Any, Any]] = []  # (placed generator, its load's reference)
        self.own_keeper = keeper is None
        self.keeper = start_keeper() if keeper is None else keeper
        # The keeper's generators: made now, or those a group before this one used (which
        # may be busy finishing what it asked; each joins once it has loaded these weights).
        actors, self.replaced = ray.get(self.keeper.generators.remote(
            self.most, self.options, init))
        self.waiting.update(dict.fromkeys(actors))

    def _start(self, dead: Any) -> None:
        """A generator in place of ``dead``, asked of the keeper."""
        actor, self.replaced = ray.get(self.keeper.replace.remote(dead))
        self.waiting[actor] = actor.load.remote(*self.weights) if self.weights else None

    def load(self, version: int, weights: dict) -> float:
        """Hand every generator ``weights`` as ``version``, after what it was asked before
        (an actor runs its calls in order: a generation in flight finishes on the weights it
        started with). Returns the seconds it took to put them into the object store; the
        generators' copies are waited for by the next :meth:`collect`."""
        t0 = time.perf_counter()
        ref = ray.put(weights)
        self.weights = (version, ref)
        self.kept[version] = ref
        for old in sorted(self.kept)[:-self.keep]:
            del self.kept[old]
        self.loading += [(a, a.load.remote(version, ref)) for a in self.actors]
        for actor, first in self.waiting.items():
            if first is None:
                self.waiting[actor] = actor.load.remote(version, ref)
        return time.perf_counter() - t0

    def submit(self, prompts: list[Prompt], sampling: Sampling) -> Submitted:
        """Ask for the groups of ``prompts`` from the weights loaded last, spread over the
        generators placed by now; :meth:`collect` waits for them."""
        self.join()
        n = len(self.actors)
        version = self.weights[0] if self.weights is not None else 0
        shares = [prompts[i::n] for i in range(n)]
        refs = [self.actors[i].generate.remote(shares[i], sampling, version=version)
                if shares[i] else None for i in range(n)]
        return Submitted(shares, refs, list(self.actors), sampling, version)

    def collect(self, submitted: Submitted) -> list[Group]:
        """The groups of a submission, in its prompts' order; a share whose generator died is
        generated again by another, from the weights it was asked of (so the groups are the
        ones the lost generator would have returned)."""
        n = len(submitted.shares)
        results: list[list[Group] | None] = [None] * n
        for i, ref in enumerate(submitted.refs):
            deaths = 0
            while ref is not None and results[i] is None:
                try:
                    results[i] = self._wait(ref, submitted.shares[i])
                except ray.exceptions.RayTaskError as e:
                    if isinstance(e.cause, Mistake):
                        raise Mistake(str(e.cause)) from None
                    raise
                except ray.exceptions.RayActorError as e:  # died, or its node is unreachable
                    deaths += 1
                    if deaths >= DEATHS_PER_SHARE:
                        raise Mistake(
                            f"{deaths} generators in a row died sampling or scoring the prompts "
                            f"at positions {positions(submitted.shares[i])}: their generation "
                            f"or reward ends the generator's process (a reward that exits or "
                            f"crashes, or memory); the last: {str(e).splitlines()[0]}") from None
                    self._lost(submitted.actors[i])
                    self.join()
                    submitted.actors[i] = actor = self.actors[i % len(self.actors)]
                    ref = self._again(actor, submitted.shares[i], submitted.sampling,
                                      submitted.version)
        # Loads done by now are checked; one still queued behind a generation asked before it
        # (off-policy, more than a step ahead) is not waited for.
        self.wait_loaded(block=False)
        out: list[Group | None] = [None] * sum(len(s) for s in submitted.shares)
        for i, groups in enumerate(results):
            for k, group in enumerate(groups or []):
                out[i + k * n] = group
        return out  # type: ignore[return-value]

    def _wait(self, ref, share: list[Prompt]) -> list[Group]:
        """``ref``'s groups, said every ``timeout_s`` they are waited for."""
        t0 = time.monotonic()
        while not ray.wait([ref], timeout=self.timeout_s)[0]:
            self.log(f"raylm: warning: waited {time.monotonic() - t0:.0f} s for the groups of "
                     f"the prompts at positions {positions(share)} from a generator; a "
                     f"generation or reward function that does not return holds the run here")
        return ray.get(ref)

    def _again(self, actor, share: list[Prompt], sampling: Sampling, version: int):
        """``share`` asked of ``actor`` with ``version``'s weights, which it loads for it
        (the newest kept if that one is gone), then the newest weights again."""
        version = version if version in self.kept else max(self.kept)
        actor.load.remote(version, self.kept[version])
        ref = actor.generate.remote(share, sampling, version=version)
        self.loading.append((actor, actor.load.remote(*self.weights)))
        return ref

    def generate(self, prompts: list[Prompt], sampling: Sampling) -> list[Group]:
        """The groups of ``prompts`` from the weights loaded last, waited for."""
        return self.collect(self.submit(prompts, sampling))

    def started(self) -> None:
        """Wait for the fewest generators to hold the weights loaded first (see
        :meth:`_placed`), and for the loads of those placed."""
        self.join()
        self.wait_loaded()

    def join(self) -> None:
        """The generators Ray has placed since the last look join the pool (with the newest
        weights); while fewer than the fewest are placed, wait for more (:meth:`_placed`)."""
        assert self.weights is not None, "the generators are handed weights before use"
        while True:
            firsts = [ref for ref in self.waiting.values() if ref is not None]
            short = self.fewest - len(self.actors)
            if short > 0:
                self._placed(firsts, short, what="generator actor(s)")
            done = set(ray.wait(firsts, num_returns=len(firsts), timeout=0)[0]) if firsts else ()
            for actor, first in list(self.waiting.items()):
                if first not in done:
                    continue
                del self.waiting[actor]
                try:
                    joined = ray.get(first)
                except ray.exceptions.RayActorError as e:  # lost before it joined
                    if e.actor_init_failed:  # its model or reward: the next would fail alike
                        raise Mistake(f"a generator failed as it started: {last_line(e)}"
                                      ) from None
                    self._start(actor)
                    continue
                self.actors.append(actor)
                if joined != self.weights[0]:  # placed versions after its first load
                    self.loading.append((actor, actor.load.remote(*self.weights)))
            if len(self.actors) >= self.fewest:
                return

    def _placed(self, refs: list, needed: int, *, what: str) -> None:
        """Wait for ``needed`` of ``refs`` (first loads of generators not placed yet); when
        they are not done ``timeout_s`` after this is called, the generators are named with
        what they ask for instead of waited for in silence: with ``keep_waiting`` (an
        autoscaling cluster) that is said every ``timeout_s`` and the wait goes on, else the
        run stops with it (a fault: a lost node's replacement may come)."""
        t0 = time.monotonic()
        while len(ray.wait(refs, num_returns=needed, timeout=self.timeout_s)[0]) < needed:
            free = ray.available_resources()
            message = (f"{needed} {what} asking for {self.asks} each not started after "
                       f"{time.monotonic() - t0:.0f} s ({len(self.actors)} running, "
                       f"rl.generators asks for at least {self.fewest}); the cluster has free: "
                       + (", ".join(f"{k} {free.get(k, 0):g}" for k in self.asks) or "-"))
            if not self.keep_waiting:
                raise RuntimeError(f"{message}. Fewer or smaller generators "
                                   f"(rl.generators, rl.generator_resources) would fit")
            self.log(f"raylm: warning: {message}; waiting on, as scaling.wait_for_nodes asks")

    def wait_loaded(self, *, block: bool = True) -> None:
        """Check the loads asked of the placed generators: every one, waited for (``block``),
        or those done now. A generator whose load finds it dead is replaced."""
        while self.loading:
            refs = [ref for _, ref in self.loading]
            done = set(ray.wait(refs, num_returns=len(refs), timeout=None if block else 0)[0])
            checked = [(a, r) for a, r in self.loading if r in done]
            self.loading = [(a, r) for a, r in self.loading if r not in done]
            for actor, ref in checked:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    self._lost(actor)
            if not block:
                return

    def _lost(self, actor) -> None:
        """``actor`` died (or cannot be reached: it is killed, so that it cannot come back
        beside its replacement): out of the pool, and a new one asked of Ray in its place."""
        if actor not in self.actors:  # lost already
            return
        self.actors.remove(actor)
        self.loading = [(a, r) for a, r in self.loading if a is not actor]
        self._start(actor)

    def shutdown(self) -> None:
        """End the generators, if the pool's own keeper holds them (a run's keeper is its
        driver's to end)."""
        if self.own_keeper:
            ray.kill(self.keeper)


def positions(share: list[Prompt]) -> str:
    """The sample positions of ``share``, the first few."""
    shown = [p.position for p in share[:8]]
    return f"{shown}{' ...' if len(share) > 8 else ''}"
