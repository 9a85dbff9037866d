"""A fine-tuning task the project makes itself, and greedy exact-match accuracy on it.

    python -m raylm.tasks write --output data/reverse --train 4000 --heldout 200
    python -m raylm.tasks score runs/sft --data data/reverse/heldout.jsonl

The task: "Reverse the words: river mill bread" -> "bread mill river". The answer is a
deterministic function of the question, so accuracy is exact match of the greedy answer, and
the held-out questions are word sequences that no training question holds (checked), so a
model must have learned the rule, not the pairs. Words are common English nouns: a model
pretrained on English text has seen them, which is what fine-tuning starts from.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

WORDS = (
    "river mill grain window letter winter village story ship storm market bread garden "
    "bridge lantern harbor mountain forest valley island castle tower road city train "
    "station paper stone water fire cloud rain snow summer morning evening night house door "
    "table chair book pencil teacher student doctor farmer baker sailor king queen horse "
    "bird fish apple orange lemon coffee tea sugar salt honey"
).split()
SYSTEM = "Reverse the order of the words."


def question(words: list[str]) -> str:
    return "Reverse the words: " + " ".join(words)


def answer(words: list[str]) -> str:
    return " ".join(reversed(words))


def conversation(words: list[str]) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": question(words)},
            {"role": "assistant", "content": answer(words)}]


def make_split(*, train: int, heldout: int, seed: int = 0, min_words: int = 2,
               max_words: int = 4) -> tuple[list[list[str]], list[list[str]]]:
    """Distinct word sequences: ``train`` for training, ``heldout`` that no training one
    equals."""
    rng = random.Random(seed)
    seen: set[tuple[str, ...]] = set()
    out: list[list[str]] = []
    while len(out) < train + heldout:
        words = rng.sample(WORDS, rng.randint(min_words, max_words))
        if tuple(words) not in seen:
            seen.add(tuple(words))
            out.append(words)
    return out[:train], out[train:]


def write(output: str | Path, *, train: int, heldout: int, seed: int = 0) -> dict[str, str]:
    """``output/train.jsonl`` and ``output/heldout.jsonl`` in raylm's chat format."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    tr, ho = make_split(train=train, heldout=heldout, seed=seed)
    paths = {}
    for name, rows in (("train", tr), ("heldout", ho)):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"messages": conversation(w)}) + "\n" for w in rows))
        paths[name] = str(path)
    return paths


def score(source: str | Path, data: str | Path, *, limit: int | None = None,
          max_new_tokens: int = 24) -> dict[str, float]:
    """Greedy exact-match accuracy of ``source`` (a run directory or a model directory) on the
    conversations of ``data``: the answer generated for each user turn (rendered as training
    rendered it) against the reference, both whitespace-normalized."""
    from raylm.export import Generator

    rows = [json.loads(line)["messages"] for line in Path(data).read_text().splitlines()]
    rows = rows[:limit] if limit else rows
    model = Generator(source)
    correct = 0
    for messages in rows:
        asked = messages[:-1]  # up to the user turn
        want = messages[-1]["content"]
        got = model.answer(asked, temperature=0, max_new_tokens=max_new_tokens)
        correct += " ".join(got.split()) == " ".join(want.split())
    return {"examples": len(rows), "exact_match": correct / len(rows) if rows else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m raylm.tasks")
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write the reverse-words task as chat JSONL")
    w.add_argument("--output", required=True)
    w.add_argument("--train", type=int, default=4000)
    w.add_argument("--heldout", type=int, default=200)
    w.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("score", help="greedy exact-match accuracy on held-out conversations")
    s.add_argument("source", help="a run directory or a model directory")
    s.add_argument("--data", required=True)
    s.add_argument("--limit", type=int, default=None)
    args = p.parse_args(argv)
    if args.command == "write":
        print(json.dumps(write(args.output, train=args.train, heldout=args.heldout,
                               seed=args.seed)))
    else:
        print(json.dumps(score(args.source, args.data, limit=args.limit)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
