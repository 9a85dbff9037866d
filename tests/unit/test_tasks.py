"""The generated fine-tuning task: distinct held-out questions and the exact-match scorer."""

from __future__ import annotations

import json

from raylm.chat import parse_messages
from raylm.tasks import answer, make_split, write


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

    from raylm.model import build_config
    from raylm.tasks import score

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
