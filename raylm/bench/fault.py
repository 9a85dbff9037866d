"""What one lost worker costs: the same run uninterrupted, then with its worker killed.

    python -m raylm.bench fault --output runs/bench-fault.json --config CONFIG.yaml
        [--kill-after 20] [--delay 2] [overrides ...]

Joins the Ray cluster the config or ``RAY_ADDRESS`` names (or starts a local one) and trains the
config twice, under two run names: once straight through, once with every training worker
SIGKILLed ``--delay`` seconds after the first verified checkpoint at step ``--kill-after`` or
later, as a machine lost mid-step. The second run restarts (Ray Train's FailureConfig),
resumes from its newest checkpoint and finishes. Reports the uninterrupted run's throughput,
both final losses and their difference (resume is exact in data and optimizer state; on GPUs
bf16 kernels are not bitwise deterministic, so the losses differ by rounding), and from the
killed run's record the interruption: the step of the last report, the step resumed from, the
steps trained again and the time lost (last report before the kill to the first report
after, less the time the steps in between take).
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from raylm import rundir


def train_workers() -> list:
    """The live Ray Train worker processes on this machine."""
    import psutil

    return [p for p in psutil.process_iter(["cmdline"])
            if any("ray::RayTrainWorker" in part for part in (p.info["cmdline"] or []))]


def kill_after_checkpoint(run_dir: str, *, step: int, delay_s: float, timeout_s: float,
                          done: threading.Event, count: int | None = None) -> dict[str, Any]:
    """Wait for a verified checkpoint at ``step`` or later in ``run_dir``, wait ``delay_s``,
    SIGKILL every training worker (or ``count`` of them); what was done and when."""

    deadline = time.monotonic() + timeout_s
    while not done.is_set() and time.monotonic() < deadline:
        found = rundir.latest_verified(run_dir, warn=lambda m: None)
        if found and found[1].step >= step:
            time.sleep(delay_s)
            victims = train_workers()[:count]
            for p in victims:
                p.send_signal(signal.SIGKILL)
            return {"killed_pids": [p.pid for p in victims], "killed_at": time.time(),
                    "checkpoint_step": found[1].step}
        time.sleep(0.1)
    return {"killed_pids": [], "error": f"no checkpoint at step {step} within {timeout_s:g} s"}


def run(*, config: str | None, overrides: list[str], kill_after: int, delay_s: float,
        timeout_s: float = 1800.0) -> dict[str, Any]:
    from raylm.config import load_config, run_dir
    from raylm.run.launch import train

    def cfg(name: str):
        c = load_config(config, [*overrides, f"--run.name={name}"])
        if c.checkpoint.every > kill_after:
            raise ValueError(f"--kill-after={kill_after} comes before the first checkpoint "
                             f"(checkpoint.every={c.checkpoint.every}): lower one of them")
        return c

    straight_cfg, killed_cfg = cfg("bench-fault-straight"), cfg("bench-fault-killed")
    straight = train(straight_cfg, log=print)
    done, kill = threading.Event(), {}
    watcher = threading.Thread(target=lambda: kill.update(kill_after_checkpoint(
        run_dir(killed_cfg), step=kill_after, delay_s=delay_s, timeout_s=timeout_s,
        done=done)), daemon=True)
    watcher.start()
    try:
        killed = train(killed_cfg, log=print)
    finally:
        done.set()
        watcher.join()
    loss_a, loss_b = straight["train_loss"], killed["train_loss"]
    return {
        "benchmark": "fault",
        "metric": "time lost to a SIGKILLed worker, and the final loss against an "
                  "uninterrupted run of the same config",
        "config": config, "overrides": overrides, "kill_after": kill_after, "delay_s": delay_s,
        "kill": kill,
        "uninterrupted": {k: straight.get(k) for k in
                          ("final_step", "train_loss", "val_loss", "val_reward",
                           "tokens_per_s", "mfu", "data_wait_fraction", "peak_memory_gb",
                           "wall_s")},
        "killed": {k: killed.get(k) for k in
                   ("final_step", "train_loss", "val_loss", "val_reward", "restarts",
                    "failures", "interruptions", "goodput", "wall_s")},
        "train_loss_difference": abs(loss_a - loss_b),
        "train_loss_relative_difference": abs(loss_a - loss_b) / abs(loss_a),
        "val_loss_difference": (None if straight.get("val_loss") is None
                                or killed.get("val_loss") is None
                                else abs(straight["val_loss"] - killed["val_loss"])),
    }
