"""`raylm train` end to end on a local Ray cluster: tiny model, 2 workers, CPU, fp32."""

from __future__ import annotations

import json

import pytest

from raylm.config import load_config
from raylm.launch import train
from tests.conftest import make_docs, write_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("train")
    write_jsonl(root / "corpus.jsonl", make_docs(400))
    return [f"--data.source={root / 'corpus.jsonl'}", f"--tokenizer.path={tokenizer_dir}",
            "--data.seq_len=32", "--data.val_fraction=0.1", f"--run.cache_dir={root}/cache",
            f"--run.storage_path={root}/runs", "--model.preset=tiny", "--train.precision=fp32",
            "--train.global_batch_size=8", "--train.micro_batch_size=2",
            "--scaling.num_workers=2", "--optim.schedule=constant", "--optim.warmup_steps=5",
            "--optim.lr=3e-3", "--train.log_every=5", "--train.eval_every=10",
            "--train.eval_batches=2"]


def train_run(base, *extra):
    return train(load_config(None, [*base, *extra]), log=lambda m: None)


@pytest.fixture(scope="module")
def trained(base):
    """An uninterrupted 30-step run, and one stopped at 20 then resumed to 30."""
    full = train_run(base, "--run.name=full", "--train.steps=30", "--checkpoint.every=10")
    first = train_run(base, "--run.name=split", "--train.steps=20", "--checkpoint.every=10")
    resumed = train_run(base, "--run.name=split", "--train.steps=30", "--checkpoint.every=10")
    return full, first, resumed


def test_train_resume_equals_uninterrupted(base, trained):
    full, first, resumed = trained
    assert full["final_step"] == 30 and full["resumed_from_step"] is None
    assert full["restarts"] == 0 and full["attention_backend"] == "sdpa-flash-cpu"
    assert full["precision"] == "fp32" and full["mfu"] is None  # no known peak on a CPU
    assert full["checkpoint_path"] and full["val_loss"] < 5.6  # from ln(320) = 5.77

    assert first["final_step"] == 20
    assert resumed["resumed_from_step"] == 20 and resumed["final_step"] == 30
    # fp32 on CPU: the resumed run ends where the uninterrupted one does.
    assert resumed["train_loss"] == pytest.approx(full["train_loss"], abs=1e-5)
    assert resumed["val_loss"] == pytest.approx(full["val_loss"], abs=1e-5)
    summary = json.loads((base_dir(base) / "split" / "summary.json").read_text())
    assert summary == resumed

    # One MLflow run per raylm run, reused on resume, in the local store under storage_path.
    from mlflow import MlflowClient

    assert resumed["mlflow_run_id"] == first["mlflow_run_id"] != full["mlflow_run_id"]
    assert resumed["mlflow_tracking_uri"] == f"sqlite:///{base_dir(base)}/mlflow.db"
    client = MlflowClient(resumed["mlflow_tracking_uri"])
    mrun = client.get_run(resumed["mlflow_run_id"])
    assert mrun.info.status == "FINISHED" and mrun.info.run_name == "split"
    assert mrun.data.params["model.preset"] == "tiny"
    assert mrun.data.params["attention_backend"] == "sdpa-flash-cpu"
    losses = client.get_metric_history(mrun.info.run_id, "loss")
    assert [m.step for m in losses] == [5, 10, 15, 20, 25, 30]
    assert losses[-1].value == pytest.approx(resumed["train_loss"])
    assert [m.step for m in client.get_metric_history(mrun.info.run_id, "val_loss")] == [
        10, 20, 30]
    assert mrun.data.tags["raylm.checkpoint_latest"] == resumed["checkpoint_path"]
    listed = client.download_artifacts(mrun.info.run_id, "checkpoints.json")
    assert [c["step"] for c in json.loads(open(listed).read())["checkpoints"]] == [30]
    system = [k for k in mrun.data.metrics if k.startswith("system/")]
    assert any("cpu_utilization" in k for k in system), system
    runs = client.search_runs([mrun.info.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["full", "split"]
    assert set(summary) == {
        "final_step", "train_loss", "val_loss", "tokens_per_s", "mfu", "data_wait_fraction",
        "wall_s", "checkpoint_path", "mlflow_run_id", "mlflow_tracking_uri",
        "resumed_from_step", "restarts", "attention_backend", "precision"}


def base_dir(base):
    from pathlib import Path

    return Path(next(a for a in base if a.startswith("--run.storage_path=")).split("=", 1)[1])


def test_export_loads_with_from_pretrained_and_generates(base, trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raylm.cli import main
    from raylm.export import generate, load_run_model

    run_dir = base_dir(base) / "full"
    assert main(["export", str(run_dir), "--output", str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ours, _, step = load_run_model(run_dir)
    assert step == 30
    ids = tok("The river carried the boats", return_tensors="pt")["input_ids"]
    import torch

    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ours(ids).logits)
    text = generate(tmp_path / "hf", "The river", max_new_tokens=12, temperature=0)
    assert text == generate(run_dir, "The river", max_new_tokens=12, temperature=0)
    assert len(tok(text, add_special_tokens=False)["input_ids"]) >= 1


def test_continue_from_exported_model_without_cross_document_attention(base, trained,
                                                                       tmp_path):
    from raylm.cli import main

    hf = tmp_path / "hf"
    assert main(["export", str(base_dir(base) / "full"), "--output", str(hf)]) == 0
    full = trained[0]
    # The pretrained weights are read on rank 0 and scattered to the 2 FSDP workers; the run
    # starts where the exported one ended, not from a random model (ln 320 = 5.77).
    out = train_run(base, "--run.name=finetune", f"--model.path={hf}",
                    f"--tokenizer.path={hf}", "--train.steps=5", "--optim.lr=1e-4",
                    "--optim.warmup_steps=1", "--train.eval_every=5",
                    "--data.cross_document_attention=false")
    assert out["final_step"] == 5 and out["attention_backend"] == "sdpa-flash-cpu"
    assert out["val_loss"] < full["val_loss"] + 0.3 < 5.77


def test_unreachable_mlflow_does_not_stop_training(base):
    out = train_run(base, "--run.name=nomlflow", "--train.steps=5", "--scaling.num_workers=1",
              "--tracking.uri=http://127.0.0.1:9")
    assert out["final_step"] == 5 and out["mlflow_run_id"] is None


def test_bad_requests_fail_before_workers_start(base):
    with pytest.raises(ValueError, match="does not divide by train.micro_batch_size=2 x 2 "
                                         "workers"):
        train_run(base, "--run.name=bad1", "--train.global_batch_size=6")
    with pytest.raises(ValueError, match="needs 8 CPUs but the cluster has 4"):
        train_run(base, "--run.name=bad2", "--scaling.num_workers=8",
            "--train.global_batch_size=16")
    with pytest.raises(ValueError, match="data.seq_len=2048 is above the model's 1024"):
        train_run(base, "--run.name=bad3", "--data.seq_len=2048")
    with pytest.raises(ValueError, match="the validation split has 0 blocks, fewer than the 2"):
        train_run(base, "--run.name=bad4", "--data.val_fraction=0.0")
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        train_run(base, "--run.name=bad5", "--model.preset=huge")
