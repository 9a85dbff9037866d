"""Shared fixtures: a small corpus made here (no downloads) and a tokenizer trained on it."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

# No usage statistics leave the tests (Ray Data's collector also queries a Prometheus on
# localhost:9090 that the tests do not run, and logs the refusal at interpreter exit).
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# Real English prose, written for these tests; enough distinct words to train a small BPE.
PARAGRAPHS = [
    "The river carried the boats past the old mill, where the miller counted sacks of grain "
    "and wrote the numbers in a book that nobody else was allowed to read.",
    "Training a language model means showing it text and asking it to guess the next token; "
    "the loss measures how surprised it was, and the optimizer nudges every weight a little.",
    "A cluster is only as useful as its scheduler: jobs that ask for the right resources start "
    "quickly, while jobs that ask for too much wait for machines that may never come.",
    "She opened the window, listened to the rain on the roof, and decided that the letter "
    "could wait until morning, when the post office would open again.",
    "Checkpoints record where training stood, so that a failure costs minutes instead of days; "
    "the data position belongs in them as much as the weights do.",
    "In winter the village gathered in the hall to hear stories about ships, storms, distant "
    "harbours and the sailors who never came home.",
    "Every tokenizer makes a trade between vocabulary size and sequence length: more merges "
    "mean shorter sequences but a larger embedding table.",
    "The library closed at six, but the caretaker let students stay until the last of them "
    "had finished reading the chapter on thermodynamics.",
]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device; elsewhere they are skipped, saying so."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU time of the whole machine so far, in jiffies (Linux), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields) - idle, sum(fields)


_cpu_busy: dict[str, tuple[float, float]] = {}
_EXIT_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """How busy the machine's CPUs were while each test ran (setup and teardown included):
    the slow tests that leave them idle wait on something (a poll, a timeout), those near 100%
    pay for processes and imports."""
    start, t0 = _cpu_jiffies(), time.perf_counter()
    try:
        return (yield)
    finally:
        end = _cpu_jiffies()
        if start and end and end[1] > start[1]:
            _cpu_busy[item.nodeid] = (time.perf_counter() - t0,
                                      (end[0] - start[0]) / (end[1] - start[1]))


def pytest_terminal_summary(terminalreporter):
    slowest = sorted(_cpu_busy.items(), key=lambda kv: -kv[1][0])[:25]
    if not slowest:
        return
    terminalreporter.section("slowest tests: wall time and how busy the CPUs were")
    for nodeid, (wall, busy) in slowest:
        terminalreporter.write_line(f"{wall:8.1f}s  {busy:4.0%} busy  {nodeid}")


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the suite's process as ``raylm`` ends its own (:func:`raylm.cli.run`): the exit
    handlers run (Ray's disconnect, MLflow's and logging's flushes) and the interpreter's
    teardown is skipped. That teardown frees every object of a process that has run Ray, torch,
    Arrow and llama.cpp in it, and a native library's destructor once crashed there (SIGSEGV
    after "815 passed"), failing a suite that had passed; a crash in an exit handler still
    prints its stack."""
    import faulthandler
    import threading

    status = config.stash.get(_EXIT_STATUS, None)
    if status is None or any(t.is_alive() and not t.daemon and t is not threading.main_thread()
                             for t in threading.enumerate()):
        return  # no session ran, or a thread Python would wait for: the normal exit
    from raylm.compat import _run_exitfuncs

    faulthandler.enable(file=sys.__stderr__)
    sys.stdout.flush()
    sys.stderr.flush()
    _run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@pytest.fixture
def ray_never_starts(monkeypatch):
    """Fail any test that starts Ray: the refusals it checks must come first."""
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", no_ray)


def save_tiny_llama(out: Path, *, vocab_size: int, seed: int = 0) -> Path:
    """The tiny preset, randomly initialized and saved with save_pretrained: a pretrained model
    directory as fine-tuning reads one."""
    import torch
    from transformers import AutoModelForCausalLM

    from raylm.model.build import build_config

    config = build_config(preset="tiny", path=None, vocab_size=vocab_size, eos_id=0,
                          attn_implementation="sdpa")
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    return out


def save_tiny_qwen3(out: Path, *, vocab_size: int, seed: int = 0, zero: bool = False,
                    poison: int | None = None) -> Path:
    """The tiny preset's shape as a Qwen3 (its own attention with per-head query and key norms):
    a family other than Llama, saved with save_pretrained. ``zero``: every weight 0, as a load
    that set nothing leaves a model. ``poison``: a token whose input embedding is NaN, so
    that any block holding it has a NaN loss (the untied output head keeps the rest finite)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                         intermediate_size=256, max_position_embeddings=1024,
                         tie_word_embeddings=False, eos_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        if zero:
            for p in model.parameters():
                p.zero_()
        if poison is not None:
            model.model.embed_tokens.weight[poison] = float("nan")
    model.save_pretrained(str(out))
    return out


def floats(values) -> tuple[float, ...]:
    """``train_step``'s (loss, grad norm) tensors as Python floats."""
    return tuple(float(v) for v in values)


def tokenizer_vocab(tokenizer_dir: Path) -> int:
    return len(json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"])


def make_docs(n: int, *, tag: str = "") -> list[str]:
    """``n`` distinct documents built from the paragraphs above."""
    out = []
    for i in range(n):
        a, b = PARAGRAPHS[i % len(PARAGRAPHS)], PARAGRAPHS[(i * 3 + 1) % len(PARAGRAPHS)]
        out.append(f"{tag}Document {i}. {a} {b}")
    return out


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def tiny_run(root: Path, tokenizer_dir: Path, *, docs: int = 400) -> list[str]:
    """Overrides shared by the Ray integration tests: a corpus of ``docs`` documents written
    under ``root``, the test tokenizer, 32-token blocks, cache and runs under ``root``, the
    tiny model in fp32, and no final model logged to MLflow (the tests that read it back
    turn it on)."""
    write_jsonl(root / "corpus.jsonl", make_docs(docs))
    return [f"--data.source={root / 'corpus.jsonl'}", f"--tokenizer.path={tokenizer_dir}",
            "--data.seq_len=32", "--data.val_fraction=0.1", f"--run.cache_dir={root}/cache",
            f"--run.storage_path={root}/runs", "--model.preset=tiny", "--train.precision=fp32",
            "--tracking.log_model=false"]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    from raylm.data.tokenizer import save_hf_tokenizer, train_bpe

    out = tmp_path_factory.mktemp("tokenizer")
    tok = train_bpe(iter(make_docs(200) * 3), vocab_size=400, min_frequency=2)
    save_hf_tokenizer(tok, out)
    return out


# data.piece_mb that makes every file of `write_pieces_corpus` a preparation piece of its own.
PIECE_MB = 0.004


def write_pieces_corpus(root: Path) -> dict[str, int]:
    """Six JSONL files of ~6.5 KB with duplicates planted within a file, across files, and a
    whole file (c) of copies of earlier ones; returns the counts a preparation must find."""
    docs = make_docs(100)
    root.mkdir(parents=True, exist_ok=True)
    write_jsonl(root / "a.jsonl", docs[0:20])
    write_jsonl(root / "b.jsonl", docs[20:40] + [docs[5], docs[25]])
    write_jsonl(root / "c.jsonl", docs[0:10] + docs[20:30])
    write_jsonl(root / "d.jsonl", docs[40:60] + [docs[45]])
    write_jsonl(root / "e.jsonl", docs[60:80])
    write_jsonl(root / "f.jsonl", [docs[99]] + docs[80:100] + [docs[65]])
    return {"read": 20 + 22 + 20 + 21 + 20 + 22, "kept": 100, "duplicate": 2 + 20 + 1 + 2}


def head_matmuls(width: int):
    """A dispatch mode that records, in its ``seen`` list, (rows, dtype) of every matrix
    product whose output is ``width`` wide: an output head's projections onto a vocabulary of
    that width."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class HeadMatmuls(TorchDispatchMode):
        seen: list[tuple[int, torch.dtype]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default and out.size(-1) == width:
                self.seen.append((out.size(0), out.dtype))
            return out

    mode = HeadMatmuls()
    mode.seen = []
    return mode


def names_since_cb5e3f1(summary: dict, run_dir: Path) -> dict[str, list[str]]:
    """A tracked run's names as tests/fixtures/names-cb5e3f1.json keeps them from raylm at
    cb5e3f1: its MLflow metric names (less MLflow's own system/ ones), summary.json's keys in
    order (less the final model's, which the driver adds when it logs one), and its progress
    records' keys. Reports became records after cb5e3f1 (raylm.contracts.report), their names
    unchanged."""
    from mlflow import MlflowClient

    from raylm.contracts.events import Progress
    from raylm.run import record

    run = MlflowClient(summary["mlflow_tracking_uri"]).get_run(summary["mlflow_run_id"])
    progress = [r.to_dict() for r in record.read(str(run_dir)) if isinstance(r, Progress)]
    return {"mlflow_metrics": sorted(k for k in run.data.metrics if not k.startswith("system/")),
            "summary": [k for k in summary if k not in ("registered_model", "registered_version")],
            "progress": sorted({k for r in progress for k in r})}


def names_of_cb5e3f1(kind: str) -> dict[str, list[str]]:
    kept = Path(__file__).parent / "fixtures" / "names-cb5e3f1.json"
    return json.loads(kept.read_text())[kind]
