"""Prompts for reinforcement learning: read with their whole rows (kept as JSON in the blocks,
for the reward), rendered as the model is asked to answer them (nothing trained), one a
block, never cut."""

from __future__ import annotations

import datetime
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raylm.data.chat import DefaultTemplate, encode
from raylm.data.corpus import SourceError, SourceFile, read_examples
from raylm.data.packing import ExamplePacker
from raylm.data.preparation import ExampleRenderer


def test_prompts_are_read_as_conversations_and_rows_keep_every_column(tmp_path):
    rows = [{"prompt": "2+2?", "answer": "4"},
            {"prompt": [{"role": "system", "content": "Be short."},
                        {"role": "user", "content": "3+3?"}], "answer": "6"},
            {"prompt": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a"}], "answer": "x"},
            {"question": "no prompt"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = list(read_examples(SourceFile(str(path), "jsonl"), example_format="prompt",
                             strings="as_written"))
    assert [r.reason for r in got] == [None, None, "malformed", "missing_field"]
    assert json.loads(got[0].text) == "2+2?"  # a string prompt is used as written
    assert json.loads(got[1].text)[0]["role"] == "system"
    assert [json.loads(r.row) if r.row else None for r in got] == [*rows[:2], None, None]
    # A run started before that rule read a string as one user turn, and still does.
    old = list(read_examples(SourceFile(str(path), "jsonl"), example_format="prompt"))
    assert json.loads(old[0].text) == [{"role": "user", "content": "2+2?"}]
    assert [r.text for r in old[1:]] == [r.text for r in got[1:]]
    day = datetime.date(2026, 12, 1)
    pq.write_table(pa.Table.from_pylist([{**rows[0], "day": day, "n": 1},
                                         {"prompt": "3+3?", "answer": "6", "day": day, "n": 2}]),
                   tmp_path / "p.parquet")
    got = list(read_examples(SourceFile(str(tmp_path / "p.parquet"), "parquet"),
                             example_format="prompt"))
    assert [r.line for r in got] == [1, 2]
    assert json.loads(got[1].row) == {"prompt": "3+3?", "answer": "6", "day": "2026-12-01",
                                      "n": 2}
    # What JSON cannot hold is refused by its column, before any block is written.
    pq.write_table(pa.table({"prompt": ["q"], "blob": [b"\x00"]}), tmp_path / "b.parquet")
    with pytest.raises(SourceError, match=r"b\.parquet:1: column 'blob' holds a bytes"):
        list(read_examples(SourceFile(str(tmp_path / "b.parquet"), "parquet"),
                           example_format="prompt"))


def test_a_prompt_renders_as_the_generation_prompt_untrained_and_fills_a_block(tok):
    eos = tok.token_to_id("<|endoftext|>")
    renderer = ExampleRenderer(
        example_format="prompt", messages_field="messages", prompt_field="prompt",
        completion_field="completion", chat_template=None, loss_on="assistant",
        block_length=32, long_examples="truncate", tokenizer=tok, eos_id=eos)
    prompts = [[{"role": "user", "content": "Reverse: a b"}],
               [{"role": "user", "content": "Reverse: " + "word " * 40}]]
    out = renderer(pa.table({"text": [json.dumps(p) for p in prompts],
                             "reason": pa.array([None, None], pa.string())}))
    assert out.column("reason").to_pylist() == [None, "too_long"]  # never cut
    ids = np.asarray(out.column("ids")[0].as_py())
    want, _ = encode(DefaultTemplate().prompt(prompts[0]), tok, eos_id=eos, loss_on="all")
    assert ids.tolist() == want.tolist()
    assert tok.decode(ids.tolist()).endswith("Assistant:")
    assert not any(out.column("loss_mask")[0].as_py())
    # A string prompt is given to the model as it is written; the column says which is which.
    out = renderer(pa.table({"text": [json.dumps("Reverse: a b"), json.dumps(prompts[0])],
                             "reason": pa.array([None, None], pa.string())}))
    assert tok.decode(out.column("ids")[0].as_py()) == "Reverse: a b"
    assert out.column("ids")[1].as_py() == ids.tolist()
    assert out.column("as_written").to_pylist() == [True, False]

    packer = ExamplePacker(32, pad_id=eos, one_per_block=True)
    short = (ids[:5], np.zeros(5, np.uint8))
    blocks, starts, masks, _ = packer.add([(ids, np.zeros(len(ids), np.uint8)), short, short])
    last, last_starts, _, _ = packer.finish()
    assert len(blocks) == 2 and len(last) == 1  # three prompts, three blocks
    assert blocks[0][:len(ids)].tolist() == ids.tolist()
    assert starts[1].tolist() == [0, 5] and not masks.any()  # the prompt, then padding
