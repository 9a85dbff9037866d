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
weights the run never had at that step. Plain JSON, read back field by field
(:func:`group_from_dict`): a checkpoint's file is data, never code.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, fields
from typing import Any

from raylm.rollout.generator import Group, Prompt, Sampling
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
        missing = [p for p in prompts if p.position not in self.ready]
        for group in self.pool.generate(missing, sampling) if missing else []:
            self.ready[group.position] = group
        out = []
        for p in prompts:
            group = self.ready.pop(p.position)
            if group.prompt_ids != p.ids:
                raise RuntimeError(f"the rollouts kept for sample position {p.position} answer "
                                   f"another prompt than the data holds there")
            out.append(group)
        return out

    def settle(self) -> None:
        """Wait for every generation in flight."""
        while self.flight:
            self._land(0)

    def _land(self, i: int) -> None:
        _, submitted = self.flight.pop(i)
        for group in self.pool.collect(submitted):
            self.ready[group.position] = group

    def saved(self, *, through_step: int) -> bytes:
        """The groups asked for and not yet trained on, as the checkpoint keeps them
        (``through_step``: the last step whose prompts were asked for)."""
        self.settle()
        return json.dumps({"through_step": through_step,
                           "groups": [asdict(g) for g in self.ready.values()]}).encode()


def load_saved(data: bytes, *, where: str) -> tuple[int, dict[int, Group]]:
    """A checkpoint's rollouts: the last step asked for and the groups by position."""
    try:
        saved = json.loads(data)
        through = saved["through_step"]
        groups = [group_from_dict(g) for g in saved["groups"]]
        if not isinstance(through, int):
            raise TypeError("through_step is not an integer")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: not the rollouts raylm keeps in a checkpoint ({e})") from None
    return through, {g.position: g for g in groups}


def group_from_dict(d: Any) -> Group:
    """A :class:`Group` from its :func:`dataclasses.asdict`, every field checked."""
    names = {f.name for f in fields(Group)}
    if isinstance(d, dict):
        d = {"ref_logps": None, **d}  # kept before the KL penalty's reference had a field
    if not isinstance(d, dict) or set(d) != names:
        raise TypeError(f"a group holds the fields {sorted(names)}")
    n = len(d["completions"])

    def ints(xs):
        return isinstance(xs, list) and all(type(x) is int for x in xs)

    def numbers(xs):
        return isinstance(xs, list) and all(isinstance(x, (int, float)) and not
                                            isinstance(x, bool) and math.isfinite(x) for x in xs)

    ok = (type(d["position"]) is int and type(d["version"]) is int and ints(d["prompt_ids"])
          and all(ints(c) for c in d["completions"]) and len(d["logps"]) == n
          and all(numbers(lp) and len(lp) == len(c)
                  for lp, c in zip(d["logps"], d["completions"], strict=True))
          and numbers(d["rewards"]) and len(d["rewards"]) == n
          and isinstance(d["parts"], dict)
          and all(numbers(v) and len(v) == n for v in d["parts"].values())
          and isinstance(d["truncated"], list) and len(d["truncated"]) == n
          and all(type(t) is bool for t in d["truncated"]) and type(d["failed"]) is int
          and (d["first_error"] is None or isinstance(d["first_error"], str))
          and isinstance(d["seconds"], dict) and numbers(list(d["seconds"].values()))
          and (d["ref_logps"] is None or isinstance(d["ref_logps"], list)
               and len(d["ref_logps"]) == n
               and all(numbers(lp) and len(lp) == len(c)
                       for lp, c in zip(d["ref_logps"], d["completions"], strict=True))))
    if not ok:
        raise TypeError(f"the group of position {d.get('position')!r} is malformed")
    return Group(**d)
