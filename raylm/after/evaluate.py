"""``raylm eval``: benchmark scores of a run's checkpoints, or of an exported model, after the
fact, with the code that scores them while a run trains (:mod:`raylm.run.benchmarks`)::

    raylm eval runs/my-run --all
    raylm eval exported/ --eval.tasks=[arc_easy] --eval.limit=200

Here the scoring runs in this process (no Ray): on its GPU if it has one, else its CPUs.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from raylm import rundir, storage
from raylm.config import ConfigError, EvalConfig, config_from_dict
from raylm.contracts import RUN_INFO
from raylm.contracts.events import Benchmark
from raylm.run import tracking
from raylm.run.benchmarks import (
    check_settings,
    describe,
    outcome_record,
    score_checkpoint,
    score_model,
    summarize,
)
from raylm.run.lease import hold
from raylm.run.record import EventLog, read
from raylm.rundir import read_run_info


def evaluate_source(source: str, ev: EvalConfig | None, *, step: int | None = None,
                    every: bool = False, log=print) -> list[dict[str, Any]]:
    """Score a run's checkpoint (the latest usable one, the one at ``step``, or ``every``
    one) or an exported model directory on ``ev`` (None: the run's own eval settings).

    A run's scores go where its own evaluations go: its events, ``summary.json``'s
    ``benchmarks`` and its MLflow run, under the run's lease (a run still training is
    refused: it scores its own checkpoints). An export's scores are returned only."""
    src = storage.normalize(source)
    if not storage.is_file(storage.join(src, RUN_INFO)):
        if not (Path(src) / "config.json").is_file():
            raise ValueError(f"{src} is neither a raylm run directory nor an exported model.")
        if step is not None or every:
            raise ValueError("--step and --all choose among a run's checkpoints; "
                             f"{src} is an exported model.")
        if ev is None or not ev.tasks:
            raise ConfigError("an exported model has no eval settings of its own: name the "
                              "benchmarks with --eval.tasks")
        check_settings(ev)
        scored = score_model(Path(src), ev)
        return [Benchmark(step=None, checkpoint=src, scores=scored.scores,
                          higher=scored.higher, seconds=scored.seconds)]
    cfg = config_from_dict(read_run_info(src).config)
    if ev is None or not ev.tasks:  # the run's tasks; task code only from a folder named here
        named = ev.include_path if ev is not None else None
        if cfg.eval.include_path and not named:
            raise ConfigError(f"run {cfg.run.name!r} scored tasks of eval.include_path="
                              f"{cfg.eval.include_path}, whose code raylm imports only from "
                              f"a folder you name: add --eval.include_path=FOLDER")
        ev = replace(cfg.eval, include_path=named)
    if not ev.tasks:
        raise ConfigError(f"run {cfg.run.name!r} named no benchmarks (eval.tasks): name them "
                          f"with --eval.tasks")
    check_settings(ev)
    bad = rundir.read_manifest(src)["bad_checkpoints"]
    found = {}
    for path in rundir.candidates(src):
        try:
            marker = rundir.verify(path)
        except (rundir.CheckpointError, OSError):
            continue
        if storage.name(path) not in bad:
            found[marker.step] = path
    if step is not None and step not in found:
        raise ValueError(f"{src} has no usable checkpoint at step {step}; it has "
                         f"{', '.join(map(str, sorted(found))) or 'none'}")
    if not found:
        raise ValueError(f"{src} holds no complete checkpoint to score.")
    steps = sorted(found) if every else [step if step is not None else max(found)]
    out = []
    with hold(src, log=log):
        summary = rundir.read_summary(src)
        tracker = tracking.run_tracker(src, summary, log=log)
        log_ = EventLog(src, f"{time.time():.6f}")
        for s in steps:
            log(f"raylm: scoring the checkpoint at step {s} ({found[s]}) on "
                f"{', '.join(ev.tasks)}")
            try:
                result: Any = score_checkpoint(src, found[s], ev)
            except Exception as e:  # noqa: BLE001 - recorded as the run's evaluations are
                result = e
            record = outcome_record(s, found[s], result)
            log(describe(record))
            log_.add(record)
            if isinstance(record, Benchmark):
                tracker.log_scores(record.scores, s)
            out.append(record)
        log_.flush()
        if summary is not None:
            summary.benchmarks = summarize(read(src))
            rundir.write_summary(src, summary)
    return out
