"""MLflow's system metrics of a worker's node (CPU, memory, disk, network, GPUs), logged into the
run's MLflow run as ``system/<node>/...`` by one worker per node. The driver hands the workers
the run's tracking URI and run id (:class:`raylm.workers.handoff.Handoff`), not its tracker:
this is all a worker does with MLflow.
"""

from __future__ import annotations

import logging
import os
import threading


def fail_fast() -> None:
    """In this process: a dead server costs seconds, not MLflow's default minutes of retries
    for every call. Each process that reaches MLflow (the driver, the Train controller, the
    workers) sets it: Ray's processes do not see the driver's later environment changes."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


class NodeMonitor:
    """MLflow's system-metrics monitor for node ``node`` of the run tracked at ``target``
    (URI, run id; None: not tracked). Started in a thread: importing mlflow took 3.4 s in a
    worker here, which training need not wait for."""

    def __init__(self, target: tuple[str, str] | None, node: str) -> None:
        self.target, self.node = target, node
        self.monitor = None
        self.thread = threading.Thread(target=self._guarded, args=("start", self._start),
                                       name="raylm-system-metrics", daemon=True)
        if target is not None:
            self.thread.start()

    def _guarded(self, what: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # MLflow raises many types for an unreachable or broken store
            print(f"warning: MLflow could not {what} system metrics on {self.node}: "
                  f"{str(e).splitlines()[0][:300] if str(e) else type(e).__name__}", flush=True)

    def _start(self) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        fail_fast()
        # The monitor warns when the store fails, from every node, and stops; the
        # controller's record says that once for the whole run.
        logging.getLogger("mlflow.system_metrics").setLevel(logging.CRITICAL)
        uri, run_id = self.target
        self.monitor = SystemMetricsMonitor(run_id, sampling_interval=5, samples_before_logging=1,
                                            resume_logging=True, node_id=self.node,
                                            tracking_uri=uri)
        self.monitor.start()

    def stop(self) -> None:
        """Stop, publishing one last sample. The monitor publishes once per sampling interval
        (5 s) and drops what it collected since, so a worker group that lives less than that
        would leave no system metrics at all."""
        if self.thread.is_alive():
            self.thread.join()
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            self._guarded("stop", lambda: _last_sample(monitor))


def _last_sample(monitor) -> None:
    failed = monitor._process is None or not monitor._process.is_alive()
    monitor.finish()
    if failed:  # its thread ends at the first failure to publish: the store is gone
        return
    monitor.collect_metrics()
    monitor.publish_metrics(monitor.aggregate_metrics())
    monitor.mlflow_logger.flush()
