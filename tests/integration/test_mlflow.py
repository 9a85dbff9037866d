"""Runs recorded on a real `mlflow server` (SQLite backend, artifacts served by the server) on
loopback, read back through MLflow's client as a notebook would; and a server that dies while
a run trains."""

from __future__ import annotations

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
from tests.conftest import tiny_run
from tests.integration import faults

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("mlflow")
    return [*tiny_run(root, tokenizer_dir, docs=200), "--train.global_batch_size=4",
            "--train.micro_batch_size=2", "--scaling.num_workers=1", "--train.log_every=2",
            "--train.eval_every=4", "--train.eval_batches=1", "--checkpoint.every=4",
            "--optim.warmup_steps=2"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`mlflow server` on a free loopback port, one for the module (it takes 10-15 s to start
    here; the test that kills it runs last): its URI, and a function that kills it (the CLI
    and the web server processes it starts, one process group). Its log is shown should it
    fail to start."""
    tmp_path = tmp_path_factory.mktemp("mlflow-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path}/server.db",
         "--artifacts-destination", str(tmp_path / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
    from raylm.run import record

    uri, kill = server
    lines: list[str] = []
    run_dir = Path(next(a for a in base if a.startswith("--run.storage_path=")).split("=", 1)[1])
    out = faults.run_and_interfere(
        lambda: train(load_config(None, [*base, "--run.name=orphaned", "--train.steps=60",
                                          f"--tracking.uri={uri}", "--tracking.log_model=true"]),
                      log=lines.append),
        run_dir / "orphaned", acts=[(4, kill)])
    assert out["status"] == "finished" and out["final_step"] == 60
    assert out["samples"]["trained"] == 60 * 4 and out["samples"]["in_order"]
    lost = [e for e in record.read(str(run_dir / "orphaned")) if e["event"] == "tracking_lost"]
    # The controller hears of reports at its polls, so the first one it failed to log may
    # be older than the checkpoint that the server outlived.
    assert len(lost) == 1 and lost[0]["step"] < 60, lost
    assert out["tracking_lost"] == {"step": lost[0]["step"], "error": lost[0]["error"]}
    assert "mlflow_model_uri" not in out
    # The driver said nothing more about it, in its log or its own prints (the tracker's
    # warnings): the controller's record had said it.
    assert not [m for m in lines if "MLflow" in m and "warning" in m], lines
    assert "MLflow could not" not in capsys.readouterr().out
