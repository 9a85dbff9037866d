"""What a run pays around its steps: a report, the start, a recovery.

    python -m raylm.bench startup --output runs/bench-startup.json [--workers 1,2]
        [--steps 60] [--kill-after 20] [--tracking on|off]

Prepares a slice of the builtin corpus once (not timed), then for each worker count runs
``raylm train`` as a user would, in a fresh process, on the tiny preset reporting every step
(``train.log_every=1``):

- ``cold``: the command starts its own Ray (``run.ray_address=local``);
- ``warm``: against a running head (``ray start --head`` on 127.0.0.1, started by the benchmark
  with the machine's CPUs, before the run; the first run on it is not counted, so that the
  head's own start-up is not either);
- ``recovery``: the warm run again, one training worker SIGKILLed after the checkpoint at step
  ``--kill-after``.

Each figure comes from the command's start (this process's clock) and the run's own record
(``events.jsonl``: the workers' and the controller's clocks; one machine, one clock):

- ``first_step_s``: the command's start to rank 0's report of the first step;
- ``phases``: ``cli`` (the command's start to the run's first record: the interpreter, imports,
  joining or starting Ray, preflight, MLflow), the group's start in the parts the goodput
  account names (:mod:`raylm.run.goodput`), and ``first_step`` (the group ready to the first
  step done);
- ``report_cost_s``: what one report cost the loop, the account's ``reporting`` seconds over
  the reports made;
- ``recovery_s``: the kill to the first step the new group trained, and the restart's phases;
- ``exit_s``: the run's end (its record's last event, on the controller) to the command's
  process gone: the driver's last lines, leaving Ray (and, cold, stopping it), the exit;
- ``goodput``: the run's account.

Written by hand: Ray Train logs its own worker-group start-up in debug lines, but nothing
measures from a user's command or a kill to a trained step.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from raylm.contracts.events import Ended, EventRecord, Failure, GroupStart, Progress
from raylm.run.goodput import PHASES, goodput

# cpu_tiny's corpus and model (jobs/configs/cpu_tiny.yaml), written out: the benchmark runs
# from an installed package too.
DATA = ["--data.builtin_packages=[peft, datasets]", "--data.seq_len=128",
        "--data.val_fraction=0.02", "--tokenizer.vocab_size=4096",
        "--tokenizer.train_chars=2000000"]


def raylm_command() -> list[str]:
    """``raylm`` beside this interpreter (the console script users run), else the module."""
    script = Path(sys.executable).parent / "raylm"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "raylm"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Head:
    """A Ray head of the benchmark's own on 127.0.0.1, as ``ray start --head`` makes it."""

    def __init__(self, env: dict[str, str], *, timeout_s: float = 120.0) -> None:
        self.port = free_port()
        self.temp = tempfile.mkdtemp(prefix="raylm-bench-head-")
        ray = Path(sys.executable).parent / "ray"
        self.process = subprocess.Popen(
            [str(ray), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
             f"--port={self.port}", f"--num-cpus={os.cpu_count()}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={free_port()}",
             f"--temp-dir={self.temp}", "--disable-usage-stats"],
            env=env, start_new_session=True, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        self.address = f"127.0.0.1:{self.port}"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the benchmark's Ray head did not answer on port "
                                       f"{self.port} within {timeout_s:.0f} s") from None
                time.sleep(0.5)

    def stop(self) -> None:
        """This head's processes only: its process group, then what runs from its temp dir."""
        import psutil

        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
        for p in psutil.process_iter(["cmdline"]):
            if any(self.temp in part for part in p.info["cmdline"] or ()):
                p.kill()
        shutil.rmtree(self.temp, ignore_errors=True)


def timed_run(argv: list[str], *, env: dict[str, str], run_dir: Path, log: Path,
              kill_after: int | None = None) -> dict[str, Any]:
    """``raylm train argv`` from this moment; with ``kill_after``, one training worker
    SIGKILLed after the checkpoint at that step."""
    from raylm.bench.fault import kill_after_checkpoint

    done, kill = threading.Event(), {}
    watcher = None
    if kill_after is not None:
        watcher = threading.Thread(target=lambda: kill.update(kill_after_checkpoint(
            str(run_dir), step=kill_after, delay_s=0.5, timeout_s=600, done=done, count=1)),
            daemon=True)
        watcher.start()
    started = time.time()
    with open(log, "w") as out:
        code = subprocess.call([*raylm_command(), "train", *argv], env=env, stdout=out,
                               stderr=subprocess.STDOUT)
    exited = time.time()
    done.set()
    if watcher is not None:
        watcher.join()
    if code != 0:
        raise RuntimeError(f"raylm train exited {code}; its output is in {log}")
    from raylm.run.record import read

    return figures(read(str(run_dir)), started=started, kill=kill or None, exited=exited)


def figures(records: list[EventRecord], *, started: float,
            kill: dict[str, Any] | None, exited: float | None = None) -> dict[str, Any]:
    """A run's start, reports and recovery from its records (see the module doc); with
    ``exited`` (when the command's process ended), ``exit_s``: from the run's end record to
    then (the driver's last lines, leaving Ray, the process's exit)."""
    progress = [r for r in records if isinstance(r, Progress)]
    account = goodput(records)
    first_group = next(r for r in records if isinstance(r, GroupStart))
    ready = first_group.time + first_group.setup_s
    failure = next((i for i, r in enumerate(records) if isinstance(r, Failure)), None)
    before = goodput(records[:failure]) if failure is not None else account
    out = {
        "first_step_s": round(progress[0].time - started, 2),
        "phases": {"cli": round(records[0].time - started, 2), **before.startup_phases,
                   "first_step": round(progress[0].time - ready, 2)},
        "reports": len(progress),
        "report_cost_s": round(account.seconds["reporting"] / len(progress), 4),
        "last_step_s": round(progress[-1].time - started, 2),
        "goodput": asdict(account),
    }
    end = next((r for r in reversed(records) if isinstance(r, Ended)), None)
    if exited is not None and end is not None:
        out["exit_s"] = round(exited - end.time, 2)
    if kill is not None and failure is not None:
        restart = next(r for r in records[failure:] if isinstance(r, GroupStart))
        after = next(r for r in progress if r.time > restart.time)
        out["recovery_s"] = round(after.time - kill["killed_at"], 2)
        out["recovery_phases"] = {
            "detect": round(records[failure].time - kill["killed_at"], 2),
            **{k: round(account.startup_phases[k] - before.startup_phases[k], 2)
               for k in PHASES},
            "first_step": round(after.time - restart.time - restart.setup_s, 2)}
        out["kill"] = kill
    return out


def run(*, workers: list[int], steps: int, kill_after: int, workdir: str | None,
        tracking: bool = True) -> dict[str, Any]:
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="raylm-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    # Ray 2.60 turns token authentication on for new clusters: the head, and every command
    # that joins it, share a token.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    env.pop("RAY_ADDRESS", None)
    prepared = root / "prepared"
    if not (prepared / "manifest.json").is_file():
        subprocess.run([*raylm_command(), "prepare", *DATA, f"--output={prepared}",
                        f"--run.storage_path={root}/runs", "--run.ray_address=local",
                        f"--tracking.enabled={str(tracking).lower()}"],
                       env=env, check=True, stdout=subprocess.DEVNULL)

    def argv(name: str, n: int, *more: str) -> list[str]:
        return [f"--data.source={prepared}", "--data.seq_len=128", "--model.preset=tiny",
                "--train.precision=fp32",
                f"--train.steps={steps}", "--train.log_every=1", f"--train.eval_every={steps}",
                "--train.eval_batches=2", f"--checkpoint.every={kill_after}",
                "--train.global_batch_size=8", f"--train.micro_batch_size={8 // n}",
                f"--scaling.num_workers={n}", f"--run.storage_path={root}/runs",
                f"--run.name={name}", f"--tracking.enabled={str(tracking).lower()}", *more]

    def one(name: str, n: int, *more: str, run_env: dict[str, str], kill: bool = False):
        if (root / "runs" / name).exists():  # never another run's directory, nor a resume
            raise ValueError(f"{root / 'runs' / name} exists: give --workdir a new folder")
        print(f"bench startup: {name}", flush=True)
        result = timed_run(argv(name, n, *more), env=run_env, run_dir=root / "runs" / name,
                           log=root / f"{name}.log", kill_after=kill_after if kill else None)
        if kill and "recovery_s" not in result:
            raise RuntimeError(f"{name}: no worker was killed and replaced after step "
                               f"{kill_after}; its output is in {root / f'{name}.log'}")
        return result

    results: dict[str, Any] = {}
    for n in workers:
        results[f"cold_{n}w"] = one(f"cold-{n}w", n, "--run.ray_address=local", run_env=env)
    head = Head(env)
    try:
        warm_env = {**env, "RAY_ADDRESS": head.address}
        one("head-warmup", workers[0], run_env=warm_env)
        for n in workers:
            results[f"warm_{n}w"] = one(f"warm-{n}w", n, run_env=warm_env)
            results[f"recovery_{n}w"] = one(f"recovery-{n}w", n, run_env=warm_env, kill=True)
    finally:
        head.stop()
    return {
        "benchmark": "startup",
        "metric": "seconds from `raylm train` to the first step (cold: it starts Ray; warm: a "
                  "running head), from a worker's SIGKILL to the next trained step, and what "
                  "one report costs the step loop; tiny preset, fp32, every step reported",
        "steps": steps, "kill_after": kill_after, "workers": workers, "tracking": tracking,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "runs": results,
        "summary": {name: {k: r.get(k) for k in ("first_step_s", "recovery_s",
                                                  "report_cost_s", "last_step_s", "exit_s")}
                    | {"goodput": r["goodput"]["goodput"]} for name, r in results.items()},
    }

