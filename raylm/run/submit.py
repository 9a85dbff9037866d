"""Run raylm on a remote Ray cluster through its job server: ``raylm submit`` and ``raylm jobs``.

A thin layer over Ray's ``JobSubmissionClient`` (the same API as ``ray job submit``), which
already handles uploads, authentication (the cluster's token, from ``RAY_AUTH_TOKEN`` or this
user's ``~/.ray/auth_token``) and log streaming. What raylm adds:

- the config is resolved and validated here, before anything is sent, and shipped as one YAML
  file in the job's working directory (``raylm_job.yaml``), so the cluster runs exactly the
  config that ``raylm config show`` prints on the laptop;
- the local ``raylm`` package travels with the job (``py_modules``), so the cluster runs the
  submitter's code on the image's dependencies;
- the job is named after the run (``raylm-<run.name>-<time>``) and tagged with its run name;
- a GRPO run's reward code goes with it (:func:`ship_reward`).

The job server listens on the head's dashboard port (8265). Reach a remote head through an
SSH tunnel (``ray dashboard cluster/aws.yaml`` forwards it to 127.0.0.1:8265) or an
authenticated proxy; never open that port to the internet: anyone who reaches it runs code
on the cluster.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from raylm import storage
from raylm.config import Config
from raylm.contracts import JOB_CONFIG

COMMANDS = ("train", "tune")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def in_clear(address: str) -> str | None:
    """What is wrong with sending a job to ``address``, if it is plain HTTP to another
    machine: the cluster's token and the job's files and environment cross the network
    unencrypted."""
    if not address.startswith("http://") or loopback(address):
        return None
    return (f"{storage.redact(address)} is plain HTTP to another machine: the cluster's token "
            f"and the job's files travel unencrypted; forward the port over SSH (ray dashboard "
            f"CLUSTER.yaml, kubectl port-forward) and use http://127.0.0.1:8265, or put the job "
            f"server behind HTTPS")


def loopback(address: str) -> bool:
    """Whether an HTTP address names this machine (a forwarded port)."""
    import ipaddress
    from urllib.parse import urlparse

    host = urlparse(address).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def client(address: str | None):
    """A job client for ``address`` (``http://HEAD:8265``); unset: ``RAY_API_SERVER_ADDRESS``
    or ``RAY_ADDRESS``, as for ``ray job submit``."""
    from ray.job_submission import JobSubmissionClient

    address = address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get(
        "RAY_ADDRESS")
    if not address:
        raise ValueError("No cluster address: pass --address http://HEAD:8265 (for a remote "
                         "head, first run `ray dashboard CLUSTER.yaml` to forward its port to "
                         "127.0.0.1:8265) or set RAY_API_SERVER_ADDRESS.")
    if not address.startswith(("http://", "https://")):
        raise ValueError(f"--address {address!r}: the job server is reached over HTTP, e.g. "
                         f"http://127.0.0.1:8265 (the dashboard port), not the GCS address.")
    if in_clear(address):
        print(f"raylm: warning: {in_clear(address)}", flush=True)
    from ray.exceptions import AuthenticationError

    try:
        return JobSubmissionClient(address)
    except AuthenticationError:
        raise ValueError(
            f"The Ray cluster at {address} requires its authentication token: export "
            f"RAY_AUTH_MODE=token and either RAY_AUTH_TOKEN=<token> or the token in "
            f"~/.ray/auth_token (`ray get-auth-token` prints it on the head node).") from None
    except ConnectionError as e:
        raise ValueError(f"Cannot reach a Ray job server at {address}: {e}") from None


def parse_env(pairs: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings to a dict; a clear error for anything else."""
    out = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise ValueError(f"--env {p!r}: expected KEY=VALUE, e.g. --env "
                             f"MLFLOW_TRACKING_URI=http://10.0.0.5:5000")
        out[key] = value
    return out


def build_runtime_env(staging: str | os.PathLike, *, env: dict[str, str],
                      pip: Sequence[str] = (), image: str | None = None,
                      ship_code: bool = True) -> dict[str, Any]:
    """The job's runtime_env: the staging directory (holding the config) as working dir,
    the local raylm package, extra pip packages or a container image, and env vars."""
    renv: dict[str, Any] = {"working_dir": str(staging)}
    if ship_code:
        renv["py_modules"] = [str(Path(__file__).parents[1])]  # the raylm package
    if pip:
        renv["pip"] = list(pip)
    if image:
        renv["image_uri"] = image
    if env:
        renv["env_vars"] = dict(env)
    return renv


def ship_reward(cfg: Config, staging: Path) -> Config:
    """``rl.reward``'s own code into the job's working directory (``staging``): a file named
    by its path, or a module of this directory (a file or a package); the config then names
    it as a module of that directory, which Ray puts on the job's processes' PYTHONPATH. A
    module installed as a package is the cluster's image's to have, and a built-in raylm's."""
    module, _, fn = (cfg.rl.reward or "").rpartition(":")
    if not module:
        return cfg
    if module.endswith(".py"):
        src, name = Path(module), Path(module).stem
    else:
        top = Path.cwd() / module.split(".")[0]
        src = (top.with_suffix(".py") if top.with_suffix(".py").is_file() else
               top if (top / "__init__.py").is_file() else None)
        name = module
    if src is None:
        return cfg
    if src.is_dir():
        shutil.copytree(src, staging / src.name, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        shutil.copy(src, staging / src.name)
    return dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, reward=f"{name}:{fn}"))


def submit(cfg: Config, *, address: str | None, command: str = "train",
           env: dict[str, str] | None = None, pip: Sequence[str] = (),
           image: str | None = None, ship_code: bool = True, wait: bool = True,
           out: Callable[[str], None] = print) -> tuple[str, str | None]:
    """Submit ``raylm COMMAND`` with ``cfg``; follow its logs to the end when ``wait``.

    Returns (submission id, final status or None when not waiting)."""
    if command not in COMMANDS:
        raise ValueError(f"--command {command!r}: choose one of {', '.join(COMMANDS)}.")
    sp = cfg.run.storage_path
    if not storage.is_uri(sp) and not sp.startswith(("/", "~")):
        # Relative to the job's working directory, a temporary copy deleted with the job.
        raise ValueError(f"run.storage_path={sp!r} is relative: a submitted job would leave its "
                         f"checkpoints and summary in its temporary working directory. Use an "
                         f"absolute path on the cluster (a shared mount for several nodes) or "
                         f"object storage, e.g. --run.storage_path=s3://BUCKET/runs.")
    jobs = client(address)
    if not cfg.run.verbose:
        # The client's INFO lines (each package uploaded, the log stream's socket closed)
        # say nothing the lines around them do not.
        for name in ("ray.dashboard.modules.dashboard_sdk", "ray.dashboard.modules.job.sdk",
                     "ray._private.runtime_env.packaging"):
            logging.getLogger(name).setLevel(logging.WARNING)
    staging = Path(tempfile.mkdtemp(prefix="raylm-submit-"))
    try:
        cfg = ship_reward(cfg, staging)
        (staging / JOB_CONFIG).write_text(cfg.to_yaml())
        submission_id = f"raylm-{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        job = jobs.submit_job(
            entrypoint=f"python -m raylm {command} --config {JOB_CONFIG}",
            submission_id=submission_id,
            runtime_env=build_runtime_env(staging, env=env or {}, pip=pip, image=image,
                                          ship_code=ship_code),
            metadata={"raylm.run_name": cfg.run.name, "raylm.command": command},
        )
    finally:
        # The client has uploaded the directory by the time submit_job returns.
        shutil.rmtree(staging, ignore_errors=True)
    out(f"raylm: submitted {job} (raylm {command}, run {cfg.run.name!r})")
    if not wait:
        out(f"raylm: follow it with: raylm jobs logs {job} --follow --address "
            f"{jobs.get_address()}")
        return job, None
    status = follow(jobs, job, out=out)
    return job, status


def follow(jobs, job: str, *, out: Callable[[str], None] = print) -> str:
    """Stream a job's logs until it ends; return its final status."""

    async def tail() -> None:
        async for chunk in jobs.tail_job_logs(job):
            out(chunk.rstrip("\n"))

    try:
        asyncio.run(tail())
    except KeyboardInterrupt:
        out(f"raylm: stopped following; {job} keeps running (raylm jobs stop {job} ends it)")
        raise
    status = wait_terminal(jobs, job)
    info = jobs.get_job_info(job)
    out(f"raylm: {job} {status}" + (f": {info.message}" if info.message else ""))
    return status


def wait_terminal(jobs, job: str, *, timeout_s: float = 60.0) -> str:
    """The job's status once it is terminal (log streaming can end a moment before)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = str(jobs.get_job_status(job).value)
        if status in TERMINAL or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def list_rows(jobs) -> list[dict[str, Any]]:
    """Every job the cluster knows, newest first, as table rows."""
    rows = []
    for j in jobs.list_jobs():
        start = j.start_time / 1000 if j.start_time else None
        end = j.end_time / 1000 if j.end_time else None
        rows.append({
            "id": j.submission_id or j.job_id,
            "status": str(j.status.value),
            "run": (j.metadata or {}).get("raylm.run_name", ""),
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(start)) if start
            else "",
            "duration_s": round((end or time.time()) - start) if start else None,
            "entrypoint": j.entrypoint,
        })
    return sorted(rows, key=lambda r: r["started"], reverse=True)


def table(rows: list[dict[str, Any]]) -> str:
    cols = ["id", "status", "run", "started", "duration_s", "entrypoint"]
    cells = [[str(r[c] if r[c] is not None else "") for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*cols)] + [fmt.format(*row) for row in cells])


def stop(jobs, job: str, *, timeout_s: float = 60.0) -> str:
    """Ask the job to stop and wait until it has; return its final status."""
    jobs.stop_job(job)
    return wait_terminal(jobs, job, timeout_s=timeout_s)
