"""The arithmetic prompt set (raylm.examples.arithmetic): distinct questions whose answers are
their values, as the final_number reward reads a completion's last number."""

from __future__ import annotations

import json
import re

from raylm.examples.arithmetic import main, questions
from raylm.rollout.rewards import final_number


def test_questions_are_distinct_and_answered_by_their_value(tmp_path):
    rows = questions(500, largest=20, seed=3)
    texts = [r["prompt"][0]["content"] for r in rows]
    assert all(r["prompt"] == [{"role": "user", "content": t}]
               for r, t in zip(rows, texts, strict=True))
    assert len(set(texts)) == 500 and rows == questions(500, largest=20, seed=3)
    for r, text in zip(rows, texts, strict=True):
        terms = re.match(r"What is (.+)\?", text).group(1).split()
        # Products first, then sums and differences, as arithmetic reads them.
        total, sign, product = 0, 1, int(terms[0])
        for op, t in zip(terms[1::2], map(int, terms[2::2]), strict=True):
            if op == "*":
                product *= t
            else:
                total, sign, product = total + sign * product, 1 if op == "+" else -1, t
        assert int(r["answer"]) == total + sign * product, r
        assert final_number(r["prompt"], f"so the answer is {r['answer']}",
                            answer=r["answer"]) == 1.0
    assert main(["write", "--output", str(tmp_path / "a"), "--rows", "30"]) == 0
    written = (tmp_path / "a" / "prompts.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in written] == questions(30)
