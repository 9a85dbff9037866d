"""Reinforcement learning (train.objective=grpo) end to end on the local Ray cluster: a model
warmed up here on a task's format learns the task from its rewards, with completions from
generator actors; a generator killed mid-run is replaced while the trainers go on, and a
trainer killed after a checkpoint resumes to the same rewards and losses."""

from __future__ import annotations

import json
import random
import signal
import time

import pytest
import torch

from raylm.config import load_config
from tests.integration import faults

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]

PAIRS = [(a, b) for a in range(10) for b in range(10) if a != b]


def question(a: int, b: int) -> str:
    return f"Which is larger: {a} or {b}?"


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """The tiny Llama taught the task's format in this process (a digit of the question, then
    EOS; which of the two at random, so it starts near half right), saved as a Hugging Face
    directory with a tokenizer trained on the task's text; and the task's prompts, each with
    its answer."""
    from tokenizers import Tokenizer

    from raylm.data.chat import DefaultTemplate, encode
    from raylm.data.tokenizer import save_hf_tokenizer, train_bpe
    from raylm.model.assemble import build_training_model
    from raylm.model.head_loss import LossHead
    from raylm.workers.step import train_step

    root = tmp_path_factory.mktemp("rl")
    texts = [f"User: {question(a, b)}\n\nAssistant: {c}" for a, b in PAIRS for c in (a, b)]
    save_hf_tokenizer(train_bpe(iter(texts * 3), vocab_size=300, min_frequency=2),
                      root / "tokenizer")
    tok = Tokenizer.from_file(str(root / "tokenizer" / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    built = build_training_model(preset="tiny", path=None, vocab_size=tok.get_vocab_size(),
                                 eos_id=eos, device=torch.device("cpu"), precision="fp32",
                                 cross_document=False, seed=0)
    optimizer = torch.optim.AdamW(built.model.parameters(), lr=3e-3)
    rng, width = random.Random(0), 48
    for _ in range(150):
        rows = []
        for a, b in rng.sample(PAIRS, 16):
            ids, mask = encode(DefaultTemplate().segments(
                [{"role": "user", "content": question(a, b)},
                 {"role": "assistant", "content": str(rng.choice([a, b]))}]),
                tok, eos_id=eos, loss_on="assistant")
            n = len(ids)
            rows.append((list(ids) + [eos] * (width - n), [0, *mask[1:]] + [0] * (width - n),
                         list(range(n)) + list(range(width - n))))
        batch = {"input_ids": torch.tensor([r[0] for r in rows]),
                 "loss_mask": torch.tensor([r[1] for r in rows], dtype=torch.uint8),
                 "position_ids": torch.tensor([r[2] for r in rows])}
        train_step(built, optimizer, [batch], accumulation=1, grad_clip=1.0,
                   cross_document=False)
    assert isinstance(built.model.lm_head, LossHead)
    built.model.lm_head.__class__ = torch.nn.Linear  # the plain head, as transformers saves
    built.model.save_pretrained(root / "model")
    for f in (root / "tokenizer").iterdir():
        (root / "model" / f.name).write_bytes(f.read_bytes())
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": question(a, b), "answer": str(max(a, b))})
                               + "\n" for a, b in PAIRS))
    return root


def generator_processes():
    import psutil

    return [p for p in psutil.process_iter(["cmdline"])
            if any(part.startswith("ray::Generator") for part in (p.info["cmdline"] or []))]


def test_grpo_learns_replaces_a_lost_generator_and_resumes_a_lost_trainer_exactly(warmed,
                                                                                  tmp_path):
    from raylm import api
    from raylm.run import record
    from raylm.run.launch import train

    cfg = load_config(None, [
        f"--model.path={warmed / 'model'}", f"--data.source={warmed / 'prompts.jsonl'}",
        "--data.format=prompt", "--train.objective=grpo", "--rl.reward=exact_match",
        "--data.seq_len=40", "--rl.max_completion_tokens=4", "--rl.group_size=8",
        "--rl.generators=2", '--rl.generator_resources={"CPU": 0.5}',
        "--train.global_batch_size=8", "--train.micro_batch_size=4", "--train.steps=100",
        "--train.log_every=1", "--train.eval_every=20", "--train.eval_batches=4",
        "--checkpoint.every=20", "--optim.lr=1e-3", "--optim.warmup_steps=2",
        "--train.precision=fp32", "--data.val_fraction=0.2", "--scaling.num_workers=1",
        f"--run.storage_path={tmp_path}/runs", f"--run.cache_dir={tmp_path}/cache",
        "--run.name=grpo", "--tracking.enabled=true",
        f"--tracking.uri=sqlite:///{tmp_path}/mlflow.db", "--tracking.log_model=false"])
    run_dir = tmp_path / "runs" / "grpo"

    def kill_a_generator_then_the_trainer() -> None:
        """A generator as soon as the group has started; then, once the record holds step 21
        (reports reach it at the controller's polls, several steps behind training), the
        trainer, stopped first so that no save lands meanwhile, if the newest checkpoint is
        still step 20's."""
        (victim, *_) = generator_processes()
        victim.send_signal(signal.SIGKILL)
        deadline = time.time() + 240
        while not any(r["event"] == "progress" and r["step"] >= 21
                      for r in record.read(str(run_dir))):
            assert time.time() < deadline, "the controller never had step 21"
            time.sleep(0.02)
        (trainer,) = faults.train_workers()
        trainer.send_signal(signal.SIGSTOP)
        newest = faults.checkpoint_step(run_dir)
        trainer.send_signal(signal.SIGKILL if newest == 20 else signal.SIGCONT)
        assert newest == 20, f"the run reached its step-{newest} checkpoint before the kill"

    summary = faults.run_and_interfere(lambda: train(cfg, log=print), run_dir,
                                       acts=[(0, kill_a_generator_then_the_trainer)])
    assert summary["status"] == "finished" and summary["final_step"] == 100
    assert summary["restarts"] == 1  # the trainer's loss; the generator's cost no restart
    (restart,) = [i for i in summary["interruptions"] if i["event"] == "restart"]
    assert restart["resumed_from_step"] == 20
    groups: list[dict[int, dict]] = []
    for r in record.read(str(run_dir)):
        if r["event"] == "group_start":
            groups.append({})
        elif r["event"] == "progress":
            groups[-1][r["step"]] = r
    first, second = groups
    assert max(r["rl_generators_replaced"] for r in first.values()) >= 1
    again = sorted(set(first) & set(second))
    assert again and again[0] == 21, (sorted(first), sorted(second))
    for step in again:  # the same completions, rewards and update from the step-20 weights
        for key in ("rl_reward", "rl_completion_len", "loss"):
            assert second[step][key] == pytest.approx(first[step][key], abs=1e-6), (step, key)
    assert summary["samples"]["duplicated"] == 0 and summary["samples"]["skipped"] == 0
    assert summary["samples"]["trained"] == 100 * 8
    # It learned: from about half right (either digit of the question, at random) to the
    # larger one, on the training prompts and on held-out ones.
    rewards = [second.get(step, first.get(step))["rl_reward"] for step in range(1, 101)]
    assert sum(rewards[:5]) / 5 < 0.65 and sum(rewards[-10:]) / 10 >= 0.8, rewards
    assert summary["val_reward"] >= 0.8
    history = api.Run(str(run_dir)).history
    assert {"rl_reward", "rl_reward_std", "rl_no_signal", "rl_clip_low", "rl_kl",
            "rl_generate_s", "rl_transfer_s", "val_reward"} <= set(history)
    assert "rl_reward" in summary and "rl_clip_high" in summary
    from mlflow import MlflowClient

    client = MlflowClient(summary["mlflow_tracking_uri"])
    for name in ("rl_reward", "rl_truncated", "val_reward"):
        assert client.get_metric_history(summary["mlflow_run_id"], name), name
