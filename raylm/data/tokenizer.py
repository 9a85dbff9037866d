"""Tokenizers: train a byte-level BPE with `tokenizers`, or load an existing Hugging Face one.

A trained tokenizer is saved as a Hugging Face tokenizer directory (``tokenizer.json`` plus the
transformers config files), so ``AutoTokenizer.from_pretrained(dir)`` loads it. It is cached under
``cache_dir/tokenizers/<fingerprint>``, where the fingerprint covers the corpus files (path, size,
mtime) and every setting that changes the result, so a second ``prepare`` reuses it.

Training reads ``tokenizer.train_chars`` characters of kept documents. Files are visited in an
order fixed by a hash of their path, so the sample spans the whole corpus rather than its first
package, and is the same on every run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from raylm.data.chat import example_text, template_args
from raylm.data.corpus import SourceFile, read_examples, read_records

EOS_TOKEN = "<|endoftext|>"


def tokenizer_fingerprint(corpus_fingerprint: str, **settings) -> str:
    blob = json.dumps({"corpus": corpus_fingerprint, **settings}, sort_keys=True)
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


def sample_texts(
    files: list[SourceFile], *, num_chars: int, text_field: str, text_unit: str,
    examples: dict[str, str] | None = None,
) -> Iterator[str]:
    """Kept documents totalling about ``num_chars`` characters, in a deterministic order.
    Fine-tuning ``examples`` (their format and fields) are sampled as raylm's default chat
    template renders them."""

    order = sorted(files, key=lambda f: hashlib.blake2b(f.path.encode()).digest())
    seen = 0
    for f in order:
        records = (read_examples(f, **examples) if examples else
                   read_records(f, text_field=text_field, text_unit=text_unit))
        for rec in records:
            if rec.text is None:
                continue
            text = rec.text
            if examples:
                text = example_text(json.loads(text))
            yield text
            seen += len(rec.text)
            if seen >= num_chars:
                return


def train_bpe(texts: Iterator[str], *, vocab_size: int, min_frequency: int = 2):
    """A byte-level BPE (GPT-2 style pre-tokenization) with ``EOS_TOKEN`` as its only special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_hf_tokenizer(tok, directory: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )
    hf.save_pretrained(str(directory))


def build_tokenizer(
    files: list[SourceFile],
    *,
    corpus_fingerprint: str,
    cache_dir: Path,
    vocab_size: int,
    min_frequency: int,
    train_chars: int,
    text_field: str,
    text_unit: str,
    examples: dict[str, str] | None = None,
    log=print,
) -> Path:
    """Train (or reuse from the cache) a BPE tokenizer on ``files``; return its directory."""
    fp = tokenizer_fingerprint(
        corpus_fingerprint, vocab_size=vocab_size, min_frequency=min_frequency,
        train_chars=train_chars, text_field=text_field, text_unit=text_unit, eos=EOS_TOKEN,
        **(examples or {}),
    )
    target = cache_dir / "tokenizers" / fp
    if (target / "tokenizer.json").is_file():
        log(f"tokenizer: reusing {target}")
        return target
    read = {"documents": 0, "chars": 0}

    def counted(texts: Iterator[str]) -> Iterator[str]:
        for text in texts:
            read["documents"] += 1
            read["chars"] += len(text)
            yield text

    tok = train_bpe(
        counted(sample_texts(files, num_chars=train_chars, text_field=text_field,
                             text_unit=text_unit, examples=examples)),
        vocab_size=vocab_size, min_frequency=min_frequency,
    )
    # What it was trained on, not the budget (tokenizer.train_chars caps it).
    log(f"tokenizer: trained a byte-level BPE (vocab {vocab_size}) on {read['chars']:,} "
        f"characters of {read['documents']:,} documents")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so a concurrent or killed run never sees half a
    # tokenizer directory.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{fp}-"))
    save_hf_tokenizer(tok, tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process finished first: theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"tokenizer: saved {target}")
    return target


def load_tokenizer(path: str | Path, model: str | None = None):
    """transformers' tokenizer of the directory ``path`` as it loads beside the config of the
    model directory ``model``: for some families (Qwen2) it builds the family's own pipeline
    from the vocabulary whatever tokenizer.json says, and so does every client of the model's
    exports (AutoTokenizer, vLLM, llama.cpp through the GGUF export), so training does too."""
    from transformers import AutoConfig, AutoTokenizer

    config = None
    if model and Path(model, "config.json").is_file() and not Path(path, "config.json").is_file():
        config = AutoConfig.from_pretrained(str(model), trust_remote_code=False)
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, config=config)


def load_backend(path: str | Path, model: str | None = None):
    """(fast ``tokenizers.Tokenizer``, eos id) of :func:`load_tokenizer`."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ValueError(f"tokenizer.path: {p} is not a directory; point it at a Hugging Face "
                         f"tokenizer directory or leave it unset to train one.")
    try:
        hf = load_tokenizer(p, model)
    except Exception as e:  # transformers raises OSError/ValueError/KeyError for bad dirs
        raise ValueError(f"tokenizer.path: cannot load a tokenizer from {p}: {e}") from None
    if not getattr(hf, "is_fast", False):
        raise ValueError(f"tokenizer.path: {p} has no fast (Rust) tokenizer; raylm needs "
                         f"tokenizer.json to tokenize at speed.")
    if hf.eos_token_id is None:
        raise ValueError(f"tokenizer.path: the tokenizer at {p} has no EOS token; add one "
                         f"(eos_token in tokenizer_config.json) so documents can be separated.")
    return hf.backend_tokenizer, int(hf.eos_token_id)


def chat_template(path: str | os.PathLike) -> dict | None:
    """The chat template of the Hugging Face tokenizer at ``path``, as :class:`raylm.data.chat.
    JinjaTemplate` takes it; None when it has none (raylm's trained BPEs)."""
    from transformers import AutoTokenizer

    args = template_args(AutoTokenizer.from_pretrained(str(path), trust_remote_code=False))
    return args and {**args, "name": f"the chat template of {path}"}
