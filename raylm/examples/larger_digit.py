"""A reinforcement-learning task the project makes itself: "Which is larger: 3 or 7?", and a
tiny model that knows the answer's form but not the rule.

    python -m raylm.examples.larger_digit write --output data/larger
    raylm train --config jobs/configs/grpo_larger_digit.yaml

``write`` puts two things under ``--output``: ``prompts.jsonl``, the 90 questions over two
different digits with their answers (``{"prompt": [{"role": "user", ...}], "answer": "7"}``
rows: one user turn each, as the model was taught, rendered with its chat template; rewarded
by ``exact_match``), and ``model/``, the tiny Llama preset (2 layers of width 64) with a BPE
tokenizer trained on the task's text, taught in this process for 150 steps to answer with one
of the question's two digits, at random. It starts about half right; only the reward can teach
it which digit. Seconds on a CPU; the model is what a fine-tuned model's format is to
reinforcement learning, in miniature.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

PAIRS = [(a, b) for a in range(10) for b in range(10) if a != b]
MARKER = "task.json"  # what proves an output directory is this module's


def question(a: int, b: int) -> str:
    return f"Which is larger: {a} or {b}?"


def write(output: str | Path, *, steps: int = 150, seed: int = 0) -> dict[str, str]:
    """The prompts and the warmed-up model (see the module's docstring), built beside
    ``output`` and renamed into place: an existing ``output`` is replaced only if this wrote
    it."""
    from raylm.outputs import building, check_output, publish

    final = check_output(output, what="--output", marker=MARKER, key="task")
    with building(final) as out:
        _write(out, steps=steps, seed=seed)
    publish(out, final, mine=(MARKER, "task"))
    return {"prompts": str(final / "prompts.jsonl"), "model": str(final / "model")}


def _write(out: Path, *, steps: int, seed: int) -> None:
    import torch
    from tokenizers import Tokenizer

    from raylm.console import quiet_model_io, quiet_torchao
    from raylm.data.chat import DefaultTemplate, encode
    from raylm.data.tokenizer import save_hf_tokenizer, train_bpe

    quiet_torchao()  # before transformers' model code imports it
    from raylm.model.spec import ModelSpec
    from raylm.workers.step import train_step

    texts = [f"User: {question(a, b)}\n\nAssistant: {c}" for a, b in PAIRS for c in (a, b)]
    save_hf_tokenizer(train_bpe(iter(texts * 3), vocab_size=300, min_frequency=2),
                      out / "model")
    tok = Tokenizer.from_file(str(out / "model" / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    built = ModelSpec(preset="tiny", vocab_size=tok.get_vocab_size(), eos_id=eos,
                      precision="fp32", cross_document=False, seed=seed
                      ).build(torch.device("cpu"))
    optimizer = torch.optim.AdamW(built.model.parameters(), lr=3e-3)
    rng, width = random.Random(seed), 48
    for _ in range(steps):
        rows = []
        for a, b in rng.sample(PAIRS, 16):
            ids, mask = encode(DefaultTemplate().segments(
                [{"role": "user", "content": question(a, b)},
                 {"role": "assistant", "content": str(rng.choice([a, b]))}]),
                tok, eos_id=eos, loss_on="assistant")
            n = len(ids)
            rows.append((list(ids) + [eos] * (width - n), [0, *mask[1:]] + [0] * (width - n),
                         list(range(n)) + list(range(width - n))))
        train_step(built, optimizer, [{
            "input_ids": torch.tensor([r[0] for r in rows]),
            "loss_mask": torch.tensor([r[1] for r in rows], dtype=torch.uint8),
            "position_ids": torch.tensor([r[2] for r in rows])}], accumulation=1,
            grad_clip=1.0, cross_document=False)
    built.model.lm_head.__class__ = torch.nn.Linear  # the plain head, as transformers saves
    with quiet_model_io():
        built.model.save_pretrained(out / "model")
    (out / "prompts.jsonl").write_text("".join(json.dumps(
        {"prompt": [{"role": "user", "content": question(a, b)}], "answer": str(max(a, b))})
        + "\n" for a, b in PAIRS))
    (out / MARKER).write_text(json.dumps({"task": "larger_digit", "steps": steps,
                                          "seed": seed}))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m raylm.examples.larger_digit")
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="the task's prompts and a model that knows its form")
    w.add_argument("--output", required=True)
    w.add_argument("--steps", type=int, default=150, help="the model's warm-up steps")
    w.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    from raylm.outputs import OutputError

    args = parser().parse_args(argv)
    try:
        print(json.dumps(write(args.output, steps=args.steps, seed=args.seed)))
    except OutputError as e:
        print(f"larger_digit: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
