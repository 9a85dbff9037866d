"""The generated fine-tuning task: distinct held-out questions and the exact-match scorer."""

from __future__ import annotations

import json

from raylm.data.corpus import parse_messages
from raylm.examples.reverse_words import answer, make_split, write


def test_heldout_questions_are_never_training_questions(tmp_path):
    train, heldout = make_split(train=500, heldout=100, seed=3)
    assert len(train) == 500 and len(heldout) == 100
    assert not {tuple(w) for w in train} & {tuple(w) for w in heldout}
    assert answer(["river", "mill", "bread"]) == "bread mill river"
    paths = write(tmp_path, train=50, heldout=10)
    rows = [json.loads(line) for line in open(paths["heldout"])]
    assert len(rows) == 10
    for row in rows:
        messages, reason = parse_messages(row["messages"])
        assert reason is None and messages[-1]["role"] == "assistant"
        words = messages[1]["content"].removeprefix("Reverse the words: ").split()
        assert messages[-1]["content"] == " ".join(reversed(words))
    # The same seed writes the same files.
    again = write(tmp_path / "again", train=50, heldout=10)
    assert open(again["train"]).read() == open(paths["train"]).read()


def test_score_is_greedy_exact_match_over_the_conversations(tmp_path, tokenizer_dir):
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from raylm.examples.reverse_words import score
    from raylm.model.build import build_config

    config = build_config(preset="tiny", path=None, vocab_size=400, eos_id=0,
                          attn_implementation="sdpa")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "model"))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / "model" / f.name)
    paths = write(tmp_path / "data", train=5, heldout=4)
    result = score(tmp_path / "model", paths["heldout"], max_new_tokens=4)
    # An untrained model answers nothing right; the scorer ran every conversation.
    assert result == {"examples": 4, "exact_match": 0.0}


def test_the_pretraining_text_lists_words_in_order_and_the_model_loads(tmp_path):
    """The text the fine-tuned model is pretrained on repeats lists in their order (copying is
    what it teaches) and never holds a list reversed; `model` saves a 4-layer Llama with a
    tokenizer trained on that text."""
    import re

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raylm.examples.reverse_words import model

    paths = write(tmp_path, train=10, heldout=5, pretrain=1000)
    texts = [json.loads(line)["text"] for line in open(paths["pretrain"])]
    assert len(texts) == 1000
    for text in texts:
        listed = re.search(r"In the end (.*) were still there\.$", text).group(1)
        assert f" {listed}." in text[:text.rindex("In the end")]
        words = re.split(r", | and ", listed)
        assert ", ".join(words[:0:-1]) + " and " + words[0] not in text
    out = model(tmp_path / "model", tmp_path, layers=2, hidden=64, heads=2)
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert (loaded.config.num_hidden_layers, loaded.config.hidden_size) == (2, 64)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token_id == loaded.config.eos_token_id
    # The task's words, as answers hold them (after a space), are whole tokens.
    assert len(tok(" bread mill river")["input_ids"]) == 3


def test_the_lm_eval_task_asks_each_held_out_question_as_fine_tuning_renders_it(tmp_path):
    """The tasks ``write`` puts in ``tasks/`` load in lm-eval, and their prompt is the
    default chat template's rendering of the held-out conversation up to the answer; the
    target is the answer the conversation holds, among near misses for the choice task."""
    from pathlib import Path

    import yaml

    from raylm.config import EvalConfig
    from raylm.data.chat import DefaultTemplate
    from raylm.examples.reverse_words import CHOICE_TASK, TASK
    from raylm.run.benchmarks import check_settings

    paths = write(tmp_path, train=5, heldout=3, pretrain=10)
    check_settings(EvalConfig(tasks=[TASK, CHOICE_TASK], include_path=paths["tasks"]))
    spec = yaml.safe_load((Path(paths["tasks"]) / f"{TASK}.yaml").read_text())
    rows = [json.loads(line) for line in open(Path(paths["tasks"]) / f"{TASK}.jsonl")]
    held = [json.loads(line)["messages"] for line in open(paths["heldout"])]
    assert len(rows) == len(held) == 3
    for row, messages in zip(rows, held, strict=True):
        prompt = "".join(s.text for s in DefaultTemplate().prompt(messages[:2]))
        assert spec["doc_to_text"].replace("{{words}}", row["words"]) == prompt
        assert row["answer"] == messages[2]["content"]
        # The multiple-choice twin: the answer among near misses, none of them right.
        assert row["choices"][row["label"]] == row["answer"]
        assert len(row["choices"]) == len(set(row["choices"])) >= 2
    assert spec["output_type"] == "generate_until" and spec["doc_to_target"] == "{{answer}}"
