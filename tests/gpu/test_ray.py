"""`raylm train` through Ray Train and Ray Data on a real GPU: the worker gets the device, trains
in bf16-mixed, checkpoints, and the run's summary says what ran where; and vLLM serves a
fine-tune's merged export as transformers runs it (where vLLM is installed).

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
    assert marker.step == 4


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The reverse-words task's chats and preference pairs, and an untrained model with its
    tokenizer saved as a pretrained model directory is."""
    from raylm.examples import reverse_words

    root = tmp_path_factory.mktemp("task")
    data = reverse_words.write(root / "data", train=400, heldout=20, pretrain=300)
    return data, reverse_words.model(root / "model", root / "data")


def fine_tune(tmp_path: Path, task, *extra: str) -> dict:
    """``raylm train`` on the GPU in bf16-mixed with compiled blocks, as a user runs it: LoRA
    on the task's model, 6 steps, a checkpoint at the end; returns its summary.json."""
    import json

    from raylm.cli import main

    _, model = task
    run = tmp_path / "runs" / "tuned"
    assert main(["train", f"--model.path={model}", "--lora.rank=8", "--data.seq_len=256",
                 f"--run.storage_path={tmp_path}/runs", f"--run.cache_dir={tmp_path}/cache",
                 "--run.name=tuned", "--scaling.num_workers=1", "--train.steps=6",
                 "--train.global_batch_size=8", "--train.micro_batch_size=8",
                 "--train.log_every=3", "--train.eval_every=6", "--checkpoint.every=6",
                 "--model.compile=true", "--tracking.enabled=false", *extra]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["final_step"] == 6
    assert summary["precision"] == "bf16-mixed", summary
    assert summary["device"].startswith("workers on GPUs"), summary
    # Pairs and examples are documents that must not see each other: a per-document kernel.
    assert summary["attention_backend"] in ("flex-attention", "flash-attn-varlen"), summary
    return summary


def test_lora_fine_tuning_through_ray_trains_on_the_gpu(tmp_path: Path, task, gpu_cluster):
    from raylm import api

    fine_tune(tmp_path, task, f"--data.source={task[0]['train']}", "--data.format=chat",
              "--optim.lr=3e-3")
    history = api.Run(str(tmp_path / "runs" / "tuned")).history
    assert history["loss"].iloc[-1] < history["loss"].iloc[0], history["loss"]


def test_dpo_through_ray_trains_on_the_gpu(tmp_path: Path, task, gpu_cluster):
    summary = fine_tune(tmp_path, task, f"--data.source={task[0]['train_pairs']}",
                        "--data.format=preference", "--train.objective=dpo",
                        "--dpo.beta=0.5", "--optim.lr=3e-3")
    assert math.isfinite(summary["train_loss"]) and 0 <= summary["val_accuracy"] <= 1


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_vllm_serves_the_merged_export_as_transformers_runs_it(tmp_path: Path, task,
                                                                gpu_cluster):
    """A LoRA fine-tune's merged export (`raylm export --merge`) served by vLLM's ``LLM``:
    its greedy tokens are transformers' own on the export, both in fp32 on the GPU, up to the
    first step where transformers' top two logits are within 1e-4 (a tie either may break)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from raylm.cli import main

    fine_tune(tmp_path, task, f"--data.source={task[0]['train']}", "--data.format=chat",
              "--optim.lr=3e-3")
    out = tmp_path / "merged"
    assert main(["export", str(tmp_path / "runs" / "tuned"), "--output", str(out),
                 "--merge"]) == 0
    tok = AutoTokenizer.from_pretrained(str(out))
    prompt = tok("User: Reverse the words: river mill bread\n\nAssistant:",
                 add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ran = model.generate(torch.tensor([prompt]).cuda(), do_sample=False, max_new_tokens=16,
                             min_new_tokens=16, output_scores=True,
                             return_dict_in_generate=True)
    want = ran.sequences[0, len(prompt):].tolist()
    margins = [float(a - b) for a, b in (s[0].topk(2).values for s in ran.scores)]
    sure = next((i for i, m in enumerate(margins) if m < 1e-4), len(want))
    del model
    torch.cuda.empty_cache()
    llm = LLM(model=str(out), dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3,
              seed=0)
    served = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    got = list(served[0].outputs[0].token_ids)
    assert sure > 0 and got[:sure] == want[:sure], (got, want, margins)
