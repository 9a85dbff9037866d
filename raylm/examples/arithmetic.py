"""A GSM8K-style prompt set the project makes itself: two- and three-number sums and products
("What is 17 + 25 * 3?"), each row's ``answer`` the number, for the ``final_number`` reward
(the completion's last number against the answer), as GRPO recipes for reasoning models train.
Each prompt is one user turn (a list of messages), rendered with the model's chat template.

    python -m raylm.examples.arithmetic write --output data/arithmetic
    raylm train --config jobs/configs/grpo_one_gpu.yaml   # needs a GPU and the network

``write`` puts ``prompts.jsonl`` under ``--output``: ``--rows`` questions (2,000 by default)
of operands up to ``--largest``, seeded, no question twice. Written by hand: a task needs no
download, so a run or a benchmark of GRPO on a machine without the network has one.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

MARKER = "task.json"  # what proves an output directory is this module's
INSTRUCTION = "Think briefly, then end with the answer as a number."


def value(terms: list[int], ops: list[str]) -> int:
    """``terms`` joined by ``ops`` (+, -, *), ``*`` first as arithmetic reads it."""
    parts = [terms[0]]
    for op, t in zip(ops, terms[1:], strict=True):
        if op == "*":
            parts[-1] *= t
        else:
            parts.append(t if op == "+" else -t)
    return sum(parts)


def questions(rows: int, *, largest: int = 99, seed: int = 0) -> list[dict]:
    """``rows`` distinct questions with their answers, in a seeded order."""
    rng = random.Random(seed)
    seen: dict[str, str] = {}
    while len(seen) < rows:
        terms = [rng.randint(1, largest) for _ in range(rng.choice((2, 3)))]
        ops = [rng.choice("+-*") for _ in terms[1:]]
        text = " ".join([str(terms[0]), *(f"{o} {t}" for o, t in zip(ops, terms[1:],
                                                                       strict=True))])
        seen.setdefault(text, str(value(terms, ops)))
    return [{"prompt": [{"role": "user", "content": f"What is {q}? {INSTRUCTION}"}], "answer": a}
            for q, a in seen.items()]


def write(output: str | Path, *, rows: int = 2000, largest: int = 99, seed: int = 0
          ) -> dict[str, str]:
    """The prompts under ``output`` (built beside it and renamed into place; an existing
    ``output`` is replaced only if this wrote it)."""
    from raylm.outputs import building, check_output, publish

    final = check_output(output, what="--output", marker=MARKER, key="task")
    with building(final) as out:
        lines = [json.dumps(r) for r in questions(rows, largest=largest, seed=seed)]
        (out / "prompts.jsonl").write_text("\n".join(lines) + "\n")
        (out / MARKER).write_text(json.dumps({"task": "arithmetic", "rows": rows,
                                              "largest": largest, "seed": seed}))
    publish(out, final, mine=(MARKER, "task"))
    return {"prompts": str(final / "prompts.jsonl")}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m raylm.examples.arithmetic")
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write the prompts")
    w.add_argument("--output", required=True)
    w.add_argument("--rows", type=int, default=2000)
    w.add_argument("--largest", type=int, default=99)
    w.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    print(write(args.output, rows=args.rows, largest=args.largest, seed=args.seed)["prompts"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
