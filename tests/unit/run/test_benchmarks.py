"""The benchmarks beside a run (raylm.run.benchmarks): what is refused before Ray starts, which
checkpoints are scored, how lm-eval's results are named and summarized, and where their time
goes. (Scores computed on Ray beside a LoRA run, `raylm eval` and lm-eval's own command line on
the same export: tests/integration/test_sft.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from raylm.config import ConfigError, EvalConfig, load_config
from raylm.contracts.events import (
    Benchmark,
    BenchmarkFailed,
    Ended,
    GroupStart,
    Started,
    WaitedForBenchmarks,
)
from raylm.run import benchmarks
from raylm.run.goodput import goodput
from raylm.run.launch import plan_benchmarks, plan_resources


def write_task(root, *, name: str = "tiny_mc", higher: bool | None = None):
    """An lm-eval multiple-choice task of five questions in a local JSONL file."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "rows.jsonl").write_text("".join(
        f'{{"q": "Question {i}", "choices": ["a", "b"], "answer": {i % 2}}}\n'
        for i in range(5)))
    extra = "" if higher is None else f"\n    higher_is_better: {str(higher).lower()}"
    (root / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'rows.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        f"doc_to_text: \"{{{{q}}}}\"\ndoc_to_choice: \"{{{{choices}}}}\"\n"
        f"doc_to_target: answer\nmetric_list:\n  - metric: acc{extra}\n")
    return root


def test_a_task_lm_eval_does_not_know_is_refused_naming_the_close_ones(tmp_path):
    tasks = write_task(tmp_path / "tasks", name="reverse_mc")
    benchmarks.check_settings(EvalConfig(tasks=["reverse_mc"], include_path=str(tasks)))
    with pytest.raises(ConfigError, match=r"'revers_mc' is not a task.*Close: reverse_mc"):
        benchmarks.check_settings(EvalConfig(tasks=["revers_mc"], include_path=str(tasks)))
    with pytest.raises(ConfigError, match="eval.include_path=.*not a directory"):
        benchmarks.check_settings(EvalConfig(tasks=["x"], include_path=str(tmp_path / "none")))


def test_tune_metric_names_a_score_of_a_benchmark_the_run_asks_for(tmp_path):
    with pytest.raises(ConfigError, match="tune.metric.*one of eval.tasks"):
        load_config(None, ["--tune.metric=eval/arc_easy/acc"])
    with pytest.raises(ConfigError, match="tune.metric"):
        load_config(None, ["--eval.tasks=[arc_easy]", "--tune.metric=val_loss"])
    with pytest.raises(ConfigError, match="eval.resources"):
        load_config(None, ["--eval.resources={GPU: 0}"])
    # The evaluations read it from another working directory: it travels absolute.
    cfg = load_config(None, ["--eval.include_path=my_tasks"])
    assert cfg.eval.include_path == str(Path.cwd() / "my_tasks")
    # Whether higher is better is the task file's word, else lm-eval's registry of metrics.
    tasks = write_task(tmp_path / "tasks", name="lower_mc", higher=False)
    ev = EvalConfig(tasks=["lower_mc"], include_path=str(tasks))
    assert benchmarks.higher_is_better(ev, "eval/lower_mc/acc") is False
    plain = write_task(tmp_path / "plain", name="plain_mc")
    ev = EvalConfig(tasks=["plain_mc"], include_path=str(plain))
    assert benchmarks.higher_is_better(ev, "eval/plain_mc/acc") is True
    assert benchmarks.higher_is_better(ev, "eval/plain_mc/word_perplexity") is False


def test_lm_evals_results_are_named_by_task_metric_and_filter():
    results = {
        "gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25,
                  "exact_match_stderr,strict-match": 0.01,
                  "exact_match,flexible-extract": 0.5,
                  "exact_match_stderr,flexible-extract": "N/A"},
        "wikitext": {"word_perplexity,none": 31.5, "bits_per_byte,none": 0.9,
                     "sample_len": 62},
    }
    higher = {"gsm8k": {"exact_match": True},
              "wikitext": {"word_perplexity": False, "bits_per_byte": False}}
    scores, better = benchmarks.flatten(results, higher)
    assert scores == {"eval/gsm8k/exact_match/strict-match": 0.25,
                      "eval/gsm8k/exact_match/flexible-extract": 0.5,
                      "eval/wikitext/word_perplexity": 31.5,
                      "eval/wikitext/bits_per_byte": 0.9}
    assert better["eval/wikitext/word_perplexity"] is False
    assert better["eval/gsm8k/exact_match/strict-match"] is True


def test_every_kth_periodic_checkpoint_and_the_final_one_are_scored():
    ev = EvalConfig(tasks=["x"], every=2)
    scored = [s for s in range(1, 101)
              if benchmarks.due(s, ev=ev, checkpoint_every=10, total_steps=95)]
    # Checkpoints at 10, 20, ... 90 and the final 95: every second one, and the last.
    assert scored == [20, 40, 60, 80, 95, 96, 97, 98, 99, 100]
    assert benchmarks.due(95, ev=EvalConfig(tasks=["x"]), checkpoint_every=10, total_steps=95)
    # A preemption's checkpoint off the schedule is not scored.
    assert not benchmarks.due(13, ev=EvalConfig(tasks=["x"]), checkpoint_every=10,
                              total_steps=95)


def record(step, scores, *, higher=None, invocation="1", time=0.0):
    return Benchmark(invocation=invocation, time=time, step=step,
                     checkpoint=f"checkpoint_{step}", scores=scores, higher=higher or {},
                     seconds=5.0)


def test_the_summary_keeps_the_latest_and_the_best_score_in_lm_evals_direction():
    ppl = "eval/wikitext/word_perplexity"
    acc = "eval/arc_easy/acc"
    records = [record(10, {acc: 0.30, ppl: 40.0}, higher={acc: True, ppl: False}),
               record(20, {acc: 0.45, ppl: 33.0}, higher={acc: True, ppl: False}),
               BenchmarkFailed(invocation="1", time=0.0, step=30, checkpoint="checkpoint_30",
                               error="OSError: gone"),
               record(40, {acc: 0.40, ppl: 35.0}, higher={acc: True, ppl: False})]
    s = benchmarks.summarize(records)
    assert s["scores"][acc] == {"best": 0.45, "best_step": 20, "latest": 0.40,
                                "latest_step": 40}
    assert s["scores"][ppl] == {"best": 33.0, "best_step": 20, "latest": 35.0,
                                "latest_step": 40}
    assert s["failed"] == [{"step": 30, "error": "OSError: gone"}]
    assert s["seconds"] == 15.0
    line = benchmarks.describe(records[0])
    assert "step 10" in line and "arc_easy/acc 0.3000" in line
    assert "failed (after one retry): OSError: gone" in benchmarks.describe(records[2])
    # An evaluation's failure keeps the last line of what it raised.
    failed = benchmarks.outcome_record(30, "/runs/r/checkpoint_30",
                                       OSError("reading\nno such file: checkpoint_30"))
    assert failed.error == "OSError: no such file: checkpoint_30"


def test_evaluations_run_beside_the_wall_time_and_only_the_end_waiting_for_them_counts():
    base = [Started(invocation="1", time=0.0),
            GroupStart(invocation="1", time=0.0, workers=1, from_step=0, setup_s=1.0),
            record(10, {"eval/x/acc": 0.5}, time=5.0),
            WaitedForBenchmarks(invocation="1", time=9.0, seconds=3.0),
            Ended(invocation="1", time=10.0, status="failed")]
    g = goodput(base)
    assert g.total_s == 10.0 and g.seconds["benchmarks"] == 3.0
    # `raylm eval`'s records, written later under an invocation of their own, add no time.
    later = [*base, record(10, {"eval/x/acc": 0.5}, invocation="2", time=500.0)]
    assert goodput(later) == g


def test_a_benchmark_that_cannot_be_placed_is_refused_and_one_that_waits_is_said():
    cfg = load_config(None, ["--eval.tasks=[x]", "--eval.resources={GPU: 1}",
                             "--scaling.use_gpu=false"])
    plan = plan_resources(cfg, {"CPU": 4.0})
    with pytest.raises(ValueError, match=r"eval.resources=\{'GPU': 1.0\}: the cluster has 0 GPU"):
        plan_benchmarks(cfg, plan, {"CPU": 4.0})
    cfg = load_config(None, ["--eval.tasks=[x]", "--eval.resources={CPU: 1}",
                             "--scaling.use_gpu=false", "--scaling.num_workers=2"])
    plan = plan_resources(cfg, {"CPU": 2.0})
    assert "wait" in plan_benchmarks(cfg, plan, {"CPU": 2.0})
    assert plan_benchmarks(cfg, plan, {"CPU": 4.0}) is None
    assert plan_benchmarks(cfg, plan, None) is None  # autoscaling: the autoscaler's to place


def test_an_exported_model_is_scored_in_process_by_the_python_api(tmp_path, tokenizer_dir):
    """``raylm.evaluate`` on a model directory (an export's shape: weights and tokenizer):
    lm-eval's scores, the same on a second call; a run's choices refused for it."""
    import shutil

    import raylm
    from tests.conftest import save_tiny_llama, tokenizer_vocab

    model = save_tiny_llama(tmp_path / "model", vocab_size=tokenizer_vocab(tokenizer_dir))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, model / f.name)
    tasks = write_task(tmp_path / "tasks")
    overrides = {"eval.tasks": ["tiny_mc"], "eval.include_path": str(tasks),
                 "eval.batch_size": 2}
    scores = raylm.evaluate(model, overrides=overrides)
    assert list(scores.columns) == ["step", "eval/tiny_mc/acc"] and len(scores) == 1
    # Five two-way questions: a share of fifths.
    assert round(scores["eval/tiny_mc/acc"][0] * 5, 6) in range(6)
    again = benchmarks.score_model(model, EvalConfig(tasks=["tiny_mc"],
                                                     include_path=str(tasks)))
    assert again.scores == {"eval/tiny_mc/acc": scores["eval/tiny_mc/acc"][0]}
    with pytest.raises(ValueError, match="--step and --all choose among a run's checkpoints"):
        raylm.evaluate(model, overrides=overrides, step=10)
    with pytest.raises(ValueError, match="eval.\\* overrides only, not train.steps"):
        raylm.evaluate(model, overrides={"train.steps": 3})
    with pytest.raises(ConfigError, match="name the benchmarks with --eval.tasks"):
        raylm.evaluate(model)
