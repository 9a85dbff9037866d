"""The rollouts of a run between their generation and their training, on the training group's
rank 0: groups generated ahead (off-policy, ``rl.max_staleness``), groups still being
generated, and the checkpoint's copy of both.

An off-policy run asks for the groups of the next ``max_staleness`` steps' prompts while the
trainers train (:meth:`Buffer.ask`): each is sampled by the weights of its asking step. A step
takes its prompts' groups (:meth:`Buffer.take`) from those ready, from the generations in
flight (waited for), or, for prompts never asked for (the first steps of a group), generated
then. A checkpoint keeps the groups asked for and not yet trained (:meth:`Buffer.saved`, the
file ``rollouts.json`` beside the shards), so the resumed run trains on the same completions,
of the same versions, as the run it continues: none is lost, and none generated twice by
weights the run never had at that step. The file is a record,
:class:`raylm.contracts.rollouts.SavedRollouts`, with the sampling settings that made it.
"""

from __future__ import annotations

from raylm.contracts.rollouts import Group, Prompt, Sampling, SavedRollouts
from raylm.rollout.pool import GeneratorPool, Submitted


class Buffer:
    """``pool``'s groups by sample position, ready or in flight."""

    def __init__(self, pool: GeneratorPool, *, ready: dict[int, Group] | None = None) -> None:
        self.pool = pool
        self.ready: dict[int, Group] = dict(ready or {})
        self.flight: list[tuple[set[int], Submitted]] = []

    def ask(self, prompts: list[Prompt], sampling: Sampling) -> None:
        """Start generating ``prompts``' groups with the weights the pool holds now."""
        if prompts:
            self.flight.append(({p.position for p in prompts},
                                self.pool.submit(prompts, sampling)))

    def take(self, prompts: list[Prompt], sampling: Sampling) -> list[Group]:
        """``prompts``' groups, in order, each taken out of the buffer (waited for where in
        flight, generated now where never asked for)."""
        wanted = {p.position for p in prompts}
        while any(wanted & positions for positions, _ in self.flight):
            self._land(0)
        # Kept groups that answer another prompt than the data holds at their position (a
        # resume on other data, checkpoint.accept_changes=data) are sampled again, not trained.
        other = [p.position for p in prompts
                 if p.position in self.ready and self.ready[p.position].prompt_ids != p.ids]
        if other:
            print(f"raylm: warning: the rollouts kept for sample positions {other[:8]} answer "
                  f"other prompts than the data holds there: they are sampled again")
            for position in other:
                del self.ready[position]
        missing = [p for p in prompts if p.position not in self.ready]
        for group in self.pool.generate(missing, sampling) if missing else []:
            self.ready[group.position] = group
        return [self.ready.pop(p.position) for p in prompts]

    def settle(self) -> None:
        """Wait for every generation in flight."""
        while self.flight:
            self._land(0)

    def _land(self, i: int) -> None:
        _, submitted = self.flight.pop(i)
        for group in self.pool.collect(submitted):
            self.ready[group.position] = group

    def saved(self, *, through_step: int, sampling: Sampling) -> bytes:
        """The groups asked for and not yet trained on, as the checkpoint keeps them
        (``through_step``: the last step whose prompts were asked for; ``sampling``: how
        they were sampled)."""
        self.settle()
        return SavedRollouts(through_step, list(self.ready.values()), sampling
                             ).to_json().encode()
