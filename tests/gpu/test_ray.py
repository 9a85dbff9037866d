"""`raylm train` through Ray Train and Ray Data on a real GPU: the worker gets the device, trains
in bf16-mixed, checkpoints, and the run's summary says what ran where.

Needs a CUDA device and Ray: ``python -m pytest -m gpu tests/gpu``; skipped without either
(on a GPU machine without network, Ray comes from the wheel set: scripts/gpu_run.sh).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from raylm import rundir
from raylm.config import load_config, run_dir
from tests.conftest import tiny_run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs Ray")]


@pytest.fixture(scope="module")
def gpu_cluster():
    """A Ray cluster with this machine's GPU: the head that RAY_ADDRESS names (scripts/
    gpu_run.sh starts one), else a new local one."""
    import os

    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS") or "local", log_to_driver=False)
    yield
    ray.shutdown()


def test_a_train_run_through_ray_trains_on_the_gpu(tmp_path: Path, tokenizer_dir, gpu_cluster):
    import torch

    from raylm.run.launch import train

    base = tiny_run(tmp_path, tokenizer_dir)
    cfg = load_config(None, [*base, "--train.precision=bf16-mixed", "--scaling.use_gpu=true",
                             "--scaling.num_workers=1", "--train.steps=4",
                             "--train.global_batch_size=4", "--train.micro_batch_size=4",
                             "--train.log_every=2", "--checkpoint.every=2",
                             "--tracking.enabled=false"])
    summary = train(cfg, log=print)
    assert summary["final_step"] == 4
    assert summary["precision"] == "bf16-mixed"
    # MFU is computed only against a known GPU's peak, energy only where NVML reads one.
    assert summary["mfu"] is not None and 0 < summary["mfu"] < 1, summary
    # The run's energy counts from the group's start; its last 2-step window (milliseconds)
    # may be shorter than NVML's counter takes to move, and then has no per-token figure.
    assert summary["energy_kwh"] is not None and summary["energy_kwh"] > 0
    assert summary["joules_per_token"] is None or summary["joules_per_token"] > 0
    assert 0 < summary["peak_memory_gb"] < torch.cuda.get_device_properties(0).total_memory / 1e9
    assert math.isfinite(summary["train_loss"]) and math.isfinite(summary["val_loss"])
    _, marker = rundir.latest_verified(run_dir(cfg))
    assert marker["state"]["step"] == 4
