"""The generators of a run, as rank 0 of its training group sees them: Ray actors on their own
resources (``rl.generators`` of ``rl.generator_resources``), handed each version of the
trainers' weights through the object store and asked for groups of completions.

A generator that dies (its process killed, its node lost) costs no training: its share of the
step's prompts goes to a replacement, started on the same resources with the newest weights,
and the groups it returns are the ones the lost generator would have returned (they are
seeded by prompt position: :mod:`raylm.rollout.generator`). A reward function that fails on
every completion of a batch raises :class:`raylm.faults.Mistake` in the generator, which ends
the run here rather than being retried.

The pool belongs to the training group's rank 0 (Ray ties an actor's life to the process that
started it): a group that restarts starts its generators anew, with the weights of the
checkpoint it resumes from.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from raylm.faults import Mistake
from raylm.rollout.generator import Generator, Group, Prompt, Sampling


class GeneratorPool:
    """``count`` generator actors, each made with ``init`` (:class:`Generator`'s arguments)
    and holding ``resources``."""

    def __init__(self, *, count: int, resources: dict[str, float], init: dict[str, Any]
                 ) -> None:
        resources = dict(resources)
        self.options = {"num_cpus": resources.pop("CPU", 0.0),
                        "num_gpus": resources.pop("GPU", 0.0), "resources": resources,
                        "max_restarts": 0}
        self.init = init
        self.weights: tuple[int, Any] | None = None
        self.actors = [self._start() for _ in range(count)]
        self.replaced = 0

    def _start(self):
        return ray.remote(Generator).options(**self.options).remote(**self.init)

    def load(self, version: int, weights: dict) -> float:
        """Hand every generator ``weights`` as ``version``; the seconds it took (the transfer
        through the object store, and each generator's copy into its model)."""
        t0 = time.perf_counter()
        ref = ray.put(weights)
        self.weights = (version, ref)
        for i, done in self._each(lambda a: a.load.remote(version, ref)):
            if done is None:
                self.actors[i] = self._replacement(self.actors[i])
        return time.perf_counter() - t0

    def generate(self, prompts: list[Prompt], sampling: Sampling, *, version: int
                 ) -> list[Group]:
        """The groups of ``prompts``, in their order, spread over the generators; a share
        whose generator died is generated again by its replacement."""
        n = len(self.actors)
        shares = [prompts[i::n] for i in range(n)]
        results: list[list[Group] | None] = [None] * n
        while any(r is None for r, s in zip(results, shares, strict=True) if s):
            pending = {i: self.actors[i].generate.remote(shares[i], sampling, version=version)
                       for i in range(n) if shares[i] and results[i] is None}
            for i, ref in pending.items():
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    if isinstance(e.cause, Mistake):
                        raise Mistake(str(e.cause)) from None
                    raise
                except ray.exceptions.RayActorError:  # died, or its node is unreachable
                    self.actors[i] = self._replacement(self.actors[i])
        out: list[Group | None] = [None] * len(prompts)
        for i, groups in enumerate(results):
            for k, group in enumerate(groups or []):
                out[i + k * n] = group
        return out  # type: ignore[return-value]

    def _replacement(self, lost):
        """A new generator with the newest weights, for one that died (or cannot be reached:
        it is killed, so that it cannot come back beside its replacement)."""
        ray.kill(lost, no_restart=True)
        self.replaced += 1
        actor = self._start()
        if self.weights is not None:
            ray.get(actor.load.remote(*self.weights))
        return actor

    def _each(self, call):
        """``call`` on every generator: (index, its result, or None where it died)."""
        refs = [call(a) for a in self.actors]
        for i, ref in enumerate(refs):
            try:
                yield i, ray.get(ref)
            except ray.exceptions.RayActorError:
                yield i, None

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
