"""Reinforcement learning's time, by part: the same GRPO run colocated, and with generator
actors synchronous and off-policy.

    python -m raylm.bench rl --output runs/bench-rl.json [--staleness colocated,0,1]
        [--steps 60] [--generators 1] [--group-size 8] [--max-completion-tokens 4]
        [--workdir DIR]

Writes the larger-digit task (:mod:`raylm.examples.larger_digit`: its prompts and its tiny
model, warmed up in this process; not timed), then trains it with ``raylm train``'s code in
this process, one run per entry of ``--staleness`` (``colocated``: ``rl.generators=0``, the
trainer sampling its own; a number: that ``rl.max_staleness`` with ``--generators`` generator
actors of one CPU each), on one Ray cluster (``RAY_ADDRESS``'s, or a local one started here):
one training worker, the recipe's settings (jobs/configs/grpo_larger_digit.yaml) otherwise.
For each run, from its record:

- ``seconds``: the goodput account's split of the steps' time (``training``: computing the
  steps; ``generation``: the trainers waiting for completions; ``weight_transfer``: gathering
  the weights and handing them over; ``data_wait``, ``reporting``), and the generators' own
  seconds sampling and scoring (``sampling_s``, ``reward_s``, summed over the steps: off-policy,
  sampling runs while the trainers train, so it may exceed what they waited);
- ``rollouts_per_s``: completions trained over the steps' time (the split's sum);
- ``reward_first``/``reward_last``: the mean training reward of the first and last 10 steps,
  and ``val_reward``, the held-out greedy reward at the end: what off-policy training costs
  in learning, beside what it saves in time.

``ratio``: each run's rollouts per second over the first's (the baseline, measured in the same
invocation). Written by hand: no library times an RL step by its parts on Ray.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

# The goodput account's causes that make up the steps' time (raylm.run.goodput), and what
# this benchmark calls them.
PARTS = {"productive": "training", "generation": "generation",
         "weight_transfer": "weight_transfer", "data_wait": "data_wait",
         "reporting": "reporting"}


def run(*, staleness: list[int | str], steps: int, generators: int, group_size: int,
        max_completion_tokens: int, workdir: str | None) -> dict[str, Any]:
    from raylm.examples.larger_digit import write
    from raylm.run.cluster import connect

    root = Path(workdir or tempfile.mkdtemp(prefix="raylm-bench-rl-"))
    task = write(root / "task")
    connect(None, log=print)  # RAY_ADDRESS's cluster, or a local one
    sides = [_side(k, task=task, root=root, steps=steps, generators=generators,
                   group_size=group_size, max_tokens=max_completion_tokens) for k in staleness]
    base = sides[0]["rollouts_per_s"]
    for side in sides:
        side["ratio"] = round(side["rollouts_per_s"] / base, 3) if base else None
    return {"benchmark": "rl",
            "metric": "completions trained per second of the steps' time, and where that time "
                      "went, synchronous against off-policy (rl.max_staleness)",
            "steps": steps, "generators": generators, "group_size": group_size,
            "max_completion_tokens": max_completion_tokens, "sides": sides}


def _side(k: int | str, *, task: dict[str, str], root: Path, steps: int, generators: int,
          group_size: int, max_tokens: int) -> dict[str, Any]:
    from raylm import api
    from raylm.config import load_config, run_dir
    from raylm.run.launch import train

    batch = 8
    colocated = k == "colocated"
    cfg = load_config(None, [
        f"--model.path={task['model']}", f"--data.source={task['prompts']}",
        "--data.format=prompt", "--data.seq_len=40", "--data.val_fraction=0.2",
        "--train.objective=grpo", f"--train.steps={steps}", f"--train.global_batch_size={batch}",
        f"--train.micro_batch_size={batch}", "--train.log_every=1",
        f"--train.eval_every={steps}", "--train.eval_batches=2", "--train.precision=fp32",
        "--optim.lr=1e-3", "--optim.warmup_steps=2", "--rl.reward=exact_match",
        f"--rl.group_size={group_size}", f"--rl.max_completion_tokens={max_tokens}",
        f"--rl.generators={0 if colocated else generators}",
        f"--rl.max_staleness={0 if colocated else k}",
        "--scaling.num_workers=1", f"--checkpoint.every={steps}", "--tracking.enabled=false",
        f"--run.storage_path={root / 'runs'}", f"--run.cache_dir={root / 'cache'}",
        f"--run.name={k if colocated else f'staleness-{k}'}"])
    summary = train(cfg, log=print)
    history = api.Run(run_dir(cfg)).history
    seconds = {name: summary["goodput"]["seconds"][cause] for cause, name in PARTS.items()}
    steps_s = sum(seconds.values())
    rewards = history["rl_reward"].tolist()
    return {"side": "colocated" if colocated else f"{generators} generators",
            "max_staleness": 0 if colocated else k, "wall_s": summary["wall_s"],
            "steps_s": round(steps_s, 2),
            "seconds": {**seconds, "sampling_s": round(float(history["rl_sampling_s"].sum()), 3),
                        "reward_s": round(float(history["rl_reward_s"].sum()), 3)},
            "rollouts_per_s": round(steps * batch * group_size / steps_s, 1) if steps_s else None,
            "reward_first": round(sum(rewards[:10]) / len(rewards[:10]), 4),
            "reward_last": round(sum(rewards[-10:]) / len(rewards[-10:]), 4),
            "val_reward": summary.get("val_reward"),
            "staleness_max": float(history["rl_staleness_max"].max())}
