"""What a reward function or its data can do to a GRPO run (raylm.rollout.rewards): one prompt
the function cannot score, an error whose text is the model's output, an exit, a row it
changes, a part name or a number the run's figures cannot take. Each test is the attack, and
shows it ends no run and forges no console line, or is refused before Ray starts in one line."""

from __future__ import annotations

import pytest

from raylm.contracts.rollouts import Group
from raylm.faults import Mistake
from raylm.rollout.rewards import check_reward, check_step, parts_of, score


def group(position: int, failed: int, error: str | None, size: int = 4) -> Group:
    return Group(position, 0, [1, 2], [[3]] * size, [[-1.0]] * size, [0.0] * size, {},
                 [False] * size, failed, error, {}, None)


def test_a_prompt_whose_every_call_fails_scores_zero_and_only_a_whole_step_stops():
    """A reward that raises on the prompts naming one word: its group scores 0 (it ended the
    run at that group before); a step whose every group failed stops as a mistake, naming the
    error; one of timeouts (a judge's outage) does not."""
    def picky(prompt, completion, **row):
        if "banana" in prompt:
            raise KeyError("banana")
        return 1.0

    scored = score(picky, ["a banana?"] * 4, ["x"] * 4, [{}] * 4, spec="m:picky")
    assert scored.rewards == [0.0] * 4 and scored.failed == 4
    check_step([group(0, 4, "KeyError: 'banana'"), group(1, 0, None)], spec="m:picky")
    with pytest.raises(Mistake, match=r"failed on every completion of a step's 2 groups; the "
                                      r"first: KeyError: 'banana'"):
        check_step([group(0, 4, "KeyError: 'banana'"), group(1, 4, "KeyError: 'x'")],
                   spec="m:picky")
    check_step([group(0, 4, "TimeoutError: no result after rl.reward_timeout_s=5 s")] * 2,
               spec="m:judge")


def test_an_error_of_model_output_reaches_the_console_as_one_bounded_line():
    """The error's text held an escape sequence, newlines and 100,000 characters: it reached
    the console raw and forged a `raylm: done` line."""
    def echo(prompt, completion, **row):
        raise ValueError(completion)

    long = score(echo, ["p"], ["\x1b[2K" + "x" * 100_000], [{}], spec="m:echo").first_error
    assert len(long) <= 210 and long.startswith("ValueError: \\x1b[2Kxxx")
    forged = score(echo, ["p"], ["\x1b[2K\rraylm: done: step 999\n"], [{}],
                   spec="m:echo").first_error
    assert forged == "ValueError: \\x1b[2K"  # its first line, escaped


def test_a_reward_that_exits_fails_its_call_and_the_dry_run():
    def leaves(prompt, completion, **row):
        raise SystemExit(0)

    assert score(leaves, ["p"], ["c"], [{}], spec="m:leaves").failed == 1
    with pytest.raises(ValueError, match="raised on the data's first row: SystemExit"):
        check_reward(leaves, {"prompt": "p"}, prompt_field="prompt", spec="m:leaves")


def test_each_call_gets_its_own_row():
    """A reward that changes its row saw its own change at the next call of its group."""
    seen = []

    def grabby(prompt, completion, *, tags, **row):
        seen.append(list(tags))
        tags.append(completion)
        prompt.append("!")
        return 0.0

    prompt, row = ["hi"], {"tags": ["a"]}
    score(grabby, [prompt] * 3, ["x", "y", "z"], [row] * 3, spec="m:grabby")
    assert seen == [["a"]] * 3 and row == {"tags": ["a"]} and prompt == ["hi"]


@pytest.mark.parametrize("value, says", [
    ({"pass@1": 1.0}, "a part named 'pass@1'"),  # MLflow refused the run's first report
    ({"std": 1.0}, "and not std, failures, s"),  # it overwrote rl_reward_std
    ({1: 1.0, "1": 2.0}, "a part named 1"),  # 1 and "1" merged
    (10 ** 400, "within float32's range"),  # a traceback at the preflight
    (1e39, "within float32's range"),  # infinite in the float32 step: a NaN step
    ({"a": 3e38, "b": 3e38}, "sum is past float32's range"),
])
def test_a_part_the_runs_figures_cannot_take_is_refused_by_name(value, says):
    with pytest.raises(TypeError, match=says):
        parts_of(value)


@pytest.mark.parametrize("settings, says", [
    (["--rl.group_size=1e9"], "rl.group_size"),
    (["--rl.group_size=1000000000"], "'rl.group_size': 1000000000. Allowed: at most 1024"),
    (["--rl.generators=[1, 1000000]"], "'rl.generators': \\[1, 1000000\\]. Allowed: at most"),
    (["--rl.max_staleness=1000000000"], "'rl.max_staleness': 1000000000. Allowed: at most 64"),
    (["--rl.max_staleness=8", "--train.steps=4"], "at most train.steps=4"),
    (["--rl.temperature=1e-45"], "'rl.temperature': 1e-45. Allowed: >= 0.01"),
    (["--rl.reward_timeout_s=1e300"], "'rl.reward_timeout_s': 1e\\+300. Allowed: at most"),
])
def test_rl_settings_past_what_a_run_can_hold_are_refused_before_ray_starts(settings, says):
    """Each passed the dry run: the pool then kept 200 weight copies after 200 steps, a
    temperature of 1e-45 sampled from NaN, and a timeout of 1e300 s never ended a call."""
    from raylm.config import ConfigError, load_config

    grpo = ["--train.objective=grpo", "--data.format=prompt", "--rl.reward=exact_match"]
    with pytest.raises(ConfigError, match=says):
        load_config(None, [*grpo, *settings])
