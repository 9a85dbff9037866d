"""`raylm train` end to end on a local Ray cluster: tiny model, 2 workers, CPU, fp32."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

import raylm
from raylm import rundir
from raylm.config import load_config, parse_override
from raylm.contracts.events import Progress
from raylm.run.goodput import CAUSES
from raylm.run.launch import train
from raylm.run.record import read
from tests.conftest import tiny_run
from tests.integration import faults

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("train")
    return [*tiny_run(root, tokenizer_dir), "--train.global_batch_size=8",
            "--train.micro_batch_size=2",
            "--scaling.num_workers=2", "--optim.schedule=constant", "--optim.warmup_steps=5",
            "--optim.lr=3e-3", "--train.log_every=5", "--train.eval_every=10",
            "--train.eval_batches=2"]


def train_run(base, *extra):
    return train(load_config(None, [*base, *extra]), log=lambda m: None)


def bucket(base) -> str:
    """A run.storage_path in object storage: a file:// URI takes pyarrow's filesystem path,
    the one s3:// and gs:// take."""
    return f"file://{base_dir(base).parent}/bucket/runs"


trained_bar: list[str] = []  # what the full run's progress bar drew


@contextlib.contextmanager
def scraping(into: dict[tuple, list]):
    """Scrape the node's Ray metrics endpoint every 2 s (the test cluster's export interval;
    an exported value stays twice that), as Prometheus does, while the block runs: each raylm
    series (name and labels) with the values it took, in order."""
    import threading
    import urllib.request

    import ray
    from prometheus_client.parser import text_string_to_metric_families

    (node,) = [n for n in ray.nodes() if n["Alive"]]
    url = f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(2.0):
            try:
                text = urllib.request.urlopen(url, timeout=10).read().decode()
            except OSError:  # as Prometheus does: a failed scrape is a gap, not an end
                continue
            # Ray's own series are most of the page: parse raylm's lines only (with their
            # HELP and TYPE lines), which is what a Prometheus query for them reads.
            text = "\n".join(line for line in text.splitlines() if "raylm_" in line) + "\n"
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name.startswith("ray_raylm_"):
                        seen = into.setdefault((s.name, tuple(sorted(s.labels.items()))), [])
                        if not seen or seen[-1] != s.value:
                            seen.append(s.value)

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def full_overrides(base) -> dict:
    return {**dict(parse_override(a) for a in base), "run.name": "full", "train.steps": 30,
            "checkpoint.every": 10, "run.progress": "bar"}


@pytest.fixture(scope="module")
def trained(base):
    """An uninterrupted 30-step run, through the Python API (overrides as a mapping) with the
    progress bar a notebook or a terminal gets."""
    bar = io.StringIO()
    with contextlib.redirect_stderr(bar):
        full = raylm.train(None, overrides=full_overrides(base)).summary
    trained_bar.append(bar.getvalue())
    return full


@pytest.fixture(scope="module")
def relaid(base, trained):
    """The same 30 steps in two invocations on two layouts, its run directory in object
    storage and its MLflow run in the first run's default store: 10 steps on 4 half-CPU
    workers at (dp 2, cp 2), each sequence split over two of them; the newest checkpoint then
    cut short, as a save killed half-way
    leaves it; on to 30 on 2 workers at (pp 2), which goes back to the step-5 checkpoint and
    logs the final model. It evaluates twice as many blocks per data-parallel rank there, so
    that its one rank evaluates the blocks the 2 ranks of the other runs did. Returns both
    summaries and what the second invocation said."""
    from raylm import storage

    run = [f"--run.storage_path={bucket(base)}", "--run.name=layouts", "--checkpoint.every=5",
           "--scaling.num_workers=4", "--scaling.cpus_per_worker=0.5",
           f"--tracking.uri={trained['mlflow_tracking_uri']}"]
    first = train_run(base, *run, "--train.steps=10", "--parallel.context=2")
    newest, marker = rundir.latest_verified(f"{bucket(base)}/layouts")
    assert marker.step == 10 and marker.world_size == 4
    shard = max((storage.join(newest, f) for f in storage.list_files(newest)
                 if f.endswith(".distcp")), key=storage.size)
    storage.write_bytes(shard, storage.read_bytes(shard)[: storage.size(shard) // 2])
    logs: list[str] = []
    resumed = train(load_config(None, [*base, *run, "--train.steps=30", "--parallel.pipeline=2",
                                       "--scaling.num_workers=2", "--scaling.cpus_per_worker=1",
                                       "--train.eval_batches=4", "--tracking.log_model=true"]),
                    log=logs.append)
    return first, resumed, logs


def test_an_uninterrupted_run_summarizes_itself(trained):
    full = trained
    assert full["final_step"] == 30 and full["resumed_from_step"] is None
    assert full["restarts"] == 0 and full["attention_backend"] == "sdpa-flash-cpu"
    assert full["precision"] == "fp32" and full["mfu"] is None  # no known peak on a CPU
    assert full["checkpoint_path"] and full["val_loss"] < 5.6  # from ln(320) = 5.77
    assert full["status"] == "finished" and full["wall_s"] > 0


def test_a_run_in_two_invocations_keeps_one_summary(base, relaid):
    """What a run stopped and started again on another layout keeps in object storage: one
    summary, written by its record, whose samples are exactly those of 30 steps."""
    from raylm import storage
    from raylm.formats.exporter import load_run_model

    first, resumed, _ = relaid
    uri = bucket(base)
    assert first["final_step"] == 10
    assert first["checkpoint_path"].startswith(f"{uri}/layouts/checkpoint_")
    assert resumed["resumed_from_step"] == 5 and resumed["final_step"] == 30
    summary = json.loads(storage.read_text(f"{uri}/layouts/summary.json"))
    assert summary == resumed
    # The pipeline stages' checkpoint loads into one whole model.
    run_model, tokenizer_dir, step = load_run_model(f"{uri}/layouts")
    assert step == 30 and (tokenizer_dir / "tokenizer.json").is_file()
    assert set(summary) == {
        "status", "invocation", "final_step", "train_loss", "val_loss", "tokens_per_s", "mfu",
        "data_wait_fraction", "wall_s", "checkpoint_path", "mlflow_run_id",
        "mlflow_tracking_uri", "mlflow_model_uri", "tracking_lost", "resumed_from_step",
        "workers", "restarts", "resizes", "failures", "interruptions", "samples",
        "attention_backend", "precision", "changed_on_resume", "device",
        "trainable_params", "peak_memory_gb", "param_memory_gb", "optimizer_memory_gb",
        "data_parallel", "tensor_parallel", "pipeline_parallel",
        "joules_per_token", "watts_per_gpu",
        "energy_kwh", "gpu_hours", "cost", "goodput", "numerical_faults", "benchmarks"}
    # The goodput ledger spans both invocations (not the time between them); steps 6-10, which
    # the first reported and the second trained again from step 5, were recomputed.
    assert summary["goodput"]["total_s"] == pytest.approx(first["wall_s"] + resumed["wall_s"],
                                                          abs=1.0)
    assert summary["goodput"]["recomputed_steps"] == 5 and summary["numerical_faults"] == []
    # Nothing measures energy on a CPU: no figure, rather than a zero.
    assert [summary[k] for k in ("joules_per_token", "energy_kwh", "gpu_hours", "cost")] == [
        None] * 4
    # 30 steps x 8 sequences, in the seed's order, over two invocations (steps 6-10 were
    # trained twice; the second time counts).
    assert_exact_samples(summary, 30)


def test_mlflow_keeps_one_run_and_one_history_across_invocations(base, trained, relaid):
    from mlflow import MlflowClient

    full = trained
    first, resumed, _ = relaid
    # One MLflow run per raylm run, reused on resume; the default store is under storage_path.
    assert full["mlflow_tracking_uri"] == f"sqlite:///{base_dir(base)}/mlflow.db"
    assert resumed["mlflow_run_id"] == first["mlflow_run_id"] != full["mlflow_run_id"]
    client = MlflowClient(resumed["mlflow_tracking_uri"])
    mrun = client.get_run(resumed["mlflow_run_id"])
    assert mrun.info.status == "FINISHED" and mrun.info.run_name == "layouts"
    assert mrun.data.params["model.preset"] == "tiny"
    # The kernel the run started with (a param), and the one its last invocation ran (a tag).
    assert mrun.data.params["attention_backend"] == "all-to-all+sdpa-flash-cpu"
    assert mrun.data.tags["raylm.attention_backend"] == "sdpa-flash-cpu"
    # Step 10 was trained in both invocations (the second went back to step 5): MLflow keeps
    # both reports of it, the run's history the last.
    losses = client.get_metric_history(mrun.info.run_id, "loss")
    assert [m.step for m in losses] == [5, 10, 10, 15, 20, 25, 30]
    assert losses[-1].value == pytest.approx(resumed["train_loss"])
    assert [m.step for m in client.get_metric_history(mrun.info.run_id, "val_loss")] == [
        10, 10, 20, 30]
    assert mrun.data.tags["raylm.checkpoint_latest"] == resumed["checkpoint_path"]
    listed = client.download_artifacts(mrun.info.run_id, "checkpoints.json")
    # The checkpoints Ray Train keeps (checkpoint.keep=3, every 5 steps), the newest last.
    checkpoints = json.loads(open(listed).read())["checkpoints"]
    assert [c["step"] for c in checkpoints] == [20, 25, 30]
    assert checkpoints[-1] == {"step": 30, "path": resumed["checkpoint_path"]}
    system = [k for k in mrun.data.metrics if k.startswith("system/")]
    assert any("cpu_utilization" in k for k in system), system


def test_mlflow_runs_are_found_by_tags_and_hold_their_dataset_and_files(base, relaid):
    """What a notebook filters and compares runs by: tags, the dataset input, the run's
    files."""
    from mlflow import MlflowClient

    from raylm import storage

    _, resumed, _ = relaid
    client = MlflowClient(resumed["mlflow_tracking_uri"])
    mrun = client.get_run(resumed["mlflow_run_id"])
    runs = client.search_runs([mrun.info.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["full", "layouts"]
    assert {k: mrun.data.tags[k] for k in ("raylm.model", "raylm.training", "raylm.workers",
                                           "raylm.data_format")} == {
        "raylm.model": "preset:tiny", "raylm.training": "pretrain-full", "raylm.workers": "2",
        "raylm.data_format": "text"}
    assert [r.info.run_name for r in client.search_runs(
        [mrun.info.experiment_id], "tags.`raylm.training` = 'pretrain-full'")] != []
    (dataset,) = [d.dataset for d in mrun.inputs.dataset_inputs]
    uri = bucket(base)
    info = json.loads(storage.read_text(f"{uri}/layouts/run.json"))
    manifest = json.loads((Path(info["prepared"]) / "manifest.json").read_text())
    assert dataset.digest == manifest["fingerprint"][:36]
    assert json.loads(dataset.profile)["blocks"] == manifest["blocks"]
    logged = json.loads(Path(client.download_artifacts(mrun.info.run_id, "summary.json"))
                        .read_text())
    assert logged == resumed
    assert "run.json" in {a.path for a in client.list_artifacts(mrun.info.run_id)}


def test_the_final_model_is_logged_in_the_transformers_flavor(base, relaid):
    """The final model, in MLflow's transformers flavor: the pipeline it loads holds the run's
    final weights."""
    import mlflow.transformers
    import torch
    from mlflow import MlflowClient

    from raylm.formats.exporter import load_run_model

    _, resumed, _ = relaid
    client = MlflowClient(resumed["mlflow_tracking_uri"])
    mrun = client.get_run(resumed["mlflow_run_id"])
    outputs = sorted((o.step, o.model_id) for o in mrun.outputs.model_outputs)
    assert [s for s, _ in outputs] == [30]
    assert resumed["mlflow_model_uri"] == f"models:/{outputs[-1][1]}"
    logged_model = client.get_logged_model(outputs[-1][1])
    assert logged_model.model_type == "transformers"
    pipe = mlflow.transformers.load_model(logged_model.artifact_location)
    run_model, _, _ = load_run_model(f"{bucket(base)}/layouts")
    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(pipe.model(input_ids=ids).logits,
                                   run_model(input_ids=ids).logits, atol=0, rtol=0)

    # A command killed after the record's end and before that logging leaves the MLflow run
    # RUNNING and summary.json without the model (as here); running the run again logs the
    # model and ends the MLflow run, and trains nothing.
    from raylm import storage

    rd = f"{bucket(base)}/layouts"
    written = json.loads(storage.read_text(f"{rd}/summary.json"))
    storage.write_text(f"{rd}/summary.json", json.dumps(
        {k: v for k, v in written.items() if k != "mlflow_model_uri"}))
    client.update_run(mrun.info.run_id, status="RUNNING")
    said: list[str] = []
    again = train(raylm.Run(rd).config, log=said.append)
    assert any("final model never reached MLflow" in line for line in said), said
    assert client.get_run(mrun.info.run_id).info.status == "FINISHED"
    models = client.get_run(mrun.info.run_id).outputs.model_outputs
    assert [o.step for o in models] == [30, 30]
    assert again["mlflow_model_uri"] not in (None, resumed["mlflow_model_uri"])
    assert again["final_step"] == 30 and again["checkpoint_path"] == resumed["checkpoint_path"]


def test_the_python_api_reads_the_run_back(base, trained, relaid):
    full = trained
    run = raylm.Run(base_dir(base) / "full")
    assert run.summary == full and run.checkpoint == full["checkpoint_path"]
    assert run.mlflow_run_id == full["mlflow_run_id"] and run.config.train.steps == 30
    history = run.history
    assert list(history["step"]) == [5, 10, 15, 20, 25, 30]
    assert history["loss"].iloc[-1] == pytest.approx(full["train_loss"])
    assert list(history["val_loss"].notna()) == [False, True, False, True, False, True]
    assert history["val_loss"].iloc[-1] == pytest.approx(full["val_loss"])
    assert {"lr", "grad_norm", "tokens_per_s", "data_wait_fraction", "workers"} <= set(history)
    # Its progress went to the driver's bar (the last report: step 30, with a validation
    # loss), not to the controller's lines.
    assert "30/30" in trained_bar[0] and f"val={full['val_loss']:.4f}" in trained_bar[0]
    # The run stopped and resumed on another layout, in object storage: one history over
    # both invocations, step for step the uninterrupted run's (within the rounding the
    # layouts' different summation orders leave; see the layout test).
    split = raylm.Run(f"{bucket(base)}/layouts").history
    assert list(split["step"]) == list(history["step"])
    assert list(split["loss"]) == pytest.approx(list(history["loss"]), abs=1e-4)
    # Running the finished run again (a notebook cell run twice) trains nothing and keeps
    # its record.
    again = raylm.train(None, overrides=full_overrides(base))
    assert again.summary == full and len(again.history) == len(history)


def base_dir(base):
    return Path(next(a for a in base if a.startswith("--run.storage_path=")).split("=", 1)[1])


def test_export_loads_with_from_pretrained_and_generates(base, trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raylm.cli import main
    from raylm.formats.exporter import generate, load_run_model

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

    # A plain client with nothing but the directory: the cache is on and EOS/padding and the
    # length limit come with it, so it samples what raylm's own generate does.
    from transformers import pipeline

    pipe = pipeline("text-generation", model=str(tmp_path / "hf"))
    assert pipe.model.generation_config.use_cache is True
    assert pipe.model.generation_config.pad_token_id == tok.eos_token_id
    assert pipe.tokenizer.model_max_length == 1024
    out = pipe("The river", max_new_tokens=12, do_sample=False, return_full_text=False)
    assert out[0]["generated_text"] == text
    # It carries the template the run trained with, so a chat client that renders the
    # conversation through it gets the answer `raylm generate --chat` gives.
    from raylm.formats.exporter import Generator

    messages = [{"role": "user", "content": "Where did the river go?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False,
                                     return_tensors="pt")
    with torch.no_grad():
        answer = model.generate(prompt, max_new_tokens=8, do_sample=False)
    plain = tok.decode(answer[0, prompt.shape[1]:], skip_special_tokens=True)
    ours = Generator(run_dir).answer(messages, max_new_tokens=8, temperature=0)
    assert ours and plain.removeprefix(" ") == ours == Generator(tmp_path / "hf").answer(
        messages, max_new_tokens=8, temperature=0)


def test_the_gguf_export_runs_in_llama_cpp_as_transformers_runs_the_export(
        base, trained, tmp_path):
    """The run as GGUF (f16 in a folder; Q8_0 and llama.cpp's Q4_K_M as the files ``--output``
    names), run by llama.cpp: greedy decoding of a prompt gives the merged Hugging Face
    export's first 16 tokens, and the validation loss on the run's own blocks stays within
    0.01 nats (f16), 0.02 (Q8_0) and 0.05 (Q4_K_M) of the export's. The file's record is in its
    metadata, and a second export replaces the file (one raylm did not write is not:
    tests/unit/formats/test_gguf.py)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raylm.bench.gguf import llama_cpp_loss
    from raylm.cli import main
    from raylm.formats.exporter import model_losses, validation_batches

    run_dir = base_dir(base) / "full"
    hf = tmp_path / "hf"
    assert main(["export", str(run_dir), "--output", str(hf)]) == 0
    out = tmp_path / "f16"
    assert main(["export", str(run_dir), "--output", str(out), "--format", "gguf"]) == 0
    info = json.loads((out / "raylm_export.json").read_text())
    assert info["kind"] == "gguf-f16" and info["step"] == 30
    assert info["architecture"] == "llama" and info["tokenizer_pre"] == "gpt-2"
    files = {"f16": out / info["file"], "q8_0": tmp_path / "tiny.gguf",
             "q4_k_m": tmp_path / "tiny-q4_k_m.gguf"}
    import gguf

    from raylm.formats.llamacpp import RECORD

    for _ in range(2):  # the second replaces the first
        assert main(["export", str(run_dir), "--output", str(files["q8_0"]), "--format",
                     "gguf", "--quantize", "q8_0"]) == 0
    fields = gguf.GGUFReader(files["q8_0"]).fields
    assert json.loads(fields[RECORD].contents()) == {"run_dir": str(run_dir),
                                                     "kind": "gguf-q8_0", "step": 30}
    # The template the run trained with, as llama.cpp's chat mode reads it.
    template = AutoTokenizer.from_pretrained(str(hf)).chat_template
    assert template and fields["tokenizer.chat_template"].contents() == template
    assert main(["export", str(run_dir), "--output", str(files["q4_k_m"]), "--format", "gguf",
                 "--quantize", "q4_k_m"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f16", "hf", "tiny-q4_k_m.gguf",
                                                          "tiny.gguf"]
    model = AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    tok = AutoTokenizer.from_pretrained(str(hf))
    prompt = tok("The river carried", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16,
                              do_sample=False)[0, len(prompt):].tolist()
    batches, cross = validation_batches(str(run_dir), log=print)
    blocks = [row.tolist() for b in batches for row in b["input_ids"]]
    reference = model_losses([model], batches, cross)[0]
    llm = llama_cpp.Llama(str(files["f16"]), n_ctx=64, verbose=False, n_threads=2)
    try:
        assert llm.metadata["tokenizer.chat_template"] == template
        got = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
            got.append(token)
            if len(got) == 16:
                break
    finally:
        llm.close()
    assert got == want
    for quantize, bound in (("f16", 0.01), ("q8_0", 0.02), ("q4_k_m", 0.05)):
        loss = llama_cpp_loss(files[quantize], blocks)
        assert abs(loss - reference) < bound, (quantize, loss, reference)


def test_a_pruned_model_fine_tunes_without_cross_document_attention_or_mlflow_keeping_zeros(
        base, trained, tmp_path):
    """The run pruned by Wanda (its own data: calibration from its training blocks, the
    losses on its validation blocks, the figures in its MLflow run), then fine-tuned from the
    pruned directory as a pretrained model on 2 FSDP workers: its zeros are zero in every
    checkpoint and in the export."""
    import torch
    from mlflow import MlflowClient
    from transformers import AutoModelForCausalLM

    from raylm.cli import main
    from raylm.model import sparsity

    full = trained
    pruned = tmp_path / "pruned"
    assert main(["prune", str(base_dir(base) / "full"), "--output", str(pruned),
                 "--sparsity", "0.5", "--calibration-blocks", "16"]) == 0
    report = json.loads((pruned / "raylm_export.json").read_text())
    # The unpruned figure is the run's own last validation loss (the same blocks).
    assert report["val_loss_before"] == pytest.approx(full["val_loss"], abs=1e-4)
    assert report["step"] == 30 and report["layer_sparsity"] == 0.5
    client = MlflowClient(full["mlflow_tracking_uri"])
    history = client.get_metric_history(full["mlflow_run_id"], "prune/wanda_50pct/val_loss")
    assert [(m.step, m.value) for m in history] == [(30, report["val_loss"])]
    zeros = [m.weight == 0 for _, m in sparsity.prunable(
        AutoModelForCausalLM.from_pretrained(str(pruned)))]

    # The pretrained weights are read on rank 0 and scattered to the 2 FSDP workers; the run
    # starts where the pruned one ended, not from a random model (ln 320 = 5.77).
    # Its MLflow server is down (nothing listens on port 9): said once, training goes on.
    # Without tokenizer.path the model directory's own tokenizer is used.
    # Told to leave out the sample positions 9 and 10 (train.skip_positions, as after a rewind
    # of another run): the workers' order goes past them, and the ledger of the samples trained
    # says so.
    out = train_run(base, "--run.name=finetune", f"--model.path={pruned}",
                    "--tokenizer.path=null", "--train.steps=5", "--optim.lr=1e-3",
                    "--optim.warmup_steps=1", "--train.eval_every=5",
                    "--data.cross_document_attention=false", "--tracking.uri=http://127.0.0.1:9",
                    "--train.skip_positions=[[9,11]]")
    assert out["final_step"] == 5 and out["attention_backend"] == "sdpa-flash-cpu"
    assert out["samples"] == {"steps": 5, "trained": 40, "duplicated": 0, "skipped": 0,
                              "withheld": 0, "in_order": True, "left_out": 2}
    assert out["val_loss"] < report["val_loss"] < 5.77
    assert out["mlflow_run_id"] is None
    healed = tmp_path / "healed"
    assert main(["export", str(base_dir(base) / "finetune"), "--output", str(healed)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(healed))
    for z, (name, layer) in zip(zeros, sparsity.prunable(model), strict=True):
        assert torch.equal(layer.weight == 0, z), name


def test_bad_requests_fail_before_workers_start(base):
    with pytest.raises(ValueError, match="global_batch_size=9 cannot be split equally over 2 "
                                         "workers"):
        train_run(base, "--run.name=bad1", "--train.global_batch_size=9")
    with pytest.raises(ValueError, match=r"over 3 workers, which scaling.num_workers=\[2, 4\] "
                                         r"allows.*train.global_batch_size=12\)"):
        train_run(base, "--run.name=bad1", "--scaling.num_workers=[2,4]")
    with pytest.raises(ValueError, match=r"the run needs 8 CPU: .* but the cluster has 4; "
                                         r"scaling.num_workers=4 or"):
        train_run(base, "--run.name=bad2", "--scaling.num_workers=8",
            "--train.global_batch_size=16")
    with pytest.raises(ValueError, match="data.seq_len=2048 is above the 1024 positions of "
                                         "model.preset=tiny"):
        train_run(base, "--run.name=bad3", "--data.seq_len=2048")
    with pytest.raises(ValueError, match="the validation split has 0 blocks, fewer than the 2"):
        train_run(base, "--run.name=bad4", "--data.val_fraction=0.0")
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        train_run(base, "--run.name=bad5", "--model.preset=huge")


# --------------------------------------------------------------------------------------------
# Faults: processes killed from outside, preemption, resizes, broken checkpoints
# --------------------------------------------------------------------------------------------


def run_and_interfere(base, args, *, acts):
    name = next(a for a in args if a.startswith("--run.name=")).split("=")[1]
    return faults.run_and_interfere(lambda: train_run(base, *args), base_dir(base) / name,
                                    acts=acts)


def assert_exact_samples(summary, steps):
    """The final checkpoint's ledger: every sample of the seed's order, once, in order."""
    assert summary["samples"] == {"steps": steps, "trained": 8 * steps, "duplicated": 0,
                                  "skipped": 0, "withheld": 0, "in_order": True,
                                  "left_out": 0}


def test_a_killed_then_a_preempted_worker_restart_and_end_like_uninterrupted(base, trained):
    """Checkpoints every other step, asynchronous. A worker SIGKILLed while a checkpoint is being
    written in the background (a lost process): the restart goes back to the newest verified
    checkpoint, the one before the save cut short, and the staging directory the killed
    worker left is removed. Then a worker of the group that replaced it is sent SIGTERM (a
    preemption): the preempted group saves at the step it has reached, so nothing is trained
    twice; the run ends with the uninterrupted run's losses."""
    import signal
    import tempfile

    killed = []
    live: dict[tuple, list] = {}
    with scraping(live):
        out = run_and_interfere(
            base, ["--run.name=faults", "--train.steps=30", "--checkpoint.every=2"],
            acts=[(5, lambda: killed.append(faults.kill_a_worker_during_an_async_save(
                      before_step=30))),
                  (5, lambda: faults.train_workers()[-1].send_signal(signal.SIGTERM))])
    assert killed and out["status"] == "finished"
    assert out["final_step"] == 30 and out["restarts"] == 2 and out["failures"] >= 1
    (pid, cut_short), = killed
    lost, preempted = out["interruptions"]
    assert lost["event"] == "restart" and lost["from_workers"] == lost["to_workers"] == 2
    assert lost["resumed_from_step"] == cut_short - 2
    assert not list(Path(tempfile.gettempdir()).glob(f"raylm-ckpt-{pid}-*"))
    assert lost["failures"] >= 1 and lost["cause"] and "Preempted" not in lost["cause"]
    assert "Preempted" in preempted["cause"] and preempted["steps_redone"] == 0
    assert preempted["resumed_from_step"] == preempted["at_step"] > lost["resumed_from_step"]
    assert_exact_samples(out, 30)
    # The goodput ledger: the steps the lost group reported beyond the checkpoint the restart
    # went back to were trained twice (the controller takes one report per poll, so the kill
    # may come before it took some), and the time from that checkpoint, or the last report
    # after it, to the loss is lost; the preempted group lost no step. Its seconds add up.
    g = out["goodput"]
    assert g["recomputed_steps"] == max(0, lost["at_step"] - lost["resumed_from_step"])
    s = g["seconds"]
    assert s["recomputed"] > 0 and s["restart"] > 0 and s["preemption"] > 0
    assert s["productive"] > 0 and s["startup"] > 0 and 0 < g["goodput"] < 1
    assert sum(s.values()) == pytest.approx(g["total_s"], abs=0.1)
    assert g["total_s"] == pytest.approx(out["wall_s"], abs=0.5)
    by_cause = raylm.Run(base_dir(base) / "faults").goodput
    assert by_cause.loc["recomputed", "seconds"] == pytest.approx(s["recomputed"], abs=0.01)
    # MLflow has the restarts too: the event list, and the count at the steps that saw them.
    from mlflow import MlflowClient

    client = MlflowClient(out["mlflow_tracking_uri"])
    logged = json.loads(open(client.download_artifacts(out["mlflow_run_id"],
                                                       "events.json")).read())
    assert logged["interruptions"] == out["interruptions"]
    # The count at every step a report reached the controller (the first group may have been
    # killed before any did), rising to 2 after the preemption.
    restarts = sorted((m.step, m.value) for m in client.get_metric_history(
        out["mlflow_run_id"], "restarts"))
    values = [v for _, v in restarts]
    assert values == sorted(values) and values[-1] == 2.0, restarts
    logged = client.get_run(out["mlflow_run_id"]).data.metrics
    assert logged["goodput"] == pytest.approx(g["goodput"])
    assert logged["goodput_recomputed_steps"] == g["recomputed_steps"]
    table = json.loads(open(client.download_artifacts(out["mlflow_run_id"],
                                                      "goodput.json")).read())
    assert table["columns"] == ["cause", "seconds", "share"] and len(table["data"]) == len(CAUSES)
    assert min(s for s, v in restarts if v == 2.0) > preempted["at_step"]
    full = trained
    assert out["train_loss"] == pytest.approx(full["train_loss"], abs=1e-5)
    assert out["val_loss"] == pytest.approx(full["val_loss"], abs=1e-5)
    progress = [r for r in read(str(base_dir(base) / "faults")) if isinstance(r, Progress)]
    assert_live_series(live, run="faults", losses={r.loss for r in progress},
                       evaluated={r.figures["val_loss"] for r in progress
                                  if "val_loss" in r.figures})


def assert_live_series(live: dict[tuple, list], *, run: str, losses: set[float],
                       evaluated: set[float]) -> None:
    """What Ray's Prometheus endpoint served while the run trained, restarted twice: each
    rank's figures from every worker group, and the controller's goodput and restarts. A
    process's last values can end with it before the agent exports them, so this holds what
    was seen, not the end."""
    import ray

    def series(name: str) -> dict[tuple, list]:
        return {labels: values for (n, labels), values in live.items()
                if n == f"ray_raylm_{name}" and dict(labels)["run"] == run}

    def ranks(name: str) -> dict[str, list]:
        by_rank: dict[str, list] = {}
        for labels, values in series(name).items():
            by_rank.setdefault(dict(labels)["rank"], []).extend(values)
        return by_rank

    # Both ranks, each worker's steps in order (a group reports the steps it trains).
    assert sorted(ranks("step")) == ["0", "1"], series("step")
    for values in series("step").values():
        assert values == sorted(values) and set(values) <= set(range(1, 31))
    # A worker's report the controller never took (it takes one per poll; the kill can come
    # first) is not in the run's record, but was exported: the figures seen include the
    # recorded ones, and every loss lies between the trained model's and a random one's
    # (ln(320) = 5.77 for this vocabulary, within a nat).
    for name, held in (("loss", losses), ("val_loss", evaluated)):
        seen = [x for v in ranks(name).values() for x in v]
        assert any(min(abs(x - y) for y in held) < 1e-6 for x in seen), (name, seen, held)
        assert all(min(held) - 0.5 < x < math.log(320) + 1 for x in seen), (name, seen)
    assert all(v[-1] == 3e-3 for v in ranks("lr").values())  # constant after warmup
    assert all(x > 0 for v in ranks("tokens_per_s").values() for x in v)
    assert all(0 <= x <= 1 for v in ranks("data_wait_fraction").values() for x in v)
    assert all(50 * 2**20 < x < 8 * 2**30 for v in ranks("peak_memory_bytes").values()
               for x in v)
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    assert {dict(k)["NodeAddress"] for k in series("step")} == {node["NodeManagerAddress"]}
    # Not measured on a CPU: no series at all rather than zeros.
    assert ranks("mfu") == {} and ranks("energy_joules") == {}
    # The controller's (no rank label): goodput so far, and the restarts rising to 2.
    (goodput,) = [v for k, v in series("goodput").items() if "rank" not in dict(k)]
    assert all(0 < x <= 1 for x in goodput)
    (restarts,) = series("restarts").values()
    assert restarts == sorted(restarts) and restarts[-1] == 2, restarts


def planted(base, root: Path, tokenizer_dir, *, steps: int, batch: int
            ) -> tuple[list[str], int, int, dict]:
    """A corpus whose one document ends in " ~", a token no other document holds: the data
    args (corpus and a train.seed whose order puts that document's block in the middle of
    the run's first ``steps``), the token, the block's position and the document (its file
    and line)."""
    import numpy as np
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from raylm.data.packing import SampleOrder
    from raylm.data.preparation import prepared_dir
    from raylm.data.streams import PackedSplit
    from tests.conftest import make_docs, write_jsonl

    token = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(" ~").ids[-1]

    def blocks(prepared, split):
        s = PackedSplit.load(prepared, split)
        return s, np.concatenate([np.stack(pq.read_table(Path(s.directory) / f)
                                           .column("input_ids").to_pylist()) for f in s.files])

    for k in range(10):  # the marked document must fall in the train split
        docs = make_docs(400)
        docs[k] += " ~"
        corpus = write_jsonl(root / f"marked-{k}.jsonl", docs)
        args = [f"--data.source={corpus}"]
        prepared = str(prepared_dir(load_config(None, [*base, *args]), log=lambda m: None))
        train_split, train_blocks = blocks(prepared, "train")
        if token in blocks(prepared, "val")[1]:
            continue
        (row,) = np.flatnonzero((train_blocks == token).any(axis=1))
        for seed in range(1000):
            order = SampleOrder(train_split.row_group_sizes, seed=seed, window=8,
                                global_batch=batch)
            at = np.flatnonzero(order.rows(np.arange((steps + 1) * batch)) == row)
            if len(at) == 1 and 4 * batch <= at[0] < (steps - 2) * batch:
                return ([*args, f"--train.seed={seed}", "--data.shuffle_window=8"], token,
                        int(at[0]), {"file": str(corpus), "line": k + 1})
    raise AssertionError("no corpus and seed put the marked block in the run")


def test_a_planted_bad_record_is_rewound_left_out_exactly_and_never_loops(
        base, tmp_path_factory, tokenizer_dir):
    """A pretrained model whose embedding of one token is NaN, and a corpus where one
    document holds that token: the one training block holding it has a NaN loss (a bad
    record). Under train.on_nonfinite=rewind the step that meets it never updates the
    weights; the run goes back to its latest checkpoint and leaves out exactly that block's
    position, recorded in skipped_samples.json and the summary, and ends. (A position left out
    through train.skip_positions: the pruned model's fine-tune above.)"""
    from raylm.rundir import read_manifest
    from tests.conftest import save_tiny_qwen3, tokenizer_vocab

    steps, batch = 12, 8
    root = tmp_path_factory.mktemp("poisoned")
    data, token, position, document = planted(base, root, tokenizer_dir, steps=steps,
                                              batch=batch)
    vocab = tokenizer_vocab(tokenizer_dir)
    poisoned = save_tiny_qwen3(root / "poisoned", vocab_size=vocab, poison=token)
    args = [*data, f"--train.steps={steps}", "--checkpoint.every=2", "--train.log_every=2",
            "--optim.warmup_steps=2", "--tracking.enabled=false"]
    logs: list[str] = []
    out = train(load_config(None, [*base, *args, "--run.name=rewound",
                                   f"--model.path={poisoned}", "--train.on_nonfinite=rewind"]),
                log=logs.append)
    assert out["status"] == "finished" and out["final_step"] == steps
    bad_step = position // batch + 1
    (fault,) = out["numerical_faults"]
    assert (fault["step"], fault["cause"], fault["action"]) == (bad_step, "nonfinite", "rewind")
    assert fault["culprits"] == [[position, position + 1]]
    # The record names the corpus document the block came from (with any it shares it with).
    assert document in fault["documents"] and fault["documents_total"] <= 3
    manifest = read_manifest(str(base_dir(base) / "rewound"))
    assert manifest["ranges"] == [[position, position + 1]]
    assert manifest["faults"][0]["left_out"] == [[position, position + 1]]
    (rewind,) = out["interruptions"]
    assert "Rewind" in rewind["cause"] and rewind["resumed_from_step"] < bad_step
    assert out["samples"] == {"steps": steps, "trained": steps * batch, "duplicated": 0,
                              "skipped": 0, "withheld": 0, "in_order": True, "left_out": 1}
    # The steps after the checkpoint the rewind went back to were trained twice.
    assert out["goodput"]["recomputed_steps"] == rewind["at_step"] - rewind["resumed_from_step"]
    assert out["goodput"]["seconds"]["recomputed"] > 0


def test_resume_on_another_layout_past_a_truncated_checkpoint(trained, relaid):
    """The run of ``relaid``: 10 steps at (dp 2, cp 2), the newest checkpoint cut short, on to
    30 at (pp 2) on half the ranks from the step-5 checkpoint, its sequences whole again. The
    same samples per step throughout (a context-parallel pair reads one data slice), so it
    ends with the uninterrupted dp-only run's losses: DCP reshards the state FSDP2 spread
    over the 4 ranks onto pipeline stages. (Resuming on fewer ranks under FSDP2 alone:
    tests/distributed/test_checkpoint.py and the elastic test; a tensor-parallel checkpoint
    on other layouts: tests/distributed/test_tensor_parallel.py.)"""
    split, staged, logs = relaid
    assert split["final_step"] == 10 and split["workers"] == 4
    assert split["attention_backend"] == "all-to-all+sdpa-flash-cpu"
    assert split["data_parallel"] == 2 and split["tensor_parallel"] == 1
    assert split["pipeline_parallel"] == 1
    assert_exact_samples(split, 10)
    assert any("skipping incomplete checkpoint" in m and "truncated" in m for m in logs), logs
    assert staged["resumed_from_step"] == 5 and staged["pipeline_parallel"] == 2
    assert staged["data_parallel"] == 1 and staged["tensor_parallel"] == 1
    # Steps 6-10 were trained twice (the second time counts): nothing duplicated or skipped.
    assert_exact_samples(staged, 30)
    # The same 8 sequences in every step; only the order in which fp32 gradients are summed
    # differs between layouts, which Adam can turn into parameter changes of ~1e-5
    # (tests/distributed). The bound leaves room for that rounding.
    full = trained
    assert staged["train_loss"] == pytest.approx(full["train_loss"], abs=1e-4)
    assert staged["val_loss"] == pytest.approx(full["val_loss"], abs=1e-4)
    # Each rank of (dp 2, cp 2) holds half of what FSDP2 alone over 2 ranks leaves it; a stage
    # of (pp 2) holds half the model, as much as FSDP2 over 2 ranks: weights and Adam state.
    for held in ("param_memory_gb", "optimizer_memory_gb"):
        assert 0.4 < split[held] / full[held] < 0.6, held
        assert 0.8 < staged[held] / full[held] < 1.25, held
