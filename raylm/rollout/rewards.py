"""Rewards of completions for reinforcement learning (``train.objective=grpo``): a user's
Python function named ``module:function``, checked once before Ray starts, then called on
every completion in the process that generated it. Torch-free: the preflight imports it.

A reward function takes the prompt (as the data row holds it: a string, or a list of chat
messages), the completion's text and the row's other columns as keyword arguments, and
returns a number, or a mapping of named numbers (each part recorded, their sum the reward)::

    def reward(prompt, completion, *, answer, **row):
        return float(completion.strip() == answer)

What a run does with what comes back is fixed here: a function that raises (or returns
something that is not a number) on one completion scores it 0, counted and reported; one that
fails on every completion of a batch is a mistake in the run's input, which no retry fixes,
and ends the run with its first error. Built in: :func:`exact_match` and :func:`final_number`,
which read the row's ``answer`` column (``raylm.rollout.rewards:exact_match``).

With ``rl.reward_timeout_s`` the function runs in a process of its own (:class:`Isolated`: a
Ray actor on the generator's node, which Ray can end and replace, as no thread can end a call
that does not return): a call past the limit is ended with its process and scores 0, a
process that dies is replaced and the call made again once, so a reward that runs generated
code can neither hold a run nor take its generator with it.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import math
import numbers
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raylm.faults import Mistake, last_line

Reward = Callable[..., Any]
# The built-ins' short names, for rl.reward: exact_match rather than the module path.
BUILTIN = "raylm.rollout.rewards"


def load_reward(spec: str, *, key: str = "rl.reward") -> Reward:
    """The callable ``spec`` names (``module:function``, ``path/to/file.py:function``, or a
    built-in's name alone); a :class:`ValueError` naming ``key`` and the fix where it cannot
    be had."""
    if ":" not in spec:
        if spec in ("exact_match", "final_number"):
            spec = f"{BUILTIN}:{spec}"
        else:
            raise ValueError(f"{key}={spec!r}: name a function as module:function (a module "
                             f"importable where the run's workers run) or file.py:function, "
                             f"or a built-in: exact_match, final_number")
    module_name, _, attr = spec.rpartition(":")
    try:
        module = (_from_file(module_name) if module_name.endswith(".py")
                  else importlib.import_module(module_name))
    except (ImportError, OSError) as e:
        raise ValueError(f"{key}={spec!r}: module {module_name!r} does not import ({e}); "
                         f"install it, put its folder on PYTHONPATH or name its file") from e
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"{key}={spec!r}: {module_name} has no {attr!r}")
    if not callable(fn):
        raise ValueError(f"{key}={spec!r}: {attr} is a {type(fn).__name__}, not a function")
    return fn


def _from_file(path: str):
    """The module of a Python file, imported once per process under a name of its path's."""
    import importlib.util
    import sys

    name = "raylm_reward_" + re.sub(r"\W", "_", os.path.abspath(path))
    if name not in sys.modules:
        found = importlib.util.spec_from_file_location(name, path)
        if found is None or not os.path.isfile(path):
            raise ImportError(f"no Python file {path}")
        module = importlib.util.module_from_spec(found)
        found.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def check_reward(fn: Reward, row: Mapping[str, Any], *, prompt_field: str, spec: str,
                 key: str = "rl.reward") -> dict[str, float]:
    """Call ``fn`` once on ``row`` (a data row) with its own answer column as the completion
    where it has one, else an empty completion, as the run will call it; its parts, or a
    :class:`ValueError` saying what is wrong with the function."""
    prompt, columns = split_row(row, prompt_field=prompt_field)
    try:
        inspect.signature(fn).bind(prompt, "", **columns)
    except TypeError as e:
        raise ValueError(f"{key}={spec!r} cannot be called as fn(prompt, completion, "
                         f"**columns) with this data's columns {sorted(columns)}: {e}") from e
    completion = str(columns.get("answer", ""))
    try:
        value = fn(prompt, completion, **columns)
    except (Exception, SystemExit) as e:  # a reward's exit is its failure, not the dry run's
        raise ValueError(f"{key}={spec!r} raised on the data's first row: {said(e)}") from e
    try:
        return parts_of(value)
    except TypeError as e:
        raise ValueError(f"{key}={spec!r} on the data's first row: {e}") from e


def split_row(row: Mapping[str, Any], *, prompt_field: str) -> tuple[Any, dict[str, Any]]:
    """The prompt and the other columns of a data row."""
    columns = {k: v for k, v in row.items() if k != prompt_field}
    return row[prompt_field], columns


# A part is logged as the metric rl_reward_<name>: MLflow's characters, and none of the names
# of the reward's own figures beside it (rl_reward_std, rl_reward_failures, rl_reward_s).
PART_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
TAKEN = ("std", "failures", "s")
# The step trains in float32: a reward past its range would be infinite there.
FLOAT32_MAX = 3.4028234663852886e38


def parts_of(value: Any) -> dict[str, float]:
    """A reward function's result as named parts (one, ``reward``, for a number); a
    :class:`TypeError` for anything else, for a part that is not a finite number in float32
    (nor their sum), or for a part name MLflow or the run's own figures would not take."""
    if isinstance(value, Mapping):
        if not value:
            raise TypeError("returned an empty mapping; return a number or named numbers")
        items = list(value.items())
    else:
        items = [("reward", value)]
    parts: dict[str, float] = {}
    for name, v in items:
        if not isinstance(name, str) or not PART_NAME.fullmatch(name) or name in TAKEN:
            raise TypeError(f"returned a part named {name!r:.80}: a part's name is 1 to 64 "
                            f"letters, digits, '_', '-' or '.', and not {', '.join(TAKEN)}")
        try:
            f = float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else None
        except OverflowError:
            f = None
        if f is None or not abs(f) <= FLOAT32_MAX:
            raise TypeError(f"returned {v!r:.80} for {name!r}: a reward is a finite number "
                            f"(or a mapping of names to finite numbers), within float32's "
                            f"range")
        parts[name] = f
    if not abs(sum(parts.values())) <= FLOAT32_MAX:
        raise TypeError("returned parts whose sum is past float32's range")
    return parts


def said(error: BaseException) -> str:
    """A reward's error as one line the console can print: its first line, control
    characters escaped, at most 200 characters (its text is often the model's output)."""
    text = f"{type(error).__name__}: {error}".strip()
    line = text.splitlines()[0] if text else type(error).__name__
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)
    return line if len(line) <= 200 else line[:200] + "..."


class RewardFailed(Exception):
    """The reward function failed in its own process; the message is its error's."""


class Isolated:
    """The reward function ``spec`` called in a Ray actor of its own on this node, each call
    bounded by ``timeout_s`` (see the module's docstring); called as the function is."""

    def __init__(self, spec: str, *, timeout_s: float) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        self.actor = None

    def _started(self):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self.actor is None:
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                  soft=False)
            self.actor = ray.remote(_RewardServer).options(
                num_cpus=0, max_restarts=0, scheduling_strategy=here).remote(self.spec)
            limit = max(60.0, self.timeout_s)
            try:  # its start is not the call's time
                ray.get(self.actor.ready.remote(), timeout=limit)
            except ray.exceptions.GetTimeoutError:
                self.close()
                raise RuntimeError(f"the reward's process did not start in {limit:g} s") from None
            except ray.exceptions.RayActorError as e:  # the function does not load there
                self.close()
                raise Mistake(f"rl.reward={self.spec!r} failed to load in its own process: "
                              f"{last_line(e)}") from None
        return self.actor

    def close(self) -> None:
        """End the process, if any (a later call starts another)."""
        import ray

        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)
        self.actor = None

    def __call__(self, prompt: Any, completion: str, **columns: Any) -> dict[str, float]:
        import ray

        died = False
        while True:
            ref = self._started().score.remote(prompt, completion, columns)
            try:
                return ray.get(ref, timeout=self.timeout_s)
            except ray.exceptions.GetTimeoutError:
                self.close()
                raise TimeoutError(f"no result after rl.reward_timeout_s={self.timeout_s:g} s; "
                                   f"its process was ended") from None
            except ray.exceptions.RayTaskError as e:
                raise RewardFailed(str(e.cause) if e.cause else last_line(e)) from None
            except ray.exceptions.RayActorError:  # killed, or the function ended it
                self.close()
                if died:
                    raise RuntimeError("the reward's process died on this completion twice"
                                       ) from None
                died = True


class _RewardServer:
    """The process a reward function runs in, for :class:`Isolated`."""

    def __init__(self, spec: str) -> None:
        self.fn = load_reward(spec)

    def ready(self) -> bool:
        return True

    def score(self, prompt: Any, completion: str, columns: dict[str, Any]) -> dict[str, float]:
        try:
            return parts_of(self.fn(prompt, completion, **columns))
        except (Exception, SystemExit) as e:  # a user's function: its error, as a message
            raise RewardFailed(said(e)) from None


@dataclass
class Scores:
    """A batch's rewards, their named parts (absent parts 0), and the completions whose
    function failed (each scored 0), with the first one's error (one line: :func:`said`)."""

    rewards: list[float]
    parts: dict[str, list[float]]
    failed: int = 0
    first_error: str | None = None


def score(fn: Reward, prompts: Sequence[Any], completions: Sequence[str],
          columns: Sequence[Mapping[str, Any]], *, spec: str) -> Scores:
    """The rewards of ``completions`` (each of its prompt and row's columns). A call that
    fails (any error, a timeout, an exit) scores its completion 0, however many do: one prompt
    the function cannot score ends no run (see :func:`check_step`). Each call gets its own
    copy of the prompt and the row: a function that changes them changes nothing for the
    next."""
    results: list[dict[str, float] | None] = []
    failed, first = 0, None
    for prompt, completion, cols in zip(prompts, completions, columns, strict=True):
        try:
            results.append(parts_of(fn(copy.deepcopy(prompt), completion,
                                       **copy.deepcopy(dict(cols)))))
        except Mistake:  # not the completion's: the function cannot run at all
            raise
        except (Exception, SystemExit) as e:  # a user's function: it scores the completion 0
            failed += 1
            first = first or (str(e) if isinstance(e, RewardFailed) else said(e))
            results.append(None)
    names = sorted({name for r in results if r for name in r})
    parts = {n: [(r or {}).get(n, 0.0) for r in results] for n in names}
    rewards = [sum((r or {}).values()) for r in results]
    return Scores(rewards, parts, failed, first)


def check_step(groups: Sequence[Any], *, spec: str) -> None:
    """A training step's groups (:class:`raylm.contracts.rollouts.Group`) whose every
    completion's reward failed, none for a timeout, is a :class:`Mistake`: the function
    cannot score this data (a missing column, a bug). Fewer failures score 0 and are counted
    (``rl_reward_failures``); timeouts never stop a run (a judge's outage passes)."""
    if groups and all(g.failed == len(g.completions) for g in groups) and not any(
            (g.first_error or "").startswith("TimeoutError") for g in groups):
        raise Mistake(f"rl.reward={spec!r} failed on every completion of a step's "
                      f"{len(groups)} groups; the first: {groups[0].first_error}")


def exact_match(prompt: Any, completion: str, *, answer: Any, **row: Any) -> float:
    """1 where the completion, stripped of surrounding white space, is the row's ``answer``
    (stripped too); else 0."""
    return float(completion.strip() == str(answer).strip())


# The last number of a text: sign, thousands separators, decimals ("-1,234.5").
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (GSM8K's ``#### 72`` reads as 72), or None."""
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def final_number(prompt: Any, completion: str, *, answer: Any, **row: Any) -> float:
    """1 where the last number of the completion equals the row's ``answer`` (a number, or a
    text whose last number is the answer, as GSM8K's solutions end); else 0."""
    want = float(answer) if isinstance(answer, numbers.Real) else last_number(str(answer))
    got = last_number(completion)
    return float(want is not None and got is not None and math.isclose(got, want,
                                                                        rel_tol=1e-9))
