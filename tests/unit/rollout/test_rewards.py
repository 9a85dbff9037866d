"""Reward functions (raylm.rollout.rewards): loading, the preflight's one call, and what a
run does with failures."""

from __future__ import annotations

import sys
import textwrap

import pytest

from raylm.faults import Mistake
from raylm.rollout.rewards import (
    check_reward,
    exact_match,
    final_number,
    last_number,
    load_reward,
    parts_of,
    score,
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of reward functions, importable as a user's would be."""
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def correct(prompt, completion, *, answer, **row):
            return float(completion.strip() == answer)

        def graded(prompt, completion, *, answer, **row):
            return {"correct": float(answer in completion), "short": -0.01 * len(completion)}

        def wrong_signature(completion):
            return 1.0

        def says_yes(prompt, completion, **row):
            return "yes"

        def fails_on_b(prompt, completion, **row):
            if "b" in completion:
                raise RuntimeError("no b")
            return 1.0

        NOT_A_FUNCTION = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_a_named_function_and_the_builtins_load(user_module):
    assert load_reward(f"{user_module}:correct")("p", " x ", answer="x") == 1.0
    assert load_reward("exact_match") is exact_match
    assert load_reward("final_number") is final_number
    assert load_reward("raylm.rollout.rewards:final_number") is final_number


@pytest.mark.parametrize("spec, says", [
    ("correct", "module:function"),
    ("no_such_module_xyz:f", "does not import"),
    ("my_rewards:missing", "has no 'missing'"),
    ("my_rewards:NOT_A_FUNCTION", "is a int, not a function"),
])
def test_what_cannot_be_loaded_is_refused_by_name(user_module, spec, says):
    with pytest.raises(ValueError, match="rl.reward=") as e:
        load_reward(spec)
    assert says in str(e.value)


def test_the_preflight_call_refuses_signatures_errors_and_non_numbers(user_module):
    row = {"prompt": "2+2?", "answer": "4"}
    check = lambda name: check_reward(  # noqa: E731
        load_reward(f"my_rewards:{name}"), row, prompt_field="prompt", spec=name)
    assert check("correct") == {"reward": 1.0}  # the answer column as the completion
    assert check("graded") == {"correct": 1.0, "short": pytest.approx(-0.01)}
    with pytest.raises(ValueError, match=r"cannot be called as fn\(prompt, completion"):
        check("wrong_signature")
    with pytest.raises(ValueError, match="returned 'yes' for 'reward': a reward is a finite"):
        check("says_yes")
    with pytest.raises(ValueError, match="columns \\[\\]: missing a required argument: 'answer'"):
        check_reward(load_reward("my_rewards:correct"), {"prompt": "q"},
                     prompt_field="prompt", spec="c")


def test_a_failing_completion_scores_zero_and_a_group_that_all_fails_too(user_module):
    fn = load_reward("my_rewards:fails_on_b")
    scores = score(fn, ["p"] * 3, ["a", "b", "ab"], [{}] * 3, spec="f")
    assert scores.rewards == [1.0, 0.0, 0.0]
    assert scores.failed == 2 and scores.first_error == "RuntimeError: no b"
    every = score(fn, ["p"] * 2, ["b", "bb"], [{}] * 2, spec="f")
    assert every.rewards == [0.0, 0.0] and every.failed == 2


def test_a_reward_that_cannot_run_at_all_is_a_mistake_at_its_first_completion():
    def cannot_run(prompt, completion, **row):  # as a reward's process that does not load
        raise Mistake("rl.reward='x:f' failed to load in its own process")

    with pytest.raises(Mistake, match="failed to load"):
        score(cannot_run, ["p"] * 2, ["a", "b"], [{}] * 2, spec="x:f")


def test_named_parts_are_summed_and_each_kept(user_module):
    fn = load_reward("my_rewards:graded")
    scores = score(fn, ["p", "p"], ["4", "five"], [{"answer": "4"}] * 2, spec="g")
    assert scores.parts["correct"] == [1.0, 0.0]
    assert scores.parts["short"] == pytest.approx([-0.01, -0.04])
    assert scores.rewards == pytest.approx([0.99, -0.04])


@pytest.mark.parametrize("value", [True, float("nan"), float("inf"), None, {}, {"a": "1"}])
def test_only_finite_numbers_are_rewards(value):
    with pytest.raises(TypeError):
        parts_of(value)


def test_the_builtins_match_answers():
    assert exact_match("q", "  paris \n", answer="paris") == 1.0
    assert exact_match("q", "Paris", answer="paris") == 0.0
    assert last_number("so 3 apples, then 1,234.5 in all") == 1234.5
    assert last_number("the answer is -7.") == -7.0
    assert last_number("none") is None
    assert final_number("q", "3 + 4 = 7", answer="Add them.\n#### 7") == 1.0
    assert final_number("q", "it is 7.0", answer=7) == 1.0
    assert final_number("q", "it is 8", answer=7) == 0.0
    assert final_number("q", "no idea", answer=7) == 0.0


def test_a_reward_is_found_where_users_keep_it(tmp_path, monkeypatch):
    """Named by its file (made absolute where the config is read, as model.path is), or a
    module of the directory `raylm` runs in, which `raylm submit` ships with the job: the
    console script refused one `python -m raylm` accepted, and submit sent none."""
    import subprocess
    import sys
    from pathlib import Path

    from raylm.config import load_config
    from raylm.run.submit import ship_reward

    (tmp_path / "judge.py").write_text(
        "def right(prompt, completion, *, answer, **row):\n"
        "    return float(completion.strip() == str(answer))\n")
    monkeypatch.chdir(tmp_path)
    grpo = ["--train.objective=grpo", "--data.format=prompt"]
    cfg = load_config(None, [*grpo, "--rl.reward=judge.py:right"])
    assert cfg.rl.reward == f"{tmp_path / 'judge.py'}:right"
    assert load_reward(cfg.rl.reward)("p", " 3", answer=3) == 1.0
    staging = tmp_path / "staging"
    for spec in (cfg.rl.reward, "judge:right"):
        staging.mkdir()
        shipped = ship_reward(load_config(None, [*grpo, f"--rl.reward={spec}"]), staging)
        assert shipped.rl.reward == "judge:right" and (staging / "judge.py").is_file()
        __import__("shutil").rmtree(staging)
    assert ship_reward(load_config(None, [*grpo, "--rl.reward=exact_match"]),
                       tmp_path).rl.reward == "exact_match"
    # The console script imports the directory's module, as `python -m raylm` does.
    script = Path(sys.executable).parent / "raylm"
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1 + 2?", "answer": "3"}\n')
    done = subprocess.run([script, "train", "--dry-run", *grpo, "--rl.reward=judge:right",
                           "--data.source=prompts.jsonl", "--model.preset=tiny"],
                          capture_output=True, text=True, timeout=300)
    assert "does not import" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
