"""Live metrics: a run's figures as Ray application metrics, served by Ray's Prometheus endpoint.

MLflow holds the run's history; an operator watching a cluster wants the same figures now, beside
Ray's own metrics and the GPUs' (DCGM), in Prometheus and Grafana. Ray already runs a metrics
agent on every node that exports what any process records through ``ray.util.metrics`` on the
node's ``--metrics-export-port`` (``/metrics``), adding the labels ``NodeAddress``,
``SessionName`` and ``WorkerId``; Prometheus scrapes it as it scrapes Ray's own series. So raylm
records gauges there, and writes no exporter of its own.

Series (Prometheus prefixes Ray's application metrics with ``ray_``), labelled ``run`` (the run
name) and, from the workers, ``rank``:

- every worker, at each report: ``raylm_step``, ``raylm_loss``, ``raylm_val_loss`` (at
  evaluations), ``raylm_lr``, ``raylm_grad_norm``, ``raylm_tokens_per_s`` (the whole run's),
  ``raylm_mfu`` (GPUs with a listed peak), ``raylm_data_wait_fraction`` (this rank's, since the
  last report), ``raylm_peak_memory_bytes`` (this rank's), ``raylm_energy_joules`` (the run so
  far, every GPU; NVML) and ``raylm_watts_per_gpu``. Each rank records its own, so a rank's
  series carries the node it runs on (``NodeAddress``) and a slow or memory-heavy rank shows.
- the Train controller, at each report: ``raylm_goodput`` (productive share of the wall time so
  far, every invocation: :mod:`raylm.run.goodput`), ``raylm_restarts``, ``raylm_resizes`` and
  ``raylm_failures`` (every invocation).

A figure that is not measured (MFU on a CPU, energy without NVML) is not recorded: Prometheus
shows no series rather than a zero. Ray's agent sends what it was given every
``metrics_report_interval_ms`` (10 s by default), so a series trails its report by up to that.
Outside a Ray worker process (a gloo test, the bare loop) nothing is recorded.
"""

from __future__ import annotations

from typing import Any

# (series, description, the report's key, factor from the report's unit to the series')
WORKER_FIGURES = (
    ("raylm_step", "Optimizer steps done.", "step", 1.0),
    ("raylm_loss", "Training loss of the last step before the report (nats/token).", "loss", 1.0),
    ("raylm_val_loss", "Validation loss at the last evaluation (nats/token).", "val_loss", 1.0),
    ("raylm_lr", "Learning rate of the last step.", "lr", 1.0),
    ("raylm_grad_norm", "Gradient norm of the last step, before clipping.", "grad_norm", 1.0),
    ("raylm_tokens_per_s", "Trained tokens per second, the whole run, since the last report.",
     "tokens_per_s", 1.0),
    ("raylm_mfu", "Model FLOPs utilization since the last report (0-1).", "mfu", 1.0),
    ("raylm_data_wait_fraction", "Share of this rank's time waiting for batches since the last "
     "report.", "data_wait_fraction", 1.0),
    ("raylm_peak_memory_bytes", "This rank's peak memory: CUDA allocator, or the process's RSS.",
     "peak_memory_gb", 2.0**30),
    ("raylm_energy_joules", "GPU energy of the run so far, every GPU (NVML).", "energy_kwh",
     3.6e6),
    ("raylm_watts_per_gpu", "Mean power per GPU since the last report (NVML).", "watts_per_gpu",
     1.0),
)
RUN_FIGURES = (
    ("raylm_goodput", "Productive share of the run's wall time so far (0-1).", "goodput"),
    ("raylm_restarts", "Worker groups restarted after a failure, every invocation.", "restarts"),
    ("raylm_resizes", "Worker groups restarted at another size, every invocation.", "resizes"),
    ("raylm_failures", "Worker failures, every invocation.", "failures"),
)


class LiveMetrics:
    """One process's gauges for one run; a null object outside a Ray worker process."""

    def __init__(self, run: str, *, rank: int | None = None) -> None:
        import ray

        self.tags = {"run": run} if rank is None else {"run": run, "rank": str(rank)}
        self.gauges: dict[str, Any] = {}
        if not ray.is_initialized():
            return
        from ray.util.metrics import Gauge

        figures = ([(n, d, k) for n, d, k, _ in WORKER_FIGURES] if rank is not None
                   else RUN_FIGURES)
        for name, description, key in figures:
            self.gauges[key] = Gauge(name, description=description,
                                     tag_keys=tuple(self.tags))
        self.factors = {k: f for _, _, k, f in WORKER_FIGURES}

    def record(self, figures: dict[str, Any]) -> None:
        """Set every gauge whose figure ``figures`` holds (None: not measured, left alone)."""
        for key, gauge in self.gauges.items():
            value = figures.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                gauge.set(float(value) * self.factors.get(key, 1.0), tags=self.tags)
