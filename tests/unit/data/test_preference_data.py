"""Preference pairs: checked (every bad row has its reason), rendered with the model's template
(only the answers trained, chosen marked 1 and rejected 2), and packed with both halves of a
pair in one block."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from raylm.data.chat import DefaultTemplate, answer_segments, encode, template_for
from raylm.data.corpus import parse_preference
from raylm.data.packing import ExamplePacker, position_ids
from raylm.data.preparation import ExampleRenderer
from tests.unit.data.test_chat import LLAMA_LIKE, hf_tokenizer, trained_text

CONTEXT = [{"role": "user", "content": "Reverse: a b"},
           {"role": "assistant", "content": "b a"},
           {"role": "user", "content": "Reverse: c d e"}]


@pytest.mark.parametrize("row, reason", [
    ((None, "x", "y"), "missing_field"),
    (("q", None, "y"), "missing_field"),
    (("q", 3, "y"), "malformed"),
    (([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "x", "y"),
     "malformed"),  # the prompt ends with an answer already
    (([{"role": "tool", "content": "q"}], "x", "y"), "unknown_role"),
    ((CONTEXT, [{"role": "user", "content": "x"}], "y"), "malformed"),  # answers: assistant turns
    (("q", [{"role": "assistant", "content": "x"}], "y"), "malformed"),  # a string's: strings
    (("q", " ", "y"), "empty"),
    (("q", "Paris.", " Paris.\n"), "identical_answers"),  # the same once normalized
])
def test_each_bad_pair_has_its_reason(row, reason):
    assert parse_preference(*row) == (None, reason)


def test_string_and_conversation_prompts_and_answers():
    pair, reason = parse_preference("Capital of France?", "Paris.", "Lyon.")
    assert reason is None and pair == {"prompt": "Capital of France?", "chosen": "Paris.",
                                       "rejected": "Lyon."}
    # A run started before strings were used as written reads them as one turn each.
    pair, reason = parse_preference("Capital of France?", "Paris.", "Lyon.", "user_turn")
    assert reason is None and pair == {
        "prompt": [{"role": "user", "content": "Capital of France?"}],
        "chosen": [{"role": "assistant", "content": "Paris."}],
        "rejected": [{"role": "assistant", "content": "Lyon."}]}
    pair, _ = parse_preference(CONTEXT, [{"role": "assistant", "content": "e d c"}], "e c d")
    assert pair["prompt"] == CONTEXT and pair["rejected"][0]["content"] == "e c d"


@pytest.mark.parametrize("jinja", [False, True])
def test_only_the_answer_is_trained_not_the_prompts_assistant_turns(tok, tokenizer_dir, jinja):
    eos = tok.token_to_id("<|endoftext|>")
    template = template_for(hf_tokenizer(tokenizer_dir, LLAMA_LIKE)) if jinja \
        else DefaultTemplate()
    answer = [{"role": "assistant", "content": "e d c"}]
    ids, mask = encode(answer_segments(template, CONTEXT, answer), tok, eos_id=eos,
                       loss_on="assistant")
    # The conversation's text is rendered whole, its earlier answer ("b a") as context.
    whole, whole_mask = encode(template.segments([*CONTEXT, *answer]), tok, eos_id=eos,
                               loss_on="assistant")
    assert ids.tolist() == whole.tolist()
    assert trained_text(tok, whole, whole_mask, eos)[0].lstrip().startswith("b a")
    assert trained_text(tok, ids, mask, eos) == (["e d c[end]\n"] if jinja else [" e d c<eos>"])


def renderer(tok, block_length: int) -> ExampleRenderer:
    return ExampleRenderer(
        example_format="preference", messages_field="messages", prompt_field="prompt",
        completion_field="completion", chosen_field="chosen", rejected_field="rejected",
        chat_template=None, loss_on="assistant", block_length=block_length,
        long_examples="truncate", tokenizer=tok, eos_id=tok.token_to_id("<|endoftext|>"))


def test_a_pair_renders_as_two_halves_and_is_never_cut(tok):
    user = [{"role": "user", "content": "Reverse: a b c"}]
    rows = [parse_preference(user, "c b a", "c a b")[0],
            parse_preference("Reverse: " + "word " * 40, "x", "y")[0]]
    table = pa.table({"text": [json.dumps(r) for r in rows],
                      "reason": pa.array([None, None], pa.string())})
    out = renderer(tok, block_length=64)(table)
    # The long pair does not fit a block whole: dropped, though long_examples is truncate.
    assert out.column("reason").to_pylist() == [None, "too_long"]
    ids = np.array(out.column("ids")[0].as_py())
    mask = np.array(out.column("loss_mask")[0].as_py())
    split = out.column("split")[0].as_py()
    eos = tok.token_to_id("<|endoftext|>")
    assert trained_text(tok, ids[:split], mask[:split], eos) == [" c b a<eos>"]
    assert set(mask[:split]) == {0, 1} and set(mask[split:]) == {0, 2}
    assert trained_text(tok, ids[split:], mask[split:] > 0, eos) == [" c a b<eos>"]
    # Both halves start with the same prompt.
    prompt = int(np.argmax(mask[:split] > 0))
    assert ids[:prompt].tolist() == ids[split:split + prompt].tolist()


def test_the_packer_keeps_a_pair_in_one_block_as_two_documents():
    def pair(n: int, split: int):
        mask = np.zeros(n, np.uint8)
        mask[split - 2:split], mask[n - 2:] = 1, 2
        return np.arange(1, n + 1, dtype=np.int32), mask, split

    packer = ExamplePacker(16, pad_id=0)
    blocks, starts, masks, sources = packer.add([pair(8, 4), pair(10, 5)],
                                                np.array([7, 8], np.int64))
    # The second pair does not fit beside the first: the first block is closed and padded.
    assert len(blocks) == 1 and starts[0].tolist() == [0, 4, 8]
    assert sources[0].tolist() == [7, 7, -1]  # both halves come from the same row
    assert position_ids(starts[0], 16).tolist() == [0, 1, 2, 3, 0, 1, 2, 3,
                                                    0, 1, 2, 3, 4, 5, 6, 7]
    blocks, starts, masks, _ = packer.finish()
    assert starts[0].tolist() == [0, 5, 10] and masks[0][5] == 0
    assert packer.trained_tokens == 8  # marks 1 and 2 each count once
