"""Does training wait for its benchmarks? One run's step speed without evaluations, and the same
run with an lm-eval task scoring every checkpoint beside it (raylm.run.benchmarks).

Both sides are the same ``raylm train``: one worker of ``--cpus`` CPUs (or one GPU), the same
preset, data, steps and checkpoints; the second adds ``eval.tasks`` (a generated local
multiple-choice task of ``--questions`` questions, four choices each) with ``eval.every=1``
and ``eval.resources`` of ``--eval-cpus`` CPUs (or one GPU with ``--eval-gpu``). Speed is the
median tokens/s of the report windows after the first checkpoint (the first is warm-up), so
the windows during which evaluations ran are the ones compared.

``ratio`` = with / without (1.0: training did not slow). On a machine whose cores the
evaluations share with training (a 2-core laptop), expect below 1: an evaluation's CPU time is
then taken from the step; on a GPU with the evaluation on a second device there is nothing to
share but the host.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import ray
import torch

from raylm.config import load_config
from raylm.contracts.events import Benchmark, Progress
from raylm.run.launch import train
from raylm.run.record import read


def write_task(root: Path, *, questions: int) -> Path:
    """A multiple-choice task over generated sentences: which word ends the sentence."""
    rng = random.Random(0)
    words = "river mill grain window letter winter village market bread garden".split()
    rows = []
    for _ in range(questions):
        choices = rng.sample(words, 4)
        rows.append({"q": f"The {rng.choice(words)} stood by the", "choices": choices,
                     "answer": rng.randrange(4)})
    root.mkdir(parents=True, exist_ok=True)
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "bench_mc.yaml").write_text(
        f"task: bench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'rows.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"{{q}}\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    return root


def window_speeds(run_dir: Path, *, after_step: int) -> list[float]:
    return [r.tokens_per_s for r in read(str(run_dir))
            if isinstance(r, Progress) and r.step > after_step]


def run(*, preset: str, steps: int, checkpoint_every: int, questions: int, cpus: int,
        eval_cpus: float, eval_gpu: bool, workdir: str | None) -> dict[str, Any]:
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="raylm-bench-"))
    use_gpu = torch.cuda.is_available()
    tasks = write_task(root / "tasks", questions=questions)
    ray.init(num_cpus=max(cpus + eval_cpus + 1, os.cpu_count() or 1),
             include_dashboard=False, log_to_driver=False)
    common = [f"--run.storage_path={root}/runs", f"--run.cache_dir={root}/cache",
              "--data.builtin_packages=[peft, datasets]", "--data.seq_len=256",
              f"--model.preset={preset}", f"--train.steps={steps}",
              "--train.global_batch_size=8", "--train.micro_batch_size=8",
              f"--train.log_every={max(1, checkpoint_every // 4)}",
              f"--train.eval_every={steps}", f"--checkpoint.every={checkpoint_every}",
              "--train.eval_batches=1", f"--scaling.use_gpu={str(use_gpu).lower()}",
              f"--scaling.cpus_per_worker={cpus}", "--tracking.enabled=false",
              "--optim.warmup_steps=1"]
    resources = "{GPU: 1}" if eval_gpu else f"{{CPU: {eval_cpus}}}"
    sides = {"without": [], "with": ["--eval.tasks=[bench_mc]",
                                     f"--eval.include_path={tasks}",
                                     f"--eval.resources={resources}"]}
    out: dict[str, Any] = {}
    for name, extra in sides.items():
        summary = train(load_config(None, [*common, f"--run.name={name}", *extra]),
                        log=lambda m: None)
        speeds = window_speeds(root / "runs" / name, after_step=checkpoint_every)
        out[name] = {"tokens_per_s_median": round(statistics.median(speeds)),
                     "windows": len(speeds), "wall_s": summary["wall_s"]}
        if summary.get("benchmarks"):
            out[name].update(evaluations=len(
                [r for r in read(str(root / "runs" / name)) if isinstance(r, Benchmark)]),
                evaluation_s=summary["benchmarks"]["seconds"],
                end_wait_s=summary["goodput"]["seconds"]["benchmarks"])
    ray.shutdown()
    return {
        "benchmark": "evals",
        "metric": "training tokens/s (median of the report windows after the first "
                  "checkpoint), without and with an lm-eval task scoring every checkpoint",
        "preset": preset, "steps": steps, "checkpoint_every": checkpoint_every,
        "questions": questions, "cpus_per_worker": cpus,
        "eval_resources": resources, "device": "cuda" if use_gpu else "cpu",
        **out,
        "ratio": round(out["with"]["tokens_per_s_median"]
                       / out["without"]["tokens_per_s_median"], 3),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
    }
