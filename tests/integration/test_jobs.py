"""Jobs on a real Ray head started with `ray start --head` on 127.0.0.1, reached through its
job server as a remote cluster would be: `raylm submit`, plain `ray job submit` of
jobs/pretrain.py, `raylm jobs list|status|logs|stop`. Token authentication stays on, with a
token of the test's own (never the user's ~/.ray/auth_token)."""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import tiny_run
from tests.integration.heads import stop_own_head, wait_for_job_server
from tests.ranks import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TINY = "jobs/configs/cpu_tiny.yaml"


@pytest.fixture(scope="module")
def head(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("jobs")
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "PATH": f"{BIN}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    gcs, dashboard = free_port(), free_port()
    # A session directory of its own (short: Ray's socket paths must fit 107 characters) and
    # `ray start --block` in a process group of its own: at the end exactly this head's
    # processes are stopped, never another Ray cluster on the machine (`ray stop` stops all).
    temp = tempfile.mkdtemp(prefix="rayjobs-")
    started = subprocess.Popen(
        [BIN / "ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
         f"--temp-dir={temp}", "--disable-usage-stats"],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"http://127.0.0.1:{dashboard}"
    wait_for_job_server(address, started)
    # The job settings every run here shares: the tiny config with the tests' small corpus and
    # tokenizer (the builtin corpus and a BPE trained on it take ~15 s to prepare here;
    # notebook 01 prepares those), in this test's own directories, a few steps. Prepared data
    # is cached in cache_dir, so only the first job prepares.
    overrides = [*tiny_run(root, tokenizer_dir), "--train.steps=10", "--train.log_every=5",
                 "--train.eval_every=10", "--checkpoint.every=10"]
    yield {"address": address, "gcs": f"127.0.0.1:{gcs}", "env": env,
           "root": root, "overrides": overrides}
    stop_own_head(started, temp)


def run(head, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], env=head["env"], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)


def raylm(head, *args, timeout=300) -> subprocess.CompletedProcess:
    return run(head, BIN / "raylm", *args, timeout=timeout)


def summary(head, name: str) -> dict:
    return json.loads((head["root"] / "runs" / name / "summary.json").read_text())


def test_raylm_submit_runs_the_job_and_follows_it(head):
    """Two workers with the default CPU share on a head with the machine's own CPU count (Ray
    detects it; nothing over-declared): on a 2-core machine they hold every CPU, and their data
    readers must still run."""
    db = head["root"] / "mlflow.db"
    p = raylm(head, "submit", "--address", head["address"], "--config", TINY,
              "--run.name=via-raylm", *head["overrides"], "--scaling.num_workers=2",
              "--env", f"MLFLOW_TRACKING_URI=sqlite:///{db}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    job = p.stdout.split("raylm: submitted ", 1)[1].split()[0]
    assert job.startswith("raylm-via-raylm-")
    # The logs were followed to the end: the run's own last lines, then the job's status.
    assert "raylm: done: step 10" in p.stdout
    assert f"raylm: {job} SUCCEEDED" in p.stdout
    # raylm's line per report, without Ray's and MLflow's own detail (run.verbose shows it).
    assert "step 5/10  loss" in p.stdout
    for detail in ("Reporting training result", "Execution plan of Dataset",
                   "Started training worker group", "Progress bars disabled", " INFO mlflow"):
        assert detail not in p.stdout, detail
    for detail in ("Uploading package", "Creating a file package", "WebSocket closed"):
        assert detail not in p.stderr, detail
    assert "raylm: next: raylm generate " in p.stdout

    s = summary(head, "via-raylm")
    assert s["status"] == "finished" and s["final_step"] == 10 and s["workers"] == 2
    assert s["samples"]["skipped"] == 0 and s["samples"]["duplicated"] == 0
    # The env var reached the job: the run was recorded in the store it named.
    assert s["mlflow_tracking_uri"] == f"sqlite:///{db}"
    with sqlite3.connect(db) as con:
        status = con.execute("select status from runs where run_uuid = ?",
                             (s["mlflow_run_id"],)).fetchone()
    assert status == ("FINISHED",)

    listed = raylm(head, "jobs", "list", "--address", head["address"])
    row = next(line for line in listed.stdout.splitlines() if line.startswith(job))
    assert "SUCCEEDED" in row and "via-raylm" in row
    info = json.loads(raylm(head, "jobs", "status", job, "--address", head["address"]).stdout)
    assert info["status"] == "SUCCEEDED"
    assert info["metadata"] == {"raylm.run_name": "via-raylm", "raylm.command": "train"}
    logs = raylm(head, "jobs", "logs", job, "--address", head["address"]).stdout
    assert "raylm: done: step 10" in logs


def test_plain_ray_job_submit_of_the_entrypoint_trains_and_a_stop_frees_the_cluster(head):
    """jobs/pretrain.py submitted with Ray's own CLI, as a user without raylm installed on
    their laptop submits it; stopped through raylm while it trains."""
    p = run(head, BIN / "ray", "job", "submit", "--address", head["address"], "--no-wait",
            "--working-dir", ".", "--", "python", "jobs/pretrain.py", "--config", TINY,
            "--run.name=via-ray", "--tracking.enabled=false", *head["overrides"],
            "--train.steps=100000")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    job = p.stdout.split("Job '", 1)[1].split("'", 1)[0]
    assert f"Job '{job}' submitted successfully" in p.stdout

    # Stop it while it trains, not while it is still starting: raylm's own lines, through
    # raylm's log command.
    deadline = time.monotonic() + 180
    while "step 5/100000" not in raylm(head, "jobs", "logs", job, "--address",
                                       head["address"]).stdout:
        assert time.monotonic() < deadline, "the job never reached step 5"
        time.sleep(2)
    p = raylm(head, "jobs", "stop", job, "--address", head["address"])
    assert p.returncode == 0 and f"raylm: {job} STOPPED" in p.stdout, p.stdout + p.stderr
    run_json = json.loads((head["root"] / "runs" / "via-ray" / "run.json").read_text())
    assert run_json["config"]["train"]["steps"] == 100000

    # The training workers went with the job: every CPU is free again.
    probe = ("import ray, time\n"
             f"ray.init(address={head['gcs']!r}, logging_level='ERROR')\n"
             "total = ray.cluster_resources()['CPU']\n"
             "for _ in range(60):\n"
             "    if ray.available_resources().get('CPU') == total: break\n"
             "    time.sleep(1)\n"
             "print(ray.available_resources().get('CPU'), total)\n")
    free = run(head, sys.executable, "-c", probe)
    have, total = free.stdout.strip().splitlines()[-1].split()
    assert have == total, free.stdout + free.stderr


def test_bad_input_and_a_missing_token_are_refused_in_one_line(head):
    from concurrent.futures import ThreadPoolExecutor

    # Without the token, the message says how to provide it.
    no_token = {k: v for k, v in head["env"].items()
                if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    calls = {
        "no job server": ("submit", "--config", TINY, "--address", "127.0.0.1:6379",
                          *head["overrides"]),
        "bad value": ("submit", "--config", TINY, "--address", head["address"],
                      "--train.steps=0"),
        "relative storage": ("submit", "--config", TINY, "--address", head["address"]),
        "bad env": ("submit", "--config", TINY, "--address", head["address"], "--env", "NOEQ",
                    *head["overrides"]),
        "no such job": ("jobs", "status", "raylm-no-such-job", "--address", head["address"]),
    }
    # Each call is a fresh interpreter that imports raylm and Ray (seconds, mostly waiting on
    # the disk): they run side by side.
    with ThreadPoolExecutor(len(calls) + 3) as pool:
        done = {name: pool.submit(raylm, head, *args) for name, args in calls.items()}
        tokenless = pool.submit(subprocess.run, [BIN / "raylm", "jobs", "list", "--address",
                                                 head["address"]], env=no_token, text=True,
                                capture_output=True, timeout=60)
        # A run joining the head itself (RAY_ADDRESS) without its token, or with another.
        joins = {name: pool.submit(subprocess.run, [
            BIN / "raylm", "train", "--config", TINY, *head["overrides"]],
            env={**env, "RAY_ADDRESS": head["gcs"]}, text=True, capture_output=True,
            timeout=120) for name, env in (("join without token", no_token), (
                "join with another token", {**head["env"], "RAY_AUTH_TOKEN": "0" * 32}))}
        p = {name: f.result() for name, f in (done | joins).items()}
        p["no token"] = tokenless.result()
    assert all(r.returncode == 2 for r in p.values()), {k: r.stderr for k, r in p.items()}
    assert "http://127.0.0.1:8265" in p["no job server"].stderr
    assert "train.steps" in p["bad value"].stderr
    assert "run.storage_path='runs' is relative" in p["relative storage"].stderr
    assert "KEY=VALUE" in p["bad env"].stderr
    assert "job 'raylm-no-such-job'" in p["no such job"].stderr, p["no such job"].stderr
    assert "RAY_AUTH_MODE=token" in p["no token"].stderr, p["no token"].stderr
    # A head refusing the run's token is said at once, in one line naming what to set (not
    # after ray.init's 20 s of retries, each a warning, and a traceback).
    for name, fix in (("join without token", "export RAY_AUTH_MODE=token and give its token"),
                      ("join with another token", "refuses this process's token")):
        err = p[name].stderr
        assert "(RAY_ADDRESS) refuses" in err and fix in err, err
        assert "Traceback" not in err and err.count("InvalidAuthToken") <= 1, err
