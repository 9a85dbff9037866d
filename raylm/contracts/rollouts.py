"""What reinforcement learning's processes hand each other and keep: a :class:`Prompt` to
answer (trainers' rank 0 to the generators), the :class:`Sampling` that answers it, the
:class:`Group` of completions that comes back, and :class:`SavedRollouts`, the checkpoint's
``rollouts.json``: the groups asked for and not yet trained on, with the sampling that made
them. No torch: the generators, the trainers and the tests read them alike.

``rollouts.json`` is data, never code: plain JSON, every field of every group checked as it is
read (a file of raylm before the record carried a version, 1, reads as before, its sampling
unknown).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from raylm.contracts import CHECKPOINT_ROLLOUTS, Malformed, _Record


@dataclass(frozen=True)
class Prompt:
    """One prompt to answer: its sample position (what seeds its group), its tokens, and the
    row as the data holds it (the prompt and the columns the reward reads)."""

    position: int
    ids: list[int]
    prompt: Any
    columns: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled: ``group_size`` per prompt, at ``temperature`` (0: the
    most likely token each time) and nucleus ``top_p``, at most ``max_tokens`` each."""

    group_size: int
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256

    def differences(self, other: Sampling) -> list[str]:
        """The settings ``other`` samples with otherwise, as ``name a -> b``."""
        return [f"{f.name} {getattr(self, f.name)} -> {getattr(other, f.name)}"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


@dataclass
class Group:
    """A prompt's completions (tokens without the prompt's, the closing EOS included where
    sampling ended with it), their tokens' log-probabilities, rewards and reward parts, and
    the weight version that sampled them."""

    position: int
    version: int
    prompt_ids: list[int]
    completions: list[list[int]]
    logps: list[list[float]]
    rewards: list[float]
    parts: dict[str, list[float]]
    truncated: list[bool]
    failed: int = 0
    first_error: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    """Spent sampling (``generate_s``) and scoring (``reward_s``) this group."""
    ref_logps: list[list[float]] | None = None
    """The completions' tokens' log-probabilities under the reference (with a KL penalty)."""


def _ints(xs: Any) -> bool:
    return isinstance(xs, list) and all(type(x) is int for x in xs)


def _numbers(xs: Any) -> bool:
    return isinstance(xs, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                        and math.isfinite(x) for x in xs)


def _per_token(values: Any, completions: list) -> bool:
    return (isinstance(values, list) and len(values) == len(completions)
            and all(_numbers(v) and len(v) == len(c)
                    for v, c in zip(values, completions, strict=True)))


def group_from_dict(d: Any) -> Group:
    """A :class:`Group` from its :func:`dataclasses.asdict`, every field checked."""
    names = {f.name for f in fields(Group)}
    if isinstance(d, dict):
        d = {"ref_logps": None, **d}  # kept before the KL penalty's reference had a field
    if not isinstance(d, dict) or set(d) != names:
        raise Malformed(f"{CHECKPOINT_ROLLOUTS} is malformed (a group holds the fields "
                        f"{sorted(names)})")
    n = len(d["completions"]) if isinstance(d["completions"], list) else -1
    ok = (type(d["position"]) is int and type(d["version"]) is int and _ints(d["prompt_ids"])
          and n > 0 and all(_ints(c) for c in d["completions"])
          and _per_token(d["logps"], d["completions"])
          and _numbers(d["rewards"]) and len(d["rewards"]) == n
          and isinstance(d["parts"], dict)
          and all(_numbers(v) and len(v) == n for v in d["parts"].values())
          and isinstance(d["truncated"], list) and len(d["truncated"]) == n
          and all(type(t) is bool for t in d["truncated"]) and type(d["failed"]) is int
          and (d["first_error"] is None or isinstance(d["first_error"], str))
          and isinstance(d["seconds"], dict) and _numbers(list(d["seconds"].values()))
          and (d["ref_logps"] is None or _per_token(d["ref_logps"], d["completions"])))
    if not ok:
        raise Malformed(f"{CHECKPOINT_ROLLOUTS} is malformed (the group of position "
                        f"{d.get('position')!r})")
    return Group(**d)


# The most negative log-probability float32 holds: a smaller one is -inf in the step.
LOWEST_LOGP = -3.4028234663852886e38


def unfit(groups: list[Group], *, vocab_size: int, group_size: int, step: int) -> str | None:
    """What kept ``groups`` hold that a run resumed at ``step`` cannot train on, or None:
    token ids outside its vocabulary, a log-probability that is positive or not finite in
    float32, another count of completions than its group size, weights of a later version
    than the step."""
    for g in groups:
        ids = [g.prompt_ids, *g.completions]
        logps = [x for per in [*g.logps, *(g.ref_logps or [])] for x in per]
        why = ("a token id outside the vocabulary of " + str(vocab_size)
               if any(not 0 <= t < vocab_size for seq in ids for t in seq) else
               "a log-probability that is positive or not finite in float32"
               if any(not LOWEST_LOGP <= x <= 0 for x in logps) else
               f"{len(g.completions)} completions, not rl.group_size={group_size}"
               if len(g.completions) != group_size else
               f"weights of version {g.version}, after the checkpoint's step {step}"
               if g.version > step else None)
        if why:
            return f"the group of sample position {g.position} holds {why}"
    return None


def _sampling_ok(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and set(v) == {f.name for f in fields(Sampling)}
                         and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                 and math.isfinite(x) for x in v.values()))


@dataclass(frozen=True)
class SavedRollouts(_Record):
    """``rollouts.json``, which rank 0 writes into an off-policy run's checkpoint: the groups
    asked for and not yet trained on, by the weights of the steps that asked for them, the
    last step whose prompts were asked for (``through_step``), and how they were sampled
    (None in files of version 1, which did not say)."""

    FILE = CHECKPOINT_ROLLOUTS
    CHECKS = {"through_step": (lambda v: type(v) is int, "a step number"),
              "groups": (lambda v: isinstance(v, list), "a list of groups"),
              "sampling": (_sampling_ok, "the sampling's settings")}

    through_step: int
    groups: list[Group]
    sampling: Sampling | None = None

    def to_json(self) -> str:
        return json.dumps({"version": self.VERSION, "through_step": self.through_step,
                           "sampling": None if self.sampling is None else asdict(self.sampling),
                           "groups": [asdict(g) for g in self.groups]})

    @classmethod
    def _checked(cls, data: dict) -> SavedRollouts:
        saved = super()._checked(data)
        sampling = saved.sampling and Sampling(**saved.sampling)
        return cls(saved.through_step, [group_from_dict(g) for g in saved.groups], sampling)
