"""Fine-tuning data end to end on a local Ray cluster: chat and prompt/completion examples and
preference pairs prepared (counted, rendered, masked, packed whole) and trained on 2 workers,
with supervised fine-tuning and with DPO."""

from __future__ import annotations

import json
import random
import signal

import numpy as np
import pyarrow.parquet as pq
import pytest

from raylm.config import load_config
from raylm.data.preparation import prepare
from tests.conftest import save_tiny_qwen3, tokenizer_vocab
from tests.integration import faults

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]

WORDS = ["river", "mill", "grain", "window", "letter", "winter", "village", "stories",
         "ships", "storms", "market", "bread", "garden", "bridge", "lantern", "harbor"]


def conversation(rng: random.Random) -> list[dict[str, str]]:
    """A question whose answer is a function of it: the words of a phrase in reverse order;
    some conversations ask twice."""
    turns = [{"role": "system", "content": "Answer with the words in reverse order."}]
    for _ in range(rng.choice([1, 1, 2])):
        words = rng.sample(WORDS, rng.randint(2, 4))
        turns.append({"role": "user", "content": "Reverse: " + " ".join(words)})
        turns.append({"role": "assistant", "content": " ".join(reversed(words))})
    return turns


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """200 good conversations, then one of each bad kind (lines 201-206)."""
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("chats")
    lines = [json.dumps({"messages": conversation(rng)}) for _ in range(200)]
    lines += [
        "{not json",
        json.dumps({"messages": [{"role": "narrator", "content": "x"},
                                 {"role": "assistant", "content": "y"}]}),
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
        json.dumps({"conversation": []}),
        # Longer than a block: the question, then (below) the answer.
        json.dumps({"messages": [{"role": "user", "content": "Reverse: " + "a b " * 200},
                                 {"role": "assistant", "content": "b a"}]}),
        json.dumps({"messages": [{"role": "user", "content": "Reverse: a b"},
                                 {"role": "assistant", "content": "b a " * 200}]}),
    ]
    path = root / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def config(chats, tokenizer_dir, tmp_path, *extra):
    return load_config(None, [f"--data.source={chats}", "--data.format=chat",
                              f"--tokenizer.path={tokenizer_dir}", "--data.seq_len=159",
                              "--data.rows_per_row_group=8", "--data.val_fraction=0.1",
                              f"--run.cache_dir={tmp_path}/cache", *extra])


def test_chat_examples_are_counted_rendered_masked_and_packed_whole(chats, tokenizer_dir,
                                                                     tmp_path):
    from tokenizers import Tokenizer

    m = prepare(config(chats, tokenizer_dir, tmp_path), tmp_path / "out", log=lambda s: None)
    assert m["documents_read"] == 206
    assert m["documents_read"] == m["documents_kept"] + sum(m["dropped"].values())
    assert {k: v for k, v in m["dropped"].items() if v} == {
        "malformed": 1, "unknown_role": 1, "no_assistant": 1, "missing_field": 1,
        "too_long": 2, "duplicate": m["dropped"]["duplicate"]}
    assert sorted((b["line"], b["reason"]) for b in m["bad_records"]) == [
        (201, "malformed"), (202, "unknown_role"), (203, "no_assistant"),
        (204, "missing_field")]
    L = m["block_length"]
    assert m["tokens"] + m["padding_tokens"] == m["blocks"] * L and m["truncated"] == 0
    assert 0 < m["trained_tokens"] < m["tokens"] / 2

    # Every trained run of every stored block is an answer and its EOS, and no example is
    # split between blocks.
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    table = pq.read_table(tmp_path / "out" / "train")
    trained = 0
    for ids, starts, mask in zip(table.column("input_ids").to_pylist(),
                                 table.column("doc_starts").to_pylist(),
                                 table.column("loss_mask").to_pylist(), strict=True):
        ids, mask = np.array(ids), np.array(mask)
        trained += int(mask.sum())
        assert all(mask[s] == 0 for s in starts)  # no example's first token is a target
        runs = np.split(np.arange(L), np.flatnonzero(np.diff(mask)) + 1)
        for run in runs:
            if mask[run[0]]:
                assert ids[run[-1]] == eos
                words = tok.decode(ids[run[:-1]].tolist()).split()
                assert words and set(words) <= set(WORDS)
    val = pq.read_table(tmp_path / "out" / "val").column("loss_mask").to_pylist()
    assert trained + sum(map(sum, val)) == m["trained_tokens"]


def test_long_examples_can_be_truncated_and_prompt_completion_pairs_train(
        chats, tokenizer_dir, tmp_path):
    m = prepare(config(chats, tokenizer_dir, tmp_path, "--data.long_examples=truncate"),
                tmp_path / "cut", log=lambda s: None)
    # Cut to a block, the long answer keeps trained tokens; the long question keeps none.
    assert m["dropped"]["too_long"] == 0 and m["truncated"] == 1
    assert m["dropped"]["no_trained_tokens"] == 1
    pairs = tmp_path / "pairs.jsonl"
    rng = random.Random(1)
    rows = []
    for _ in range(120):
        words = rng.sample(WORDS, 3)
        rows.append({"prompt": "Reverse: " + " ".join(words) + "\nAnswer:",
                     "completion": " " + " ".join(reversed(words))})
    pairs.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    m = prepare(config(pairs, tokenizer_dir, tmp_path, "--data.format=prompt_completion"),
                tmp_path / "pc", log=lambda s: None)
    assert m["format"] == "prompt_completion" and m["loss_on"] == "assistant"
    assert m["documents_kept"] + m["dropped"]["duplicate"] == 120
    assert 0 < m["trained_tokens"] < m["tokens"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, tokenizer_dir):
    """A tiny Qwen3 for the test tokenizer, saved with save_pretrained: the model fine-tuned (a
    family other than Llama: raylm's own presets are Llamas)."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("pretrained"),
                           vocab_size=tokenizer_vocab(tokenizer_dir))


@pytest.fixture(scope="module")
def reverse_task(tmp_path_factory):
    """A multiple-choice benchmark of the reverse-words task as an lm-eval task folder: each
    question rendered as fine-tuning renders it, the right reversal among three near misses.
    (What it checks is where scores go and that they are lm-eval's; what a chat fine-tune
    learned is measured by generation: docs/benchmarks.md says why.)"""
    rng = random.Random(1)
    root = tmp_path_factory.mktemp("tasks")
    rows = []
    for _ in range(24):
        words = rng.sample(WORDS, 3)
        right = " ".join(reversed(words))
        # Two words swapped (both ways a reversal of three can be), and the words unreversed.
        wrong = sorted({near_miss(words, rng) for _ in range(12)} | {" ".join(words)})
        choices = [right, *wrong]
        rng.shuffle(choices)
        rows.append({"words": " ".join(words), "choices": choices,
                     "answer": choices.index(right)})
    (root / "reverse.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "reverse.yaml").write_text(
        "task: reverse_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {root / 'reverse.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"System: Answer with the words in reverse order.\\n\\nUser: Reverse: "
        "{{words}}\\n\\nAssistant:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    return root


def lora_run(chats, tokenizer_dir, pretrained, tmp_path) -> list[str]:
    """LoRA rank 8 on the pretrained model, the chat data, fp32, 8 sequences per step."""
    return [f"--data.source={chats}", "--data.format=chat", f"--tokenizer.path={tokenizer_dir}",
            "--data.seq_len=159", "--data.rows_per_row_group=8", "--data.val_fraction=0.1",
            f"--run.cache_dir={tmp_path}/cache", f"--run.storage_path={tmp_path}/runs",
            f"--model.path={pretrained}", "--lora.rank=8", "--lora.alpha=16",
            "--train.precision=fp32", "--train.global_batch_size=8",
            "--train.micro_batch_size=2", "--train.eval_batches=2", "--optim.lr=1e-2",
            "--optim.warmup_steps=2", "--optim.schedule=constant", "--tracking.enabled=false"]


def test_lora_on_two_workers_logs_registers_and_exports_its_adapters(
        chats, tokenizer_dir, pretrained, reverse_task, tmp_path, capsys):
    """LoRA adapters on a saved pretrained model, 2 FSDP2 workers, chat data: MLflow holds and
    registers the final adapter, the checkpoint holds the adapters only, and the exports
    (adapter, merged, int8) agree. Each checkpoint is scored on a local lm-eval task beside the
    run, the scores in MLflow, the summary and the history at its step, the same numbers
    `raylm eval` and lm-eval's own command line give. (A LoRA run on 2 workers that loses one
    and resumes exactly is the DPO test below: the same adapters' checkpoints, another
    loss.)"""
    from raylm.run.launch import train

    args = [*lora_run(chats, tokenizer_dir, pretrained, tmp_path), "--scaling.num_workers=2",
            "--train.log_every=10", "--train.eval_every=10", "--checkpoint.every=10"]
    store = f"sqlite:///{tmp_path}/mlflow.db"
    full = train(load_config(None, [*args, "--run.name=whole", "--train.steps=20",
                                    "--tracking.enabled=true", f"--tracking.uri={store}",
                                    "--tracking.register_as=reverse-words",
                                    "--eval.tasks=[reverse_mc]",
                                    f"--eval.include_path={reverse_task}",
                                    "--eval.resources={CPU: 0.5}"]),
                 log=print)
    assert full["status"] == "finished" and full["workers"] == 2
    # MLflow holds the run's final adapter as peft writes it: the run's output model at its
    # last step, registered as version 1.
    from mlflow import MlflowClient

    client = MlflowClient(store)
    (output,) = client.get_run(full["mlflow_run_id"]).outputs.model_outputs
    logged = client.get_logged_model(output.model_id)
    assert (logged.model_type, output.step) == ("peft-adapter", 20)
    assert full["mlflow_model_uri"] == logged.model_uri
    assert full["registered_version"] == 1
    version = client.get_model_version("reverse-words", "1")
    assert (version.source, version.run_id) == (logged.artifact_location, full["mlflow_run_id"])
    assert version.tags["raylm.model_id"] == logged.model_id
    logged_adapter = logged.artifact_location  # a local directory in a SQLite store
    assert full["samples"]["duplicated"] == 0 and full["samples"]["skipped"] == 0
    # The 2 ranks' checkpoint holds the adapters (and their Adam state), not the base.
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(full["checkpoint_path"]).read_metadata().state_dict_metadata
    tensors = [k for k in keys if k.startswith(("model.", "optim.state."))]
    assert tensors and all(".lora_" in k for k in tensors)

    # Asked as it was trained (the default template's "User: ...", "Assistant: "), the model
    # gives an answer and stops there rather than writing another turn.
    from raylm.cli import main

    capsys.readouterr()
    assert main(["generate", str(tmp_path / "runs" / "whole"), "--chat",
                 "Reverse: river mill bread", "--temperature=0", "--max-new-tokens=24"]) == 0
    answer = capsys.readouterr().out
    assert not any(m in answer for m in ("User:", "Assistant:", "System:")), answer

    # Exported as peft's adapter directory, loaded onto the base with peft, it computes what
    # the merged export computes.
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = str(tmp_path / "runs" / "whole")
    assert main(["export", run_dir, "--output", str(tmp_path / "adapter")]) == 0
    assert main(["export", run_dir, "--output", str(tmp_path / "merged"), "--merge"]) == 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(pretrained)),
                                        str(tmp_path / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    ids = torch.randint(1, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    # The adapter MLflow holds loads the same way.
    from_mlflow = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(pretrained)), logged_adapter).eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(from_mlflow(input_ids=ids).logits,
                                   merged(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        base = AutoModelForCausalLM.from_pretrained(str(pretrained)).eval()
        assert not torch.allclose(base(input_ids=ids).logits, merged(input_ids=ids).logits)

    check_benchmarks(full, tmp_path / "runs" / "whole", tmp_path / "merged", store,
                     reverse_task, capsys)

    # Quantized for deployment: int8 linear weights that from_pretrained loads, smaller on
    # disk, measured against the merged model on the run's own validation blocks (the
    # unquantized figure is the run's final validation loss).
    from torchao.quantization import Int8Tensor

    capsys.readouterr()
    assert main(["export", run_dir, "--output", str(tmp_path / "int8"), "--quantize=int8"]) == 0
    assert "int8 weight-only" in capsys.readouterr().out
    report = json.loads((tmp_path / "int8" / "raylm_export.json").read_text())
    assert report["bytes"] < report["unquantized_bytes"]
    assert report["unquantized_val_loss"] == pytest.approx(full["val_loss"], abs=1e-4)
    assert abs(report["val_loss"] - report["unquantized_val_loss"]) < 0.05
    int8 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "int8")).eval()
    assert isinstance(int8.model.layers[0].mlp.down_proj.weight, Int8Tensor)
    assert isinstance(int8.lm_head.weight, Int8Tensor)
    with torch.no_grad():
        torch.testing.assert_close(int8(input_ids=ids).logits, merged(input_ids=ids).logits,
                                   atol=0.05, rtol=0)



def check_benchmarks(full: dict, run_dir, merged, store: str, tasks, capsys) -> None:
    """The LoRA run's benchmark scores (checkpoints at steps 10 and 20, scored beside it):
    where a user reads them, what `raylm eval` and lm-eval's own command line give, and
    which checkpoints a resumed run would score."""
    import sys

    from mlflow import MlflowClient

    from raylm import api
    from raylm.cli import main
    from raylm.config import EvalConfig
    from raylm.contracts.events import Benchmark
    from raylm.run import record
    from raylm.run.benchmarks import Benchmarks, score_checkpoint

    name = "eval/reverse_mc/acc"
    scores = full["benchmarks"]["scores"]
    assert set(scores) == {name, "eval/reverse_mc/acc_norm"} and not full["benchmarks"]["failed"]
    assert scores[name]["latest_step"] == 20 and scores[name]["best_step"] in (10, 20)
    history = MlflowClient(store).get_metric_history(full["mlflow_run_id"], name)
    assert sorted(m.step for m in history) == [10, 20]
    at = {m.step: m.value for m in history}
    assert scores[name]["latest"] == at[20]
    rows = api.Run(str(run_dir)).history.set_index("step")
    assert rows.loc[10, name] == at[10] and rows.loc[20, name] == at[20]
    # The run never waited for a benchmark: each ran on its own half CPU while it trained,
    # or after its last step (the goodput account's "benchmarks").
    assert full["goodput"]["seconds"]["benchmarks"] < 60

    # `raylm eval` scores the step-10 checkpoint again with the same code: the same number,
    # added to the run's record. The run's tasks; their folder named by the user, as a run
    # directory's word is not enough to import code (tests/security).
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--step=10", f"--eval.include_path={tasks}"]) == 0
    assert '"eval/reverse_mc/acc"' in capsys.readouterr().out
    events = [r for r in record.read(str(run_dir)) if isinstance(r, Benchmark)]
    assert [r.step for r in events] == [10, 20, 10]
    assert events[-1].scores == events[0].scores

    # lm-eval's own command line on the merged export of step 20: the same scores. Its entry
    # point (`python -m lm_eval` and the `lm_eval` script call it), in this process: a fresh
    # interpreter would spend seconds importing what this one holds.
    from unittest import mock

    from lm_eval.__main__ import cli_evaluate

    with mock.patch.object(sys, "argv", [
            "lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={merged}",
            "dtype=float32", "--tasks", "reverse_mc", "--include_path", str(tasks),
            "--device", "cpu", "--batch_size", "8", "--output_path",
            str(merged.parent / "lm-eval")]):
        cli_evaluate()
    (found,) = list((merged.parent / "lm-eval").rglob("results_*.json"))
    theirs = json.loads(found.read_text())["results"]["reverse_mc"]
    assert theirs["acc,none"] == at[20], capsys.readouterr().out[-2000:]
    assert theirs["acc_norm,none"] == scores["eval/reverse_mc/acc_norm"]["latest"]

    # A resumed run scores the due checkpoints no invocation scored, and only those.
    class Here:
        def start(self, checkpoint):
            return score_checkpoint(str(run_dir), checkpoint, ev)

        def finished(self, handles, timeout):
            return [(h, h) for h in handles]

    ev = EvalConfig(tasks=["reverse_mc"], include_path=str(tasks))
    records = record.read(str(run_dir))
    b = Benchmarks(str(run_dir), ev, checkpoint_every=10, total_steps=20, runner=Here())
    assert b.resume(records, bad=[]) == []
    unscored = [r for r in records if not (isinstance(r, Benchmark) and r.step == 20)]
    b = Benchmarks(str(run_dir), ev, checkpoint_every=10, total_steps=20, runner=Here())
    assert b.resume(unscored, bad=[]) == [20]
    (rescored,) = b.collect()
    assert rescored.scores[name] == at[20]


def near_miss(words: list[str], rng: random.Random) -> str:
    wrong = list(reversed(words))
    i = rng.randrange(len(wrong) - 1)
    wrong[i], wrong[i + 1] = wrong[i + 1], wrong[i]
    return " ".join(wrong)


@pytest.fixture(scope="module")
def preference_pairs(tmp_path_factory):
    """160 pairs (the right reversal chosen, two words swapped rejected; about half of the
    prompts a conversation, the others a string, used as written), then one of each bad kind
    (lines 161-165)."""
    rng = random.Random(2)
    rows = []
    for _ in range(160):
        words = rng.sample(WORDS, rng.randint(3, 4))
        prompt = [{"role": "system", "content": "Answer with the words in reverse order."},
                  {"role": "user", "content": "Reverse: " + " ".join(words)}]
        rows.append({"prompt": prompt if rng.random() < 0.5 else prompt[1]["content"],
                     "chosen": " ".join(reversed(words)), "rejected": near_miss(words, rng)})
    rows += [{"prompt": "Reverse: a b", "chosen": "b a"},
             {"prompt": "Reverse: a b", "chosen": "b a", "rejected": " b a"},
             {"prompt": "Reverse: a b", "chosen": ["b a"], "rejected": "a b"},
             {"prompt": "Reverse: a b", "chosen": "b a " * 150, "rejected": "a b"},
             {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                            "content": "hello"}],
              "chosen": "b a", "rejected": "a b"}]
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dpo_with_lora_on_two_workers_resumes_exactly(preference_pairs, tokenizer_dir,
                                                      pretrained, tmp_path):
    """Preference pairs prepared (every bad row counted and listed, each pair whole in a
    block), then DPO on the LoRA model, 2 workers, every step reported: a worker is SIGKILLed
    once its group has reported steps past its step-12 checkpoint, and the group that replaces
    it goes back to that checkpoint of the adapters and trains those steps again to the same
    losses (what an uninterrupted run would have trained: the steps before the kill were
    trained by one). The preference figures reach MLflow, the history and the summary."""
    from raylm import api, rundir
    from raylm.contracts.events import GroupStart, Progress
    from raylm.run import record
    from raylm.run.launch import train

    args = [f"--data.source={preference_pairs}", "--data.format=preference",
            "--train.objective=dpo", "--dpo.beta=0.5",
            *lora_run(preference_pairs, tokenizer_dir, pretrained, tmp_path)[2:],
            "--optim.lr=3e-3", "--data.seq_len=255", "--scaling.num_workers=2",
            "--train.log_every=1", "--train.eval_every=12", "--checkpoint.every=12",
            "--train.steps=24", "--run.name=split", "--tracking.enabled=true",
            f"--tracking.uri=sqlite:///{tmp_path}/mlflow.db", "--tracking.log_model=false"]
    cfg = load_config(None, args)
    lines: list[str] = []
    m = prepare(cfg, tmp_path / "prepared", log=lines.append)
    assert m["format"] == "preference" and m["documents_read"] == 165
    # About half the prompts are strings (used as written), the rest messages (templated):
    # the console says the data mixes the two, with the counts.
    (warning,) = [x for x in lines if "two renderings" in x]
    written = m["prompts_as_written"]
    assert written == 78, warning  # of the fixture's seeded draw
    assert f"{written:,} of {m['documents_kept']:,} preference rows" in warning
    assert sorted((b["line"], b["reason"]) for b in m["bad_records"]) == [
        (161, "missing_field"), (162, "identical_answers"), (163, "malformed"),
        (165, "malformed")]
    # Line 163's chosen answer is a list of strings, not of assistant turns; line 165's
    # prompt ends with an answer.
    assert m["dropped"]["too_long"] == 1 and m["truncated"] == 0
    blocks = pq.read_table(str(tmp_path / "prepared" / "train")).to_pydict()
    for ids, starts, mask in zip(blocks["input_ids"], blocks["doc_starts"],
                                 blocks["loss_mask"], strict=True):
        # Whole pairs, then any padding: the halves alternate chosen (1) and rejected (2).
        ends = [*starts[1:], len(ids)]
        marks = [sorted(set(mask[a:b]) - {0}) for a, b in zip(starts, ends, strict=True)]
        if marks[-1] == []:
            marks.pop()
        assert marks == [[1], [2]] * (len(marks) // 2) and marks
    run_dir = tmp_path / "runs" / "split"

    def kill_past_the_checkpoint() -> None:
        """Once the controller has step 13 (the record holds it; reports reach it at its
        polls, so it is a few steps behind training: the workers are held meanwhile), with
        every worker stopped so that no save can land: one is killed if the newest checkpoint
        is still step 12's."""
        workers = faults.hold_until(lambda: any(
            isinstance(r, Progress) and r.step >= 13 for r in record.read(str(run_dir))),
            what="the controller to have step 13")
        newest = rundir.latest_verified(run_dir, warn=lambda m: None)[1].step
        if newest == 12:
            workers[0].send_signal(signal.SIGKILL)
        for p in workers[1:] if newest == 12 else workers:
            p.send_signal(signal.SIGCONT)
        assert newest == 12, f"the run reached its step-{newest} checkpoint before the kill"

    split = faults.run_and_interfere(lambda: train(cfg, log=print), run_dir,
                                     acts=[(12, kill_past_the_checkpoint)])
    assert split["status"] == "finished" and split["final_step"] == 24
    assert split["restarts"] == 1
    (restart,) = [i for i in split["interruptions"] if i["event"] == "restart"]
    assert restart["resumed_from_step"] == 12 and restart["to_workers"] == 2
    # Each group's reported losses by step: the steps the first trained past the checkpoint,
    # trained again by the second from that checkpoint, gave the same losses.
    by_group: list[dict[int, float]] = []
    for r in record.read(str(run_dir)):
        if isinstance(r, GroupStart):
            by_group.append({})
        elif isinstance(r, Progress):
            by_group[-1][r.step] = r.loss
    first, second = by_group
    again = sorted(set(first) & set(second))
    assert again and again[0] == 13, (first, second)
    for step in again:
        assert second[step] == pytest.approx(first[step], abs=1e-5), step
    assert sorted(second) == list(range(13, 25))
    assert split["samples"]["duplicated"] == 0 and split["samples"]["skipped"] == 0
    from mlflow import MlflowClient

    client = MlflowClient(split["mlflow_tracking_uri"])
    for name in ("dpo_margin", "dpo_accuracy", "dpo_chosen_logp", "val_accuracy"):
        assert client.get_metric_history(split["mlflow_run_id"], name), name
    history = api.Run(str(run_dir)).history
    # The policy starts as its reference (adapters start as the identity), where every pair's
    # loss is ln 2; training lowers it on the held-out pairs. (One step's 8 pairs are too few
    # to show it: their loss swings by 0.05 from step to step.)
    assert split["val_loss"] < np.log(2) - 0.01
    assert {"dpo_margin", "dpo_accuracy", "dpo_chosen_logp", "val_accuracy"} <= set(history)


def test_dpo_full_fine_tuning_scores_its_reference_once_before_training(
        preference_pairs, tokenizer_dir, pretrained, tmp_path):
    """DPO without adapters, 2 workers: the reference pass (Ray Data actors with the starting
    weights) stores every answer token's log-probability beside the blocks, before the worker
    group starts; the workers hold the policy alone, their first loss is ln 2 (the policy is
    its reference) and training lowers it. A second run of the same data and model reads the
    same copy."""
    from raylm import api
    from raylm.data.streams import reference_file
    from raylm.run.launch import train
    from raylm.run.reference import stored_reference
    from raylm.run.resources import choose_device

    args = [f"--data.source={preference_pairs}", "--data.format=preference",
            "--train.objective=dpo", "--dpo.beta=0.5",
            *lora_run(preference_pairs, tokenizer_dir, pretrained, tmp_path)[2:],
            "--lora.rank=0", "--optim.lr=1e-3", "--data.seq_len=255",
            "--scaling.num_workers=2", "--train.log_every=1", "--train.eval_every=6",
            "--checkpoint.every=6", "--train.steps=6", "--run.name=full"]
    logged: list[str] = []
    summary = train(load_config(None, args), log=lambda m: (logged.append(m), print(m)))
    assert summary["status"] == "finished"
    (folder,) = (tmp_path / "cache" / "reference").iterdir()
    info = json.loads((folder / "reference.json").read_text())
    (prepared,) = (tmp_path / "cache" / "prepared").glob("*/layout.json")
    layout = json.loads(prepared.read_text())
    assert info["blocks"] == sum(s["blocks"] for s in layout["splits"].values())
    assert info["targets"] > 0 and info["model"] == str(pretrained)
    train = layout["splits"]["train"]
    assert sorted(str(f) for f in (folder / "train").iterdir()) == [
        reference_file(str(folder / "train"), name, g)
        for name, n in zip(train["files"], train["file_groups"], strict=True) for g in range(n)]
    assert any("scoring the prepared pairs" in m for m in logged)
    history = api.Run(str(tmp_path / "runs" / "full")).history
    assert history["loss"].iloc[0] == pytest.approx(np.log(2), abs=1e-4)
    assert summary["val_loss"] < np.log(2) - 0.01
    assert summary["val_accuracy"] >= 0 and "dpo_margin" in history
    again: list[str] = []
    cfg, _ = choose_device(load_config(None, args), {"CPU": 2.0})  # as the run decided it
    assert stored_reference(cfg, prepared.parent, identity=info["inputs"]["identity"],
                            resources={"CPU": 1.0}, vocab_size=0, eos_id=0,
                            log=again.append) == str(folder)
    assert again == [f"raylm: reference log-probabilities of {pretrained} from {folder}"]


def test_weights_that_did_not_load_end_the_run_at_once(chats, tokenizer_dir, tmp_path,
                                                       capsys):
    """A pretrained model whose logits do not vary over the vocabulary predicts every token
    alike: its weights did not load. The run stops after one attempt, with that cause in one
    line, though train.max_failures allows 3 restarts (a restart would fail the same way)."""
    from raylm.cli import main

    vocab = tokenizer_vocab(tokenizer_dir)
    zero = save_tiny_qwen3(tmp_path / "zero", vocab_size=vocab, zero=True)
    run = [*lora_run(chats, tokenizer_dir, zero, tmp_path), "--run.name=unloaded",
           "--train.steps=4", "--train.max_failures=3", "--scaling.num_workers=1"]
    capsys.readouterr()
    assert main(["train", *run]) == 2
    (line,) = [s for s in capsys.readouterr().err.splitlines() if s.startswith("raylm: error")]
    assert "predicts every token alike" in line and "did not load" in line, line
    summary = json.loads((tmp_path / "runs" / "unloaded" / "summary.json").read_text())
    assert summary["failures"] == 1 and summary["restarts"] == 0
