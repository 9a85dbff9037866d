"""What a sweep's trial hands Ray Tune: its results, from its Train controller to Tune's
session in the trial's own process.

A module without torch: Ray Train's controller unpickles its callbacks, and
:class:`TrialReporter` defined in :mod:`raylm.run.sweep` (which imports the launcher, and with
it torch and the training loop) made every trial's controller import those as it started.
"""

from __future__ import annotations

import threading

from ray.train.v2.api.callback import UserCallback

from raylm.contracts.events import Benchmark
from raylm.contracts.report import Report

METRIC = "val_loss"


class TrialReporter(UserCallback):
    """A trial's results for Tune, from its Train controller: each report (less the worker
    groups' announcements, which carry no ``val_loss``, which Tune requires of every result of
    a trial), with its checkpoint's path. A sweep ranked by a benchmark (tune.metric) reports
    a result as each checkpoint's scores arrive instead (the run's record calls
    :meth:`scored`), with the step of the checkpoint they score: Tune sees the score as soon
    as it exists, and training never waits for it. Results go into the trial's
    :class:`ToTune` queue."""

    def __init__(self, queue, *, by_benchmark: bool = False) -> None:
        self.queue = queue
        self.by_benchmark = by_benchmark

    def after_report(self, run_context, metrics, checkpoint) -> None:
        if self.by_benchmark or Report.from_metrics(metrics[0]).announces:
            return
        result = dict(metrics[0])
        if checkpoint is not None:
            result["checkpoint_path"] = checkpoint.path
        self.queue.put(result)

    def scored(self, record: Benchmark, *, val_loss: float | None) -> None:
        if self.by_benchmark:
            self.queue.put({"step": record.step, **record.scores,
                            **({} if val_loss is None else {METRIC: val_loss})})


class ToTune:
    """Hands a trial's results to Tune from a thread of the trial's own process, in order,
    every one of them before the trial's function returns.

    Why not Ray Train's ``TuneReportCallback``: it puts results into a queue that Tune's main
    thread polls only while the trial's function runs, and the function's return is itself a
    result. A result put in the last moments of a run could come second: the score of a
    trial's last checkpoint, put as its run ended, was never seen by Tune whenever the run
    ended within a fraction of a second of it (a trial trained to step 120 and ranked by its
    score at step 60). Here a thread takes the results from the queue and reports each one
    through Tune's session as the function would, and :meth:`close`, called when the run has
    ended, lets the function return only once that thread has reported them all."""

    def __init__(self) -> None:
        from ray.util.queue import Queue

        self.queue = Queue(actor_options={"num_cpus": 0})
        self.thread = threading.Thread(target=self._forward, name="raylm-to-tune", daemon=True)
        self.thread.start()

    def _forward(self) -> None:
        from ray import tune

        while (result := self.queue.get()) is not None:
            # Returns once Tune took it; a trial Tune stops ends this thread here.
            tune.report(result)

    def close(self, timeout_s: float = 60.0) -> None:
        """After the run's controller ended (nothing more is put): wait until every result
        went to Tune. A Tune that stopped asking (it stops the trial) leaves the rest."""
        try:
            self.queue.put(None)
        except Exception:  # noqa: BLE001 - the queue's actor is gone: nothing more can reach Tune
            return
        self.thread.join(timeout_s)
