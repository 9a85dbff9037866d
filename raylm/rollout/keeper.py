"""The owner of a run's generator actors, so that they outlive the training group's restarts.

Ray ends an actor with the process that made it: made by the training group's rank 0, every
generator died with each restart of the group and was built again (a process, the model, the
reward, a place on the cluster). The driver makes a :class:`Keeper` instead, before the group
starts: a small actor on the driver's node that asks for no CPU, which makes the generators
and their replacements for the pool (:class:`raylm.rollout.pool.GeneratorPool`, on rank 0). A
restarted group's pool takes the same generators, which load the weights it resumes from; the
driver ends the keeper, and the generators with it, as the run ends. Only the actors' lives
are kept: what the lost group generated after its checkpoint came from weights the resumed
group trains again, and is generated again. No torch here: the keeper builds no model.
"""

from __future__ import annotations

from typing import Any

import ray


class GeneratorActor:
    """:class:`raylm.rollout.generator.Generator` as an actor, imported in its own process."""

    def __init__(self, **init: Any) -> None:
        from raylm.rollout.generator import Generator

        self.generator = Generator(**init)

    def load(self, version: int, weights: dict) -> int:
        return self.generator.load(version, weights)

    def generate(self, prompts: list, sampling, *, version: int) -> list:
        return self.generator.generate(prompts, sampling, version=version)


class Keeper:
    """The generators of one run (see the module's docstring); a Ray actor."""

    def __init__(self) -> None:
        self.actors: list[Any] = []
        self.replaced = 0
        self.made: tuple[dict[str, Any], dict[str, Any]] | None = None

    def generators(self, count: int, options: dict[str, Any], init: dict[str, Any]
                   ) -> tuple[list[Any], int]:
        """``count`` generators, made with Ray's ``options`` and the generator's ``init``
        the first time (a restarted group asks the same), and the replacements so far."""
        self.made = self.made or (options, init)
        while len(self.actors) < count:
            self.actors.append(self._make())
        return list(self.actors), self.replaced

    def replace(self, dead: Any) -> tuple[Any, int]:
        """A generator in place of ``dead`` (ended first: it may be only unreachable), and
        the replacements so far."""
        if dead in self.actors:
            self.actors.remove(dead)
            ray.kill(dead, no_restart=True)
        self.actors.append(self._make())
        self.replaced += 1
        return self.actors[-1], self.replaced

    def _make(self) -> Any:
        options, init = self.made
        return ray.remote(GeneratorActor).options(**options).remote(**init)


def start_keeper() -> Any:
    """A :class:`Keeper` on this process's node, ended with this process (its owner)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return ray.remote(Keeper).options(
        num_cpus=0, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()
