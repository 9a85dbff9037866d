"""A fine-tuning task the project makes itself, and greedy exact-match accuracy on it.

    python -m raylm.examples.reverse_words write --output data/reverse --train 4000 --heldout 200
    python -m raylm.examples.reverse_words model --data data/reverse --output runs/reverse-init
    python -m raylm.examples.reverse_words score runs/sft --data data/reverse/heldout.jsonl
    python -m raylm.examples.reverse_words prefer runs/dpo --data data/reverse/heldout_pairs.jsonl

The task: "Reverse the words: river mill bread" -> "bread mill river". The answer is a
deterministic function of the question, so accuracy is exact match of the greedy answer, and
the held-out questions are word sequences that no training question holds (checked), so a
model must have learned the rule, not the pairs. Words are common English nouns: a model
pretrained on English text has seen them, which is what fine-tuning starts from.

The model fine-tuned is pretrained here too, on the text ``write`` puts beside the task
(:func:`pretraining_text`), from the untrained 4-layer Llama and tokenizer ``model`` saves. Its
size is what a 2-core CPU pretrains in minutes and still learns to copy from its context with;
the tiny preset (2 layers of width 64) did not in 800 steps.
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


ADJECTIVES = ("old new small large quiet busy cold warm green dark bright empty full long short "
              "red blue heavy light").split()
VERBS = "saw found left passed built carried painted opened reached crossed".split()
PEOPLE = ["she", "he", "they", "we", "the teacher", "the farmer", "the sailor", "the baker"]
SENTENCES = (
    "the {a} near the {b} was {j}.",
    "{p} {v} the {a} by the {b}.",
    "there was a {j} {a} and a {b} in the {c}.",
    "after the {a} came the {b}, then the {c}.",
    "the {a} is {j}, but the {b} is {k}.",
    "{p} talked about the {a} and the {b} until {c}.",
)


def pretraining_text(documents: int, *, seed: int = 0) -> list[str]:
    """Paragraphs of simple English about the task's words, for pretraining the model that is
    fine-tuned: what a model pretrained on real text brings to fine-tuning, here in miniature.
    Each paragraph keeps to a few words, and lists a few of them twice in the same order (as
    prose does: "we bought bread, salt and tea ... in the end bread, salt and tea were still
    there"), so the model learns the words and to copy from its context. No paragraph lists
    the same words in reverse: the fine-tune is where reversing is taught."""
    rng = random.Random(seed)
    out = []
    for _ in range(documents):
        topic = rng.sample(WORDS, 5)
        sentences = []
        for _ in range(rng.randint(3, 6)):
            a, b, c = rng.sample(topic, 3)
            sentences.append(rng.choice(SENTENCES).format(
                a=a, b=b, c=c, j=rng.choice(ADJECTIVES), k=rng.choice(ADJECTIVES),
                v=rng.choice(VERBS), p=rng.choice(PEOPLE)))
        listed = rng.sample(topic, rng.randint(2, 4))
        items = ", ".join(listed[:-1]) + " and " + listed[-1]
        sentences.insert(rng.randint(0, len(sentences)),
                         f"{rng.choice(PEOPLE)} {rng.choice(VERBS)} {items}.")
        sentences.append(f"in the end {items} were still there.")
        out.append(" ".join(s[0].upper() + s[1:] for s in sentences))
    return out


def question(words: list[str]) -> str:
    return "Reverse the words: " + " ".join(words)


def answer(words: list[str]) -> str:
    return " ".join(reversed(words))


def conversation(words: list[str]) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": question(words)},
            {"role": "assistant", "content": answer(words)}]


def near_miss(words: list[str], rng: random.Random) -> str:
    """A wrong answer close to the right one, of the kinds a model that half learned the task
    gives: the words as asked (copied, not reversed), the reversal with two neighbours
    swapped, or with one word replaced by another of the task's words."""
    right = list(reversed(words))
    kind = rng.choice(("copied", "swapped", "replaced"))
    if kind == "copied":
        wrong = list(words)
    elif kind == "swapped":
        i = rng.randrange(len(right) - 1)
        wrong = right[:i] + [right[i + 1], right[i]] + right[i + 2:]
    else:
        i = rng.randrange(len(right))
        wrong = right[:i] + [rng.choice([w for w in WORDS if w not in words])] + right[i + 1:]
    return " ".join(wrong)


def pair(words: list[str], rng: random.Random) -> dict:
    """A preference pair: the question, the right reversal chosen, a near miss rejected."""
    return {"prompt": conversation(words)[:2], "chosen": answer(words),
            "rejected": near_miss(words, rng)}


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


def write(output: str | Path, *, train: int, heldout: int, pretrain: int = 20000,
          seed: int = 0) -> dict[str, str]:
    """``output/train.jsonl`` and ``output/heldout.jsonl`` in raylm's chat format, the same
    questions as preference pairs (``train_pairs.jsonl``, ``heldout_pairs.jsonl``: the right
    reversal chosen, a near miss rejected) and as prompts with their answers
    (``train_prompts.jsonl``, ``heldout_prompts.jsonl``: ``{"prompt": [...], "answer": ...}``
    rows, for ``train.objective=grpo``), ``output/pretrain.jsonl``, text for the model
    fine-tuned on them (``{"text": ...}`` rows), and ``output/tasks``, the held-out questions
    as an lm-eval task (:func:`write_task`)."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    tr, ho = make_split(train=train, heldout=heldout, seed=seed)
    paths = {"pretrain": str(out / "pretrain.jsonl")}
    Path(paths["pretrain"]).write_text("".join(
        json.dumps({"text": t}) + "\n" for t in pretraining_text(pretrain, seed=seed)))
    rng = random.Random(seed)
    for name, rows in (("train", tr), ("heldout", ho)):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"messages": conversation(w)}) + "\n" for w in rows))
        paths[name] = str(path)
        pairs = out / f"{name}_pairs.jsonl"
        pairs.write_text("".join(json.dumps(pair(w, rng)) + "\n" for w in rows))
        paths[f"{name}_pairs"] = str(pairs)
        prompts = out / f"{name}_prompts.jsonl"  # reinforcement learning's: exact_match
        prompts.write_text("".join(json.dumps({"prompt": conversation(w)[:2],
                                               "answer": answer(w)}) + "\n" for w in rows))
        paths[f"{name}_prompts"] = str(prompts)
    paths["tasks"] = str(write_task(out / "tasks", ho, seed=seed))
    return paths


TASK, CHOICE_TASK = "reverse_words", "reverse_words_choice"


def write_task(output: Path, questions: list[list[str]], *, seed: int = 0) -> Path:
    """An lm-eval task folder (``eval.include_path``) of two tasks on the held-out questions,
    each rendered as fine-tuning renders the conversation (raylm's default template, up to
    ``Assistant:``): ``reverse_words``, the greedy answer to its end of line, its leading
    space removed, scored by exact match as :func:`score` scores it; and
    ``reverse_words_choice``, the right reversal among up to three near misses as multiple
    choice (lm-eval writes each choice after the prompt and a space, as the template does)."""
    rng = random.Random(seed)
    rows = []
    for w in questions:
        wrong = sorted({near_miss(w, rng) for _ in range(12)} - {answer(w)})[:3]
        choices = [answer(w), *wrong]
        rng.shuffle(choices)
        rows.append({"words": " ".join(w), "answer": answer(w), "choices": choices,
                     "label": choices.index(answer(w))})
    output.mkdir(parents=True, exist_ok=True)
    data = output / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data.resolve()}\n"
              f"test_split: test\ndoc_to_text: \"System: {SYSTEM}\\n\\nUser: Reverse the "
              f"words: {{{{words}}}}\\n\\nAssistant:\"\n")
    (output / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n{common}output_type: generate_until\ndoc_to_target: \"{{{{answer}}}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  do_sample: false\n  max_gen_toks: 16\n"
        "metric_list:\n  - metric: exact_match\n    regexes_to_ignore: [\"^ \"]\n")
    (output / f"{CHOICE_TASK}.yaml").write_text(
        f"task: {CHOICE_TASK}\n{common}output_type: multiple_choice\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n")
    return output


def score(source: str | Path, data: str | Path, *, limit: int | None = None,
          max_new_tokens: int = 24) -> dict[str, float]:
    """Greedy exact-match accuracy of ``source`` (a run directory or a model directory) on the
    conversations of ``data``: the answer generated for each user turn (rendered as training
    rendered it) against the reference, both whitespace-normalized."""
    from raylm.formats.exporter import Generator

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


def preference(source: str | Path, data: str | Path, *, limit: int | None = None
               ) -> dict[str, float]:
    """Preference accuracy of ``source`` on the pairs of ``data``: the share of pairs whose
    chosen answer the model gives the higher log-probability (summed over the answer's tokens
    as training scores them), the answers' mean log-probabilities and the mean margin."""
    from raylm.formats.exporter import Generator

    rows = [json.loads(line) for line in Path(data).read_text().splitlines()]
    rows = rows[:limit] if limit else rows
    model = Generator(source)
    chosen = [model.answer_logp(r["prompt"], r["chosen"]) for r in rows]
    rejected = [model.answer_logp(r["prompt"], r["rejected"]) for r in rows]
    margins = [c - r for c, r in zip(chosen, rejected, strict=True)]
    n = max(len(rows), 1)
    return {"pairs": len(rows), "preference_accuracy": sum(m > 0 for m in margins) / n,
            "mean_chosen_logp": sum(chosen) / n, "mean_rejected_logp": sum(rejected) / n,
            "mean_logp_margin": sum(margins) / n}


def model(output: str | Path, data: str | Path, *, layers: int = 4, hidden: int = 128,
          heads: int = 4, seed: int = 0) -> Path:
    """An untrained Llama (``layers`` x ``hidden``, MLP 4 x hidden) with a BPE tokenizer
    trained on ``data/pretrain.jsonl``, saved as a pretrained model directory is: what
    ``raylm train --model.path=...`` pretrains on that text."""
    import torch

    from raylm.console import quiet_torchao
    from raylm.data.tokenizer import EOS_TOKEN, save_hf_tokenizer, train_bpe
    from raylm.model.spec import ModelSpec

    quiet_torchao()
    from transformers import AutoModelForCausalLM

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    texts = (json.loads(line)["text"] for line in
             (Path(data) / "pretrain.jsonl").read_text().splitlines())
    tok = train_bpe(texts, vocab_size=2048)
    config = ModelSpec(preset="tiny", vocab_size=tok.get_vocab_size(),
                       eos_id=tok.token_to_id(EOS_TOKEN)).transformers_config()
    config.update({"hidden_size": hidden, "intermediate_size": 4 * hidden,
                   "num_hidden_layers": layers, "num_attention_heads": heads,
                   "num_key_value_heads": heads, "head_dim": hidden // heads, "use_cache": True})
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    save_hf_tokenizer(tok, out)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m raylm.examples.reverse_words")
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write the reverse-words task as chat JSONL")
    w.add_argument("--output", required=True)
    w.add_argument("--train", type=int, default=4000)
    w.add_argument("--heldout", type=int, default=200)
    w.add_argument("--pretrain", type=int, default=20000, help="pretraining paragraphs")
    w.add_argument("--seed", type=int, default=0)
    m = sub.add_parser("model", help="an untrained 4-layer Llama and a tokenizer for the "
                                     "task's pretraining text")
    m.add_argument("--data", required=True, help="the directory `write` wrote")
    m.add_argument("--output", required=True)
    m.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("score", help="greedy exact-match accuracy on held-out conversations")
    s.add_argument("source", help="a run directory or a model directory")
    s.add_argument("--data", required=True)
    s.add_argument("--limit", type=int, default=None)
    f = sub.add_parser("prefer", help="held-out preference accuracy: how often the chosen "
                                      "answer is the more likely")
    f.add_argument("source", help="a run directory or a model directory")
    f.add_argument("--data", required=True, help="a pairs file (heldout_pairs.jsonl)")
    f.add_argument("--limit", type=int, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "write":
        print(json.dumps(write(args.output, train=args.train, heldout=args.heldout,
                               pretrain=args.pretrain, seed=args.seed)))
    elif args.command == "model":
        print(model(args.output, args.data, seed=args.seed))
    elif args.command == "prefer":
        print(json.dumps(preference(args.source, args.data, limit=args.limit)))
    else:
        print(json.dumps(score(args.source, args.data, limit=args.limit)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
