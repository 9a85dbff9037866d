"""Packed tokens/s of raylm's preparation (Ray tasks) against ``datasets.Dataset.map``.

Both sides start from the same JSONL shards and the same tokenizer, and end with fixed-length
blocks of ``seq_len + 1`` tokens:

- raylm: ``raylm.data.preparation.prepare`` (read, normalize, filter, dedup, tokenize, EOS, pack,
  write Parquet), timed from call to manifest, on a local Ray cluster started (and timed) once.
- baseline: the Hugging Face ``run_clm`` recipe: ``load_dataset("json")``, ``map(tokenize,
  batched=True, num_proc=N)``, ``map(group_texts, batched=True, num_proc=N)``, with a fresh
  cache each time so nothing is reused, timed from ``load_dataset`` to the last block.

The corpus is the builtin one (docstrings of installed packages) with exact duplicates removed
beforehand, so both sides pack the same documents and the same number of tokens. Each side runs
once untimed (reported as ``cold_seconds``: the first run also starts Ray's worker processes,
or forks and warms the baseline's), then ``repeats`` times alternating; the median counts.
``ratio`` = raylm tokens/s / baseline tokens/s.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from raylm.config import load_config
from raylm.data.corpus import (
    builtin_files,
    content_hash,
    fingerprint_files,
    read_records,
    resolve_sources,
)
from raylm.data.preparation import prepare
from raylm.data.tokenizer import build_tokenizer


def write_corpus(packages: list[str], root: Path, num_files: int) -> dict[str, Any]:
    files = builtin_files(packages)
    seen: set[int] = set()
    docs = []
    for f in files:
        for r in read_records(f):
            if r.text and content_hash(r.text) not in seen:
                seen.add(content_hash(r.text))
                docs.append(r.text)
    outs = [open(root / f"part-{i:03d}.jsonl", "w") for i in range(num_files)]
    for i, d in enumerate(docs):
        outs[i * num_files // len(docs)].write(json.dumps({"text": d}) + "\n")
    for f in outs:
        f.close()
    return {"documents": len(docs), "chars": sum(map(len, docs)), "files": num_files,
            "packages": packages}


def raylm_once(corpus: Path, tokenizer: Path, seq_len: int, workdir: Path) -> dict[str, Any]:

    cfg = load_config(None, [f"--data.source={corpus}", f"--tokenizer.path={tokenizer}",
                             f"--data.seq_len={seq_len}", f"--run.cache_dir={workdir}/cache"])
    t = time.perf_counter()
    m = prepare(cfg, workdir / "raylm-out", log=lambda s: None)
    return {"seconds": time.perf_counter() - t, "tokens": m["tokens"], "blocks": m["blocks"]}


def baseline_once(corpus: Path, tokenizer: Path, seq_len: int, num_proc: int,
                  workdir: Path) -> dict[str, Any]:
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer), trust_remote_code=False)
    eos = tok.eos_token_id
    block = seq_len + 1

    def tokenize(batch):
        ids = tok(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    def group_texts(batch):
        flat = [t for ids in batch["input_ids"] for t in ids]
        n = len(flat) // block * block
        return {"input_ids": [flat[i:i + block] for i in range(0, n, block)]}

    cache = workdir / "hf-cache"
    shutil.rmtree(cache, ignore_errors=True)
    files = sorted(str(p) for p in corpus.glob("*.jsonl"))
    datasets.disable_progress_bars()
    t = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir=str(cache))
    ds = ds.map(tokenize, batched=True, num_proc=num_proc, remove_columns=ds.column_names,
                load_from_cache_file=False)
    packed = ds.map(group_texts, batched=True, num_proc=num_proc, load_from_cache_file=False)
    seconds = time.perf_counter() - t
    # Counted after the clock stops: bookkeeping for this report, not part of the recipe.
    tokens = sum(len(x) for x in ds["input_ids"])
    return {"seconds": seconds, "tokens": tokens, "blocks": len(packed)}


def _summary(cold: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = statistics.median(r["seconds"] for r in runs)
    tokens = runs[0]["tokens"]
    return {"tokens": tokens, "blocks": runs[0]["blocks"], "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds), "runs_s": [round(r["seconds"], 2)
                                                               for r in runs],
            "cold_seconds": round(cold["seconds"], 2)}


def run(*, packages: list[str], num_files: int, seq_len: int, num_proc: int, repeats: int,
        workdir: str | None) -> dict[str, Any]:
    import ray


    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="raylm-bench-"))
    corpus = root / "corpus"
    shutil.rmtree(corpus, ignore_errors=True)
    corpus.mkdir(parents=True)
    info = write_corpus(packages, corpus, num_files)
    files = resolve_sources(str(corpus), builtin_packages=[])
    tok = build_tokenizer(files, corpus_fingerprint=fingerprint_files(files),
                          cache_dir=root / "cache", vocab_size=8192, min_frequency=2,
                          train_chars=8_000_000, text_field="text", text_unit="paragraph",
                          log=lambda s: None)
    t = time.perf_counter()
    # address="local": a new cluster, timed, never a head another process recorded.
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    init_s = time.perf_counter() - t

    def ours():
        return raylm_once(corpus, tok, seq_len, root)

    def theirs():
        return baseline_once(corpus, tok, seq_len, num_proc, root)

    cold_ours, cold_theirs = ours(), theirs()
    runs_ours, runs_theirs = [], []
    for _ in range(repeats):
        runs_ours.append(ours())
        runs_theirs.append(theirs())
    ray.shutdown()
    a, b = _summary(cold_ours, runs_ours), _summary(cold_theirs, runs_theirs)
    a["ray_init_s"] = round(init_s, 2)
    b["num_proc"] = num_proc
    return {
        "benchmark": "data",
        "metric": "packed tokens/s (tokens entering packing per wall second, median of runs)",
        "corpus": info,
        "seq_len": seq_len,
        "raylm": a,
        "baseline": b,
        "ratio": round(a["tokens_per_s"] / b["tokens_per_s"], 3),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
