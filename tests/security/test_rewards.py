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


GRPO_RUN = __import__("pathlib").Path(__file__).parents[1] / "fixtures" / "run-cb5e3f1-grpo"


@pytest.fixture
def resumed(tmp_path):
    """The GRPO run of cb5e3f1 (tests/fixtures) as a resumed run's rank 0 reads its kept
    rollouts, and a way to plant a file of them."""
    import dataclasses
    import json
    import shutil

    from raylm.api import Run
    from raylm.workers.grpo import Reinforce

    old = shutil.copytree(GRPO_RUN, tmp_path / "old")
    cfg = Run(old).config
    kept = json.loads((old / "checkpoint_000002" / "rollouts.json").read_text())

    def plant(change) -> str:
        data = json.loads(json.dumps(kept))
        change(data)
        path = tmp_path / "rollouts.json"
        path.write_text(json.dumps(data) if not isinstance(data, str) else data)
        return str(path)

    rl = Reinforce(dataclasses.replace(cfg), prepared=str(old), eos_id=0, vocab_size=300,
                   rank=1)
    return rl, plant


def _set(path: str, value):
    def change(data):
        *where, last = path.split(".")
        node = data
        for key in where:
            node = node[int(key) if key.isdigit() else key]
        node[int(last) if last.isdigit() else last] = value
    return change


@pytest.mark.parametrize("change, says", [
    (_set("groups.0.completions.0.0", 300), "a token id outside the vocabulary of 300"),
    (_set("groups.0.logps.0.0", 1e39), "positive or not finite in float32"),
    (_set("groups.0.logps.0.0", 0.5), "positive or not finite in float32"),
    (_set("groups.0.version", 7), "weights of version 7, after the checkpoint's step 2"),
    (_set("version", 10 ** 400), "newer than this raylm reads"),
    (lambda d: d["groups"][0].update(completions=[], logps=[], rewards=[], truncated=[]),
     "malformed"),
])
def test_kept_rollouts_a_run_cannot_train_are_refused_in_one_line(resumed, change, says):
    """Each was accepted and failed inside a step (token ids past the vocabulary, log-probs
    finite in float64 but not in float32, a version of 10**400, a group of no completions),
    retried as if a machine had failed."""
    rl, plant = resumed
    with pytest.raises(Mistake, match=says):
        rl.kept_groups(plant(change), step=2, vocab_size=300)


def test_deeply_nested_kept_rollouts_are_one_line_not_a_recursion(resumed):
    rl, plant = resumed
    path = plant(lambda d: None)
    with open(path, "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    with pytest.raises(Mistake, match="rollouts.json is malformed"):
        rl.kept_groups(path, step=2, vocab_size=300)


def test_kept_rollouts_are_hashed_whole_at_every_resume(tmp_path, monkeypatch):
    """A rollouts.json past the size hashed on resume (64 MiB), edited in place, passed; a
    model shard past it is still checked by size alone."""
    from raylm import rundir
    from raylm.contracts import Marker

    ckpt = tmp_path / "checkpoint_000002"
    ckpt.mkdir()
    kept = (GRPO_RUN / "checkpoint_000002" / "rollouts.json").read_text()
    files = {"rollouts.json": kept, "__0_0.distcp": "weights"}
    for name, text in files.items():
        (ckpt / name).write_text(text)
    (ckpt / "raylm_checkpoint.json").write_text(Marker(
        state={"step": 2}, model={}, files={n: len(t) for n, t in files.items()},
        hashes={n: rundir.file_hash(iter([t.encode()])) for n, t in files.items()}).to_json())
    monkeypatch.setattr(rundir, "HASHED_ON_RESUME", 1)  # both files past the limit
    (ckpt / "__0_0.distcp").write_text("Weights")  # same size, other bytes: not read whole
    rundir.verify(ckpt)
    (ckpt / "rollouts.json").write_text(kept.replace('"through_step": 2', '"through_step": 3'))
    with pytest.raises(rundir.CheckpointError, match="rollouts.json does not match its hash"):
        rundir.verify(ckpt)
