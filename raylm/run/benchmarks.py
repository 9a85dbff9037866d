"""Benchmark scores of a run's checkpoints, computed on Ray beside the run: lm-evaluation-harness.

People judge a model by benchmark scores; EleutherAI's lm-evaluation-harness (``lm-eval``) is the
field's reference for them, so every number here is lm-eval's own: raylm hands it a model object
and reads back its results. What lm-eval does not do, and this module does, is the scheduling
around a training run. Three places use it:

- the driver: :func:`check_settings` before Ray starts (the eval extra installed, every task
  known: a misspelt task is refused then, not after an hour of training), and ``raylm eval``
  (:mod:`raylm.after.evaluate`), which scores a run's checkpoints or an exported model after
  the fact with the same code;
- the Ray Train controller: :class:`Benchmarks`, which the run's record owns. At each due
  checkpoint it starts one evaluation as a Ray task on ``eval.resources`` and returns at once;
  each later report collects what has finished (``ray.wait`` with a zero timeout), so a
  report is never held up; when the run ends it waits for the evaluations still running,
  saying which;
- the evaluation task: :func:`score_checkpoint` writes the checkpoint as ``raylm export
  --merge`` writes it (a LoRA run's adapters merged, the tokenizer and its chat template kept)
  to a temporary directory, loads it as transformers loads an export, and runs lm-eval's
  ``simple_evaluate`` on it in the task's own process.

Training never waits for an evaluation: it runs on resources of its own (an evaluation that
cannot be placed beside training waits for them, not the other way round). A failed evaluation
is retried once when a machine failed it (Ray's task retry; a mistake, such as a task file
that does not load, is not retried) and then recorded as failed with its reason; the run goes
on. Which checkpoints were scored is in the run's events, so a resumed run scores the due
checkpoints its earlier invocations left unscored and none twice.

Scores are named ``eval/<task>/<metric>`` (``eval/<task>/<metric>/<filter>`` for a filter other
than lm-eval's ``none``), the names MLflow, ``summary.json``, ``Run.history`` and ``tune.metric``
use. lm-eval is the ``eval`` extra's, so it is imported where it is used, and a run without
benchmarks never imports it.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from raylm import rundir, storage
from raylm.config import ConfigError, EvalConfig, config_from_dict
from raylm.console import quiet_model_io, quiet_torchao
from raylm.contracts import BENCHMARKS
from raylm.contracts.events import Benchmark, BenchmarkFailed, EventRecord

EXTRA = "pip install 'raylm[eval]'"
PREFIX = "eval/"
# How often the end of a run says which evaluations it still waits for.
WAIT_NOTE_S = 300.0


# ---- The tasks: checked on the driver, read where the evaluation runs ----------------------


def task_manager(ev: EvalConfig):
    """lm-eval's index of the tasks ``ev`` may name. Indexing lm-eval's own task files (over
    ten thousand) takes about 7 s here, so a run that names only tasks of its
    ``include_path`` indexes that folder alone."""
    try:
        from lm_eval.tasks import TaskManager
        # Its task index and evaluations talk at INFO; a run's lines say what matters.
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
    except ImportError:
        raise ConfigError(f"eval.tasks={ev.tasks} needs EleutherAI's lm-evaluation-harness: "
                          f"install the eval extra ({EXTRA})") from None
    if ev.include_path is not None:
        if not Path(ev.include_path).is_dir():
            raise ConfigError(f"eval.include_path={ev.include_path}: not a directory; name the "
                              f"folder that holds your lm-eval task YAML files")
        local = TaskManager(include_path=ev.include_path, include_defaults=False)
        if all(t in local.all_tasks for t in ev.tasks):
            return local
    return TaskManager(include_path=ev.include_path)


def check_settings(ev: EvalConfig) -> None:
    """Refuse, before Ray starts, benchmarks that cannot run: the extra missing, a task
    lm-eval does not know."""
    if not ev.tasks:
        return
    known = task_manager(ev).all_tasks
    for name in ev.tasks:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f" Close: {', '.join(close)}." if close else ""
            raise ConfigError(
                f"eval.tasks: {name!r} is not a task or group lm-eval knows.{hint} "
                f"`lm-eval ls tasks` lists them; eval.include_path adds your own task files")


def higher_is_better(ev: EvalConfig, name: str) -> bool:
    """Whether a higher score is better for the score ``name`` (``eval/<task>/<metric>``):
    what the task's file says of the metric, else lm-eval's registry of metrics."""
    from lm_eval.api.registry import is_higher_better

    _, task, metric, *_ = name.split("/")
    entry = task_manager(ev).task_index.get(task)
    for m in ((entry.cfg or {}).get("metric_list") or ()) if entry is not None else ():
        if m.get("metric") == metric and "higher_is_better" in m:
            return bool(m["higher_is_better"])
    known = is_higher_better(metric)
    if known is None:
        raise ConfigError(f"tune.metric={name}: lm-eval does not say whether a higher "
                          f"{metric} is better; set higher_is_better in the task's "
                          f"metric_list")
    return bool(known)


# ---- Scoring a model (the evaluation task, and `raylm eval`) -------------------------------


@dataclass(frozen=True)
class Scored:
    """One evaluation's scores, and for each whether higher is better (lm-eval's word)."""

    scores: dict[str, float]
    higher: dict[str, bool]
    seconds: float


def flatten(results: dict[str, dict[str, Any]], higher: dict[str, dict[str, bool]]
            ) -> tuple[dict[str, float], dict[str, bool]]:
    """lm-eval's ``results`` (``{task: {"acc,none": 0.4, "acc_stderr,none": ...}}``) as
    ``{"eval/<task>/<metric>": value}``; standard errors and non-numbers left out."""
    scores, better = {}, {}
    for task, values in results.items():
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, filt = key.split(",", 1)
            if metric.endswith("_stderr") or math.isnan(value):
                continue
            name = f"{PREFIX}{task}/{metric}" + ("" if filt == "none" else f"/{filt}")
            scores[name] = float(value)
            better[name] = bool(higher.get(task, {}).get(metric, True))
    return scores, better


def score_model(directory: Path, ev: EvalConfig) -> Scored:
    """lm-eval's scores of the model directory ``directory`` (an export) on ``ev.tasks``, on
    this process's GPU when it has one (bf16), else its CPUs (fp32)."""
    quiet_torchao()
    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    tasks = task_manager(ev)  # first: it quiets lm-eval's logger
    # lm-eval's and datasets' progress bars (one per task and request kind, on stderr) would
    # fill a run's output and a notebook's cells; the scores are said in one line instead.
    with quiet_model_io(), contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=torch.bfloat16 if cuda else torch.float32,
            trust_remote_code=False).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=ev.batch_size,
                  device=device)
        # No bootstrap: the standard errors it estimates are not reported, and it is the
        # slowest part of scoring a small task. The scores themselves do not depend on it.
        out = lm_eval.simple_evaluate(model=lm, tasks=list(ev.tasks),
                                      num_fewshot=ev.num_fewshot, limit=ev.limit,
                                      task_manager=tasks, log_samples=False, bootstrap_iters=0)
    scores, higher = flatten(out["results"], out.get("higher_is_better") or {})
    return Scored(scores, higher, round(time.time() - start, 2))


def score_checkpoint(run_dir: str, checkpoint: str, ev: EvalConfig) -> Scored:
    """The evaluation task: ``checkpoint`` of the run written as ``raylm export --merge``
    writes it, into a temporary directory, and scored there. A held copy of the checkpoint
    (:func:`hold`) is removed once scored (a retry after a failure reads it again)."""
    quiet_torchao()
    from raylm.formats.exporter import write_export
    from raylm.rundir import read_run_info

    start = time.time()
    cfg = config_from_dict(read_run_info(run_dir).config)
    with tempfile.TemporaryDirectory(prefix="raylm-eval-") as tmp, quiet_model_io():
        write_export(run_dir, Path(tmp), cfg, merge=True, checkpoint_path=checkpoint)
        scored = score_model(Path(tmp), ev)
    if storage.parent(checkpoint) == storage.join(run_dir, BENCHMARKS):
        shutil.rmtree(checkpoint, ignore_errors=True)
    return Scored(scored.scores, scored.higher, round(time.time() - start, 2))


def hold(run_dir: str, checkpoint: str, step: int) -> str:
    """``checkpoint``'s files held for its evaluation in ``RUN_DIR/.benchmarks/step_N``: hard
    links (no data is copied), so that Ray Train removing the checkpoint (checkpoint.keep) while
    the evaluation waits for a CPU or starts its process does not take the files from under it;
    the checkpoint itself where links cannot be made (object storage, another file system),
    said in the record of a failure if Ray Train removes it first (or a link planted there)."""
    if storage.is_uri(run_dir) or (Path(run_dir) / BENCHMARKS).is_symlink():
        return checkpoint
    held = Path(run_dir) / BENCHMARKS / f"step_{step}"
    try:
        shutil.rmtree(held, ignore_errors=True)
        shutil.copytree(checkpoint, held, copy_function=os.link)
    except OSError:
        shutil.rmtree(held, ignore_errors=True)
        return checkpoint
    return str(held)


# ---- On the controller: which checkpoints, started and collected without waiting -----------


class Runner(Protocol):
    """Where evaluations run: :class:`RayRunner` (Ray tasks) in a run."""

    def start(self, checkpoint: str) -> Any: ...

    def finished(self, handles: list[Any], timeout: float | None) -> list[tuple[Any, Any]]: ...


class RayRunner:
    """Each evaluation one Ray task on ``eval.resources``, retried once if a machine fails it."""

    def __init__(self, run_dir: str, ev: EvalConfig) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        res = dict(ev.resources)
        self.run_dir, self.ev = run_dir, ev
        # Outside any placement group: a Tune trial's controller runs in the trial's, whose
        # bundles hold nothing for an evaluation (Ray would place its tasks there).
        self.remote = ray.remote(score_checkpoint).options(
            num_cpus=res.pop("CPU", 0.0), num_gpus=res.pop("GPU", 0.0), resources=res or None,
            # Once more after what a machine causes (its process lost, an I/O or device
            # error); never after a mistake (a ValueError: a task's file, a broken checkpoint).
            max_retries=1, retry_exceptions=[OSError, RuntimeError], name="raylm-benchmark",
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=None))

    def start(self, checkpoint: str) -> Any:
        return self.remote.remote(self.run_dir, checkpoint, self.ev)

    def finished(self, handles: list[Any], timeout: float | None) -> list[tuple[Any, Any]]:
        import ray

        ready, _ = ray.wait(handles, num_returns=len(handles), timeout=timeout)
        out = []
        for h in ready:
            try:
                out.append((h, ray.get(h)))
            except Exception as e:  # noqa: BLE001 - reported as the evaluation's failure
                out.append((h, e))
        return out


def due(step: int, *, ev: EvalConfig, checkpoint_every: int, total_steps: int) -> bool:
    """Whether the checkpoint at ``step`` is scored: every ``eval.every``-th periodic
    checkpoint, and the final one (a preemption's off-schedule checkpoint is not)."""
    if step >= total_steps:
        return True
    return step % checkpoint_every == 0 and (step // checkpoint_every) % ev.every == 0


def outcome_record(step: int, checkpoint: str, result: Any) -> Benchmark | BenchmarkFailed:
    """The event record of one evaluation's end: its scores, or why it failed."""
    name = storage.name(checkpoint)
    if isinstance(result, Scored):
        return Benchmark(step=step, checkpoint=name, scores=result.scores,
                         higher=result.higher, seconds=result.seconds)
    lines = str(getattr(result, "cause", None) or result).strip().splitlines()
    reason = f"{type(result).__name__}: {lines[-1] if lines else ''}"[:300]
    return BenchmarkFailed(step=step, checkpoint=name, error=reason)


class Benchmarks:
    """The run's evaluations, kept by its record on the controller (see the module doc)."""

    def __init__(self, run_dir: str, ev: EvalConfig, *, checkpoint_every: int,
                 total_steps: int, runner: Runner | None = None) -> None:
        self.run_dir, self.ev = run_dir, ev
        self.checkpoint_every, self.total_steps = checkpoint_every, total_steps
        self.runner = runner
        self.pending: dict[int, tuple[Any, str]] = {}  # step -> (handle, checkpoint)
        self.ended: set[int] = set()  # steps scored or failed, by any invocation
        self.resumed = False

    def __getstate__(self) -> dict[str, Any]:
        # The runner is made where it is used (the controller): a Ray remote function is not
        # sent along.
        return {**self.__dict__, "runner": None}

    def _runner(self) -> Runner:
        if self.runner is None:
            self.runner = RayRunner(self.run_dir, self.ev)
        return self.runner

    def resume(self, records: list[EventRecord], *, bad: list[str]) -> list[int]:
        """Once, at the invocation's first report: the steps whose evaluations ended in the
        run's ``records``, and the due checkpoints on disk that none scored, started now."""
        self.resumed = True
        self.release()  # what earlier invocations held and left
        self.ended |= {r.step for r in records if isinstance(r, (Benchmark, BenchmarkFailed))}
        started = []
        for path in rundir.candidates(self.run_dir):
            if storage.name(path) in bad:
                continue
            try:
                step = rundir.verify(path).step
            except (rundir.CheckpointError, OSError):
                continue  # incomplete: the run never counted it
            if self.start(step, path):
                started.append(step)
        return started

    def start(self, step: int, checkpoint: str) -> bool:
        """Start scoring the checkpoint at ``step`` if it is due and not scored; whether it
        started."""
        if step in self.ended or step in self.pending or not due(
                step, ev=self.ev, checkpoint_every=self.checkpoint_every,
                total_steps=self.total_steps):
            return False
        held = hold(self.run_dir, checkpoint, step)
        self.pending[step] = (self._runner().start(held), checkpoint)
        return True

    def collect(self, *, timeout: float | None = 0.0) -> list[Benchmark | BenchmarkFailed]:
        """The event records of the evaluations that have ended (``timeout`` 0: without
        waiting), oldest step first."""
        if not self.pending:
            return []
        by_handle = {id(h): (step, path) for step, (h, path) in self.pending.items()}
        out = []
        for handle, result in self._runner().finished(
                [h for h, _ in self.pending.values()], timeout):
            step, path = by_handle[id(handle)]
            del self.pending[step]
            self.ended.add(step)
            out.append(outcome_record(step, path, result))
        return sorted(out, key=lambda r: r.step)

    def wait(self, *, log=print) -> list[Benchmark | BenchmarkFailed]:
        """At the run's end: every pending evaluation's record, saying what it waits for."""
        out: list[Benchmark | BenchmarkFailed] = []
        while self.pending:
            steps = ", ".join(str(s) for s in sorted(self.pending))
            log(f"raylm: waiting for the benchmark evaluations of the checkpoints at steps "
                f"{steps} (eval.resources={self.ev.resources})")
            out += self.collect(timeout=WAIT_NOTE_S)
        self.release()
        return out

    def release(self) -> None:
        """Every evaluation has ended: what failed ones held goes too."""
        if not storage.is_uri(self.run_dir):
            shutil.rmtree(Path(self.run_dir) / BENCHMARKS, ignore_errors=True)


# ---- Reading scores back -------------------------------------------------------------------


def summarize(records: list[EventRecord]) -> dict[str, Any]:
    """summary.json's ``benchmarks``: per score the latest and the best (by lm-eval's
    direction) with their steps; and the evaluations that failed."""
    scored = sorted((r for r in records if isinstance(r, Benchmark)), key=lambda r: r.step)
    scores: dict[str, dict[str, Any]] = {}
    for r in scored:
        for name, value in r.scores.items():
            s = scores.setdefault(name, {"best": value, "best_step": r.step})
            s.update(latest=value, latest_step=r.step)
            if (value > s["best"]) if r.higher.get(name, True) else (value < s["best"]):
                s.update(best=value, best_step=r.step)
    failed = [{"step": r.step, "error": r.error} for r in records
              if isinstance(r, BenchmarkFailed)]
    return {"scores": scores, "failed": failed,
            "seconds": round(sum(r.seconds for r in scored), 2)}


def describe(record: Benchmark | BenchmarkFailed) -> str:
    """A benchmark record as one line of the run's output."""
    if isinstance(record, BenchmarkFailed):
        return (f"raylm: warning: the benchmark evaluation of step {record.step} failed "
                f"(after one retry): {record.error}; training goes on")
    shown = ", ".join(f"{n[len(PREFIX):]} {v:.4f}" for n, v in list(record.scores.items())[:6])
    more = len(record.scores) - 6
    return (f"raylm: benchmarks of step {record.step} ({record.seconds:.0f}s): {shown}"
            + (f" and {more} more" if more > 0 else ""))

