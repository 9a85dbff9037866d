"""Runs recorded on a real `mlflow server` started as the cluster files start it (basic auth,
allowed hosts, SQLite backend, artifacts served by the server) on loopback, read back through
MLflow's client as a notebook would; and a server that dies while a run trains."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from raylm.config import load_config
from raylm.run.launch import train
from tests.conftest import names_of_cb5e3f1, names_since_cb5e3f1, tiny_run
from tests.integration import faults
from tests.integration.conftest import MLFLOW_ADMIN, MLFLOW_CREDENTIALS

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("mlflow")
    return [*tiny_run(root, tokenizer_dir, docs=200), "--train.global_batch_size=4",
            "--train.micro_batch_size=2", "--scaling.num_workers=1", "--train.log_every=2",
            "--train.eval_every=4", "--train.eval_batches=1", "--checkpoint.every=4",
            "--optim.warmup_steps=2"]


SERVICE_HOST = "raylm-mlflow:5000"
"""The Host header of requests to the KubeRay Service (cluster/kuberay/raycluster.yaml)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`mlflow server` started as every cluster file starts it (cluster/mlflow.sh: basic auth,
    allowed hosts, one process), on a free loopback port, one for the module (it takes
    10-15 s to start here; the test that kills it runs last): its URI, and a function that
    kills it (the script, the CLI and the web server it starts, one process group). Its log
    is shown should it fail to start."""
    tmp_path = tmp_path_factory.mktemp("mlflow-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "server.log", "w")
    env = {**os.environ, **MLFLOW_CREDENTIALS, **MLFLOW_ADMIN, "MLFLOW_ALLOWED_HOSTS": SERVICE_HOST,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen(
        ["bash", str(ROOT / "cluster" / "mlflow.sh"), "--host", "127.0.0.1",
         "--port", str(port), "--store", f"sqlite:///{tmp_path}/server.db",
         "--artifacts", str(tmp_path / "artifacts")],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"

    def kill(sig=signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        proc.wait(20)

    deadline = time.time() + 90
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.read() == b"OK":
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            kill()
            pytest.fail(f"mlflow server did not start: {(tmp_path / 'server.log').read_text()}")
        time.sleep(0.3)
    yield uri, kill
    kill(signal.SIGTERM)
    log.close()


def answer(uri: str, *, host: str, user: str | None = None, password: str | None = None,
           path: str = "/api/2.0/mlflow/experiments/search?max_results=1") -> int:
    """The HTTP status of a request (an experiment search unless ``path`` says) sent with
    ``host`` as the Host header."""
    request = urllib.request.Request(f"{uri}{path}", headers={"Host": host})
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_cluster_server_answers_its_service_name_with_credentials_only(server, base,
                                                                            monkeypatch):
    uri, _ = server
    user, password = (MLFLOW_CREDENTIALS[k] for k in ("MLFLOW_TRACKING_USERNAME",
                                                      "MLFLOW_TRACKING_PASSWORD"))
    assert answer(uri, host=SERVICE_HOST, user=user, password=password) == 200
    assert answer(uri, host=SERVICE_HOST) == 401
    assert answer(uri, host=SERVICE_HOST, user=user, password="guessed-password") == 401
    # Another name (a rebound DNS name in someone's browser) is refused, credentials or not.
    assert answer(uri, host="attacker.example:5000", user=user, password=password) == 403
    # The runs' account is an ordinary user: it may not even read the admin's account; the
    # admin may.
    admin = (MLFLOW_ADMIN["MLFLOW_AUTH_ADMIN_USERNAME"], MLFLOW_ADMIN["MLFLOW_AUTH_ADMIN_PASSWORD"])
    for (who, secret), status in (((user, password), 403), (admin, 200)):
        assert answer(uri, host=SERVICE_HOST, user=who, password=secret,
                      path=f"/api/2.0/mlflow/users/get?username={admin[0]}") == status
    # raylm refuses a run whose client the server refuses, before anything starts.
    from raylm.run.preflight import preflight

    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    with pytest.raises(ValueError, match="asks for credentials.*MLFLOW_TRACKING_PASSWORD"):
        preflight(load_config(None, [*base, f"--tracking.uri={uri}"]))
    # Nor does it take a name the server does not answer to for an outage.
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    other_name = uri.replace("127.0.0.1", "127.1")  # the same socket by a name not allowed
    with pytest.raises(ValueError, match="refuses the Host header.*allowed-hosts"):
        preflight(load_config(None, [*base, f"--tracking.uri={other_name}"]))


def test_a_run_on_an_mlflow_server_reads_back_through_the_client(base, server, tmp_path,
                                                                  monkeypatch):
    from mlflow import MlflowClient

    uri, _ = server
    lines: list[str] = []
    out = train(load_config(None, [*base, "--run.name=served", "--train.steps=8",
                                   f"--tracking.uri={uri}", "--tracking.experiment=served",
                                   "--tracking.log_model=true",
                                   "--tracking.register_as=tiny-served"]), log=lines.append)
    assert out["status"] == "finished" and out["mlflow_tracking_uri"] == uri
    assert not [m for m in lines if "warning" in m], lines

    client = MlflowClient(uri)
    run = client.get_run(out["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "served"
    assert run.data.params["train.steps"] == "8" and run.data.params["precision"] == "fp32"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [2, 4, 6, 8]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [4, 8]
    assert run.data.tags["raylm.training"] == "pretrain-full"
    assert run.data.tags["raylm.workers"] == "1"
    (dataset,) = [d.dataset for d in run.inputs.dataset_inputs]
    assert json.loads(dataset.profile)["blocks"] > 0
    # The run's files, through the server's artifact proxy.
    summary = json.loads(Path(client.download_artifacts(
        run.info.run_id, "summary.json", str(tmp_path))).read_text())
    assert summary == out
    # The names MLflow, summary.json and the events hold are those of earlier releases.
    assert names_since_cb5e3f1(out, Path(out["checkpoint_path"]).parent) == names_of_cb5e3f1(
        "sft")
    assert {"run.json", "summary.json", "checkpoints.json"} <= {
        a.path for a in client.list_artifacts(run.info.run_id)}
    # The final model: the run's output at its last step, registered as version 1, loadable
    # as a pipeline from the registry.
    (output,) = run.outputs.model_outputs
    assert output.step == 8 and out["mlflow_model_uri"] == f"models:/{output.model_id}"
    version = client.get_model_version("tiny-served", "1")
    assert version.run_id == run.info.run_id
    assert version.tags["raylm.model_id"] == output.model_id
    assert out["registered_model"] == "tiny-served" and out["registered_version"] == 1

    import mlflow.transformers

    # As a user points MLflow at the server (mlflow.set_tracking_uri would also set this
    # variable, for the rest of the test session).
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    pipe = mlflow.transformers.load_model("models:/tiny-served/1")
    assert pipe("The river", max_new_tokens=4, do_sample=False)[0]["generated_text"]


def test_training_outlives_its_mlflow_server(base, server, capsys):
    """The server is stopped after the step-4 checkpoint: the run trains to the end, records
    that tracking was lost once (step and cause), and logs nothing more."""
    from raylm.contracts.events import TrackingLost
    from raylm.run import record

    uri, kill = server
    lines: list[str] = []
    run_dir = Path(next(a for a in base if a.startswith("--run.storage_path=")).split("=", 1)[1])
    out = faults.run_and_interfere(
        lambda: train(load_config(None, [*base, "--run.name=orphaned", "--train.steps=30",
                                          f"--tracking.uri={uri}", "--tracking.log_model=true"]),
                      log=lines.append),
        run_dir / "orphaned", acts=[(4, kill)])
    assert out["status"] == "finished" and out["final_step"] == 30
    assert out["samples"]["trained"] == 30 * 4 and out["samples"]["in_order"]
    lost = [e for e in record.read(str(run_dir / "orphaned")) if isinstance(e, TrackingLost)]
    # The controller hears of reports at its polls, so the first one it failed to log may
    # be older than the checkpoint that the server outlived.
    assert len(lost) == 1 and lost[0].step < 30, lost
    assert out["tracking_lost"] == {"step": lost[0].step, "error": lost[0].error}
    assert "mlflow_model_uri" not in out
    # The driver said nothing more about it, in its log or its own prints (the tracker's
    # warnings): the controller's record had said it.
    assert not [m for m in lines if "MLflow" in m and "warning" in m], lines
    assert "MLflow could not" not in capsys.readouterr().out
