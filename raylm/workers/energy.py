"""GPU energy from NVML's cumulative energy counter, per rank, and what it costs.

Each rank reads ``nvmlDeviceGetTotalEnergyConsumption`` (millijoules since the driver loaded,
Volta and later) of its own GPU around report windows; the difference is the energy the GPU drew
over the window, idle moments and data waits included. That is what a run costs, which a
power sample times a duration only approximates (the counter integrates in the driver).

The GPU is found by UUID, not by index: ``CUDA_VISIBLE_DEVICES`` (which Ray sets per worker)
renumbers the devices CUDA shows, while NVML numbers every GPU of the node, so index 0 in a
worker can be NVML's GPU 5. On a CPU, or without NVML (the ``nvidia-ml-py`` package), every
figure is None, never zero: "not measured" is not "free".

Figures (the run's totals are kept in the checkpointed train state, so they survive restarts):

    joules_per_step   the window's energy, all GPUs, over its steps
    watts_per_gpu     the window's energy over its wall time and the GPU count
    joules_per_token  the window's energy over its trained tokens
    energy_kwh        the run so far, all GPUs, every worker group
    gpu_hours         the run so far: wall time of each group x its GPUs
    cost              gpu_hours x ``tracking.gpu_hour_price`` (when set)
"""

from __future__ import annotations

import torch

MJ_PER_KWH = 3.6e9  # millijoules in a kilowatt-hour


def _nvml():
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    return pynvml


def nvml_handle(device: torch.device):
    """The NVML handle of CUDA ``device``, matched by UUID; None without NVML or on CPU."""
    if device.type != "cuda":
        return None
    nvml = _nvml()
    if nvml is None:
        return None
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    # torch prints the bare UUID, NVML names devices "GPU-<uuid>" (MIG slices "MIG-<uuid>").
    for name in (uuid, f"GPU-{uuid}", f"MIG-{uuid}"):
        try:
            return nvml.nvmlDeviceGetHandleByUUID(name)
        except nvml.NVMLError:
            continue
    return None


class EnergyCounter:
    """This rank's GPU energy counter, in joules; ``read()`` is None where there is none."""

    def __init__(self, device: torch.device) -> None:
        self.handle = nvml_handle(device)
        if self.handle is not None and self._read_mj() is None:
            self.handle = None  # a GPU without the counter (before Volta)

    def _read_mj(self) -> int | None:
        import pynvml

        try:
            return int(pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except pynvml.NVMLError:
            return None

    @property
    def available(self) -> bool:
        return self.handle is not None

    def read(self) -> float | None:
        """Joules since the driver loaded; None without a counter."""
        if self.handle is None:
            return None
        mj = self._read_mj()
        return None if mj is None else mj / 1e3


def window_figures(*, joules: float | None, steps: int, tokens: int, seconds: float,
                   gpus: int) -> dict[str, float | None]:
    """Per-step, per-GPU and per-token figures of one window drawing ``joules`` (all GPUs)."""
    if joules is None or joules <= 0:
        # Zero joules over a window is a window shorter than the counter's update period (a
        # 2-step window of the tiny model on an H100), not free work.
        return {"joules_per_step": None, "watts_per_gpu": None, "joules_per_token": None}
    return {
        "joules_per_step": joules / max(1, steps),
        "watts_per_gpu": joules / max(seconds, 1e-9) / max(1, gpus),
        "joules_per_token": joules / max(1, tokens),
    }


def run_figures(*, joules: float | None, gpu_seconds: float | None,
                gpu_hour_price: float | None) -> dict[str, float | None]:
    """The run's totals: energy in kWh, GPU-hours, and their cost at ``gpu_hour_price``."""
    gpu_hours = None if gpu_seconds is None else gpu_seconds / 3600
    return {
        "energy_kwh": None if joules is None else joules * 1e3 / MJ_PER_KWH,
        "gpu_hours": gpu_hours,
        "cost": (None if gpu_hours is None or gpu_hour_price is None
                 else gpu_hours * gpu_hour_price),
    }
