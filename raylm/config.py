"""Run configuration: frozen dataclasses, loaded from YAML, then overridden from the command line.

Precedence is CLI > YAML > defaults. The command line is exactly this dataclass tree: every field
is reachable as ``--section.key=value`` and nothing else is. Every user mistake (an unknown key, a
wrong type, an impossible value) raises :class:`ConfigError` naming the key, the value and what is
allowed, before any Ray work starts. A field's own bounds are checked where it is declared (each
section's ``__post_init__``, so no section exists with a value out of bounds); :func:`validate`
keeps the rules that span sections (adapters need a pretrained model, the batch splits over every
worker count and layout).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from raylm import storage
from raylm.hub import is_hub_id

# Names other modules check against, stated once here with the fields that take them.
Schedule = Literal["cosine", "linear", "constant", "wsd", "cyclical"]
SCHEDULES: tuple[str, ...] = typing.get_args(Schedule)
Attention = Literal["auto", "sdpa", "flex_attention", "flash_attention_2"]
ATTENTIONS: tuple[str, ...] = typing.get_args(Attention)
PipelineSchedule = Literal["gpipe", "1f1b"]
# The preference losses (dpo.loss); DpoConfig.needs_reference says which compare with a
# reference model.
PreferenceLoss = Literal["sigmoid", "ipo", "simpo"]
PIPELINE_SCHEDULES: tuple[str, ...] = typing.get_args(PipelineSchedule)
# Bounds of the values that size what raylm allocates or loops over: far above any real run,
# low enough that a typo (an extra zero or three) is refused instead of exhausting a machine.
MAX_WORKERS = 100_000
MAX_VOCAB = 1 << 20
MAX_RANK_SAMPLES = 1 << 30
MAX_SHUFFLE_WINDOW = 4096
# Both size buffers each worker keeps: the losses a spike is measured against (on the
# device), and the batches of the steps since the last report (on the host).
MAX_SPIKE_WINDOW = 10_000
MAX_LOG_EVERY = 1000
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the key and the fix."""


# A config file is a few hundred YAML nodes. Aliases may repeat a node, but one that expands
# past this many (a "billion laughs" file: 10 aliases of 10 aliases of ... reach 10^9 nodes in
# a few hundred bytes) is refused before anything reads or prints it.
MAX_CONFIG_NODES = 10_000
# Values quoted in error messages are cut to this many characters.
MAX_QUOTED_CHARS = 200


def _short(value: Any) -> str:
    """``repr(value)``, cut to fit in an error message."""
    text = repr(value)
    if len(text) <= MAX_QUOTED_CHARS:
        return text
    return f"{text[:MAX_QUOTED_CHARS]}... ({len(text):,} characters)"


class _Refused(yaml.YAMLError):
    """A YAML document that parses but is not accepted as a config file."""


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (YAML would keep the
    last one silently) and aliases that expand beyond :data:`MAX_CONFIG_NODES` nodes."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _expanded_nodes(node, memo={}, active=set())
        return self.construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults` then explicit keys is YAML's way to override
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:
                continue  # an unhashable key: the base constructor names it
            if first is not key_node:  # two keys written, on one line or two
                raise _Refused(f"key {_short(key)} appears twice in one mapping, at "
                               f"{_where(first)} and {_where(key_node)}; keep one of them")
        return super().construct_mapping(node, deep=deep)


def _where(node: yaml.Node) -> str:
    return f"line {node.start_mark.line + 1} column {node.start_mark.column + 1}"


def _expanded_nodes(node: yaml.Node, *, memo: dict[int, int], active: set[int]) -> int:
    """How many nodes ``node`` stands for once every alias is expanded (each node counted once
    per place it appears); raises past :data:`MAX_CONFIG_NODES`."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in active:
        raise _Refused(f"an alias refers to its own anchor (line {node.start_mark.line + 1})")
    active.add(key)
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = []
    size = 1
    for child in children:
        size += _expanded_nodes(child, memo=memo, active=active)
        if size > MAX_CONFIG_NODES:
            raise _Refused(f"its aliases expand to more than {MAX_CONFIG_NODES:,} values "
                           f"(from line {node.start_mark.line + 1}); a config file needs far "
                           f"fewer, so write the values out or use fewer aliases")
    active.discard(key)
    memo[key] = size
    return size


def read_yaml(text: str) -> Any:
    """One YAML document, read safely (see :class:`_ConfigLoader`)."""
    try:
        return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 (a SafeLoader subclass)
    except RecursionError:
        # The parser and constructor recurse once per level: a file nested hundreds deep (a
        # config is three) would end in a traceback.
        raise _Refused("it nests too deeply to read (a config has three levels)") from None


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    name: str | None = None
    """Run name; RUN_DIR = storage_path / name. Starting the same name again resumes it.
    Unset: named after the job, ``MODEL-DATA[-lora|-qlora][-dpo|-ipo|-simpo]`` (the model's
    preset or the last part of model.path, the first data source's name: ``tiny-builtin``,
    ``Qwen2.5-0.5B-Instruct-chats-lora``), so running the same command again resumes it and a
    job on another model or other data gets a directory of its own; a sweep of such a config
    adds ``-sweep``."""
    storage_path: str = "runs"
    """Where runs (checkpoints, summary.json, the default MLflow store) live: a local path,
    a path every node mounts, or object storage (s3://BUCKET/PREFIX, gs://..., any URI pyarrow
    opens). Multi-node runs need one of the last two."""
    ray_address: str | None = None
    """Ray cluster to join: 'HOST:PORT' (its GCS), 'ray://HOST:10001', 'auto' (the head `ray
    start` recorded on this machine) or 'local' (a new local cluster). Unset: RAY_ADDRESS if
    set, else the head `ray start` runs on this machine if it answers, else a new local
    cluster. An address that does not answer in run.connect_timeout_s is an error (see
    raylm.run.cluster)."""
    connect_timeout_s: float = 10.0
    """How long a cluster given by run.ray_address or RAY_ADDRESS may take to answer (a head
    that is still starting refuses for a moment) before the run stops with an error."""
    cache_dir: str = "~/.cache/raylm"
    """Tokenizers, the extracted builtin corpus and prepared data, keyed by fingerprint."""
    verbose: bool = False
    """Print Ray's and MLflow's own INFO lines (Ray Train's per-report lines, Ray Data's
    plans and progress, Tune's trial tables) besides raylm's; Ray's session logs keep them
    either way."""
    progress: Literal["auto", "bar", "lines"] = "auto"
    """Training progress on the driver: a bar (step, loss, tokens/s, ETA) or a line per
    report. auto: a bar in Jupyter and terminals, lines where output is a log (CI, ray job
    logs); see raylm.run.progress."""

    def __post_init__(self) -> None:
        # It names a directory under run.storage_path, an MLflow run and job URLs.
        _check(self.name is None or RUN_NAME.fullmatch(self.name) is not None, "run.name",
               self.name,
               "1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit")
        _at_least("run", self, above=True, connect_timeout_s=0)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str | list[str] = "builtin"
    """Corpus: 'builtin', a file, directory or glob of .txt/.md/.jsonl/.parquet/.arrow files, a
    `datasets` save_to_disk directory, 'hf:NAME[:CONFIG]' for a Hugging Face hub dataset, a
    directory written by `raylm prepare`, or a list of these."""
    format: Literal["text", "chat", "prompt_completion", "preference", "prompt"] = "text"
    """What a record is: running text (pretraining), a conversation (a list of {role, content}
    messages in data.messages_field; roles system, user, assistant), a prompt/completion pair,
    a preference pair for train.objective=dpo (a prompt, string or conversation, with a
    chosen and a rejected answer, each a string or a list of assistant turns), or a prompt
    for train.objective=grpo (a string or a conversation ending with a user turn; the row's
    other columns go to the reward function). All but text read JSONL, Parquet, Arrow or
    saved datasets."""
    text_field: str = "text"
    """Field holding the document text in JSONL, Parquet and Hugging Face datasets."""
    messages_field: str = "messages"
    """format chat: the field holding each conversation."""
    prompt_field: str = "prompt"
    """format prompt_completion: the field holding the prompt; formats preference and prompt:
    the field holding the prompt the answers follow (a string, or a list of chat messages)."""
    completion_field: str = "completion"
    """format prompt_completion: the field holding the completion."""
    chosen_field: str = "chosen"
    """format preference: the field holding the preferred answer (the prompt is in
    data.prompt_field)."""
    rejected_field: str = "rejected"
    """format preference: the field holding the answer not preferred."""
    loss_on: Literal["assistant", "all"] | None = None
    """Which targets carry loss: assistant (the assistant turns, each with the EOS or end-of-
    turn markup that ends it; for prompt_completion, the completion and its EOS) or all.
    Unset: assistant for chat and prompt_completion; text always trains every token."""
    long_examples: Literal["drop", "truncate"] = "drop"
    """An example longer than a block (data.seq_len + 1 tokens) is dropped, or cut to a block
    (kept only if a trained token is left); each is counted. A preference pair (both its
    halves in one block) is never cut: one that does not fit is dropped."""
    text_unit: Literal["paragraph", "line", "file"] = "paragraph"
    """What one document is in a plain text file: a blank-line separated paragraph, a line, or
    the whole file."""
    hf_split: str = "train"
    """Split to read from a Hugging Face dataset."""
    builtin_packages: list[str] = field(
        default_factory=lambda: ["transformers", "torch", "ray", "datasets", "mlflow", "peft"]
    )
    """Installed packages whose docstrings form the builtin corpus (those not installed are
    skipped)."""
    seq_len: int = 256
    """Tokens the model sees per sample; packed blocks hold seq_len + 1 tokens (inputs and the
    shifted targets)."""
    min_chars: int = 0
    """Documents shorter than this many characters (after normalization) are dropped as
    too_short."""
    cross_document_attention: bool | None = None
    """false: a token attends only to earlier tokens of its own document (or example) inside
    a packed block (position ids restart per document). Unset: true for text, false for chat,
    prompt_completion and preference (no token attends to another conversation, and a pair's
    two answers never see each other)."""
    dedup: bool = True
    """Drop exact duplicate documents (by a hash of the normalized text)."""
    val_fraction: float = 0.01
    """Share of documents (chosen by content hash, so stable across runs) held out for
    validation."""
    on_bad_record: Literal["skip", "error"] = "skip"
    """'skip' drops and counts malformed, undecodable or field-less records; 'error' stops at the
    first one, naming its file and line."""
    max_bad_records_listed: int = 100
    """How many bad records manifest.json lists by file and line (all are counted)."""
    tokenize_batch_size: int = 512
    """Documents per tokenizer call in the preparation's packing tasks."""
    tokenize_concurrency: int = 0
    """Packing tasks (read, tokenize, pack and write one piece each) running at once; 0: as
    many as the cluster has CPUs for."""
    piece_mb: float | None = None
    """Source megabytes per preparation piece: consecutive files of about this size are read,
    deduplicated against the whole corpus, tokenized and packed by one task (a file is never
    split). Unset: 1/4096 of the corpus, at least 4 MB. Pieces depend on the files only, so the
    packed data is the same on any cluster."""
    rows_per_row_group: int = 256
    """Packed blocks per Parquet row group; also the unit of the deterministic shuffle."""
    shuffle_window: int = 16
    """Row groups mixed together by the shuffle; a reader caches this many row groups."""
    prefetch_batches: int = 2
    """Batches each training worker fetches ahead of the one it trains on."""
    reader_cpus: float | None = None
    """CPUs the Ray Data actor reading each training worker's stream asks for. Unset: 0.1, or
    0 when the cluster's CPUs cannot hold the workers and 0.1 per reader beside them (the
    reader then shares its worker's CPUs)."""
    first_batch_timeout_s: float = 180.0
    """How long a worker waits for its first training batch before it stops with what its
    reader waits for (with scaling.wait_for_nodes, it says so and keeps waiting); GRPO's
    generators are placed within it alike, and a generation waited for longer is said."""


    @property
    def examples(self) -> bool:
        """Fine-tuning examples (chat or prompt_completion) rather than running text."""
        return self.format != "text"

    @property
    def across_documents(self) -> bool:
        """Whether attention crosses document (example) boundaries inside a block."""
        if self.cross_document_attention is not None:
            return self.cross_document_attention
        return not self.examples

    @property
    def trains_on(self) -> str:
        """Which targets carry loss: assistant or all (see loss_on)."""
        return self.loss_on or ("assistant" if self.examples else "all")

    def __post_init__(self) -> None:
        d = self
        sources = [d.source] if isinstance(d.source, str) else d.source
        _check(bool(sources) and all(sources), "data.source", d.source,
               "a non-empty source or list")
        _at_least("data", d, seq_len=8, min_chars=0, max_bad_records_listed=0,
                  tokenize_batch_size=1, rows_per_row_group=1, tokenize_concurrency=0)
        _check(0.0 <= d.val_fraction < 1.0, "data.val_fraction", d.val_fraction, "0 <= x < 1")
        _check(d.piece_mb is None or d.piece_mb > 0, "data.piece_mb", d.piece_mb,
               "unset (automatic) or a number of megabytes > 0")
        _check(1 <= d.shuffle_window <= MAX_SHUFFLE_WINDOW, "data.shuffle_window",
               d.shuffle_window, f"1 to {MAX_SHUFFLE_WINDOW:,} (a reader caches that many row "
               f"groups)")
        _check(0 <= d.prefetch_batches <= 1024, "data.prefetch_batches", d.prefetch_batches,
               "0 to 1,024")
        _check(d.reader_cpus is None or d.reader_cpus >= 0, "data.reader_cpus", d.reader_cpus,
               "unset (automatic) or a number >= 0")
        _at_least("data", d, above=True, first_batch_timeout_s=0)
        for key in ("text_field", "messages_field", "prompt_field", "completion_field",
                    "chosen_field", "rejected_field"):
            _check(bool(getattr(d, key)), f"data.{key}", getattr(d, key),
                   "a non-empty field name")
        _check(d.format != "text" or d.loss_on in (None, "all"), "data.loss_on", d.loss_on,
               "unset or 'all' with data.format=text (running text has no assistant turns)")


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    path: str | None = None
    """Existing Hugging Face tokenizer directory or hub id (as model.path). Unset: the
    tokenizer of model.path when it has one, else a byte-level BPE is trained."""
    vocab_size: int = 8192
    """Vocabulary size of the trained BPE tokenizer, special tokens included."""
    min_frequency: int = 2
    """Pairs seen fewer times than this are not merged."""
    train_chars: int = 8_000_000
    """Characters of the corpus (read deterministically from its start) used to train the BPE."""

    def __post_init__(self) -> None:
        _check(300 <= self.vocab_size <= MAX_VOCAB, "tokenizer.vocab_size", self.vocab_size,
               f"300 (256 byte symbols plus merges and special tokens) to {MAX_VOCAB:,}")
        _at_least("tokenizer", self, min_frequency=1, train_chars=1000)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    preset: str = "tiny"
    """Named architecture: tiny, 125m, 350m, 1b or 3b."""
    path: str | None = None
    """Pretrained model: a local directory, or a Hugging Face hub id (org/name, optionally
    @revision) fetched into the hub cache on the driver before Ray starts (HF_HUB_OFFLINE=1:
    from the cache alone); overrides the preset."""
    attention: Attention = "auto"
    """Attention kernel: auto picks SDPA flash; on CUDA, when documents must not attend to
    each other, flash-attn's varlen kernel if installed, else FlexAttention (no dense mask).
    sdpa and flex_attention force those; flash_attention_2 forces flash-attn's kernels (CUDA,
    bf16, the flash-attn package installed); see raylm.model.attention."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in backward (less memory, ~30% more
    compute)."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile each decoder block. auto: on for CUDA workers (1b preset, head untied, on
    an H100: 47.8% MFU compiled against 33.8% eager, 40 GB peak against 52), off on CPUs, where
    the compilation (tens of seconds per group) outweighs the short runs and tests."""
    float8: Literal["off", "tensorwise", "rowwise"] = "off"
    """Run the decoder blocks' linear layers' matmuls in float8 (torchao's float8 training:
    inputs, weights and gradients cast to float8 with dynamic scales, one per tensor or one per
    row; weights, gradients and optimizer state stay as train.precision keeps them, so
    checkpoints are unchanged). The output head stays in bf16. CUDA GPUs of compute capability
    8.9 or later (H100, H200, L4, RTX 4090); full training only (not with LoRA) and without
    tensor parallelism. Compile (model.compile) is what makes it fast: the casts fuse."""


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    rank: int = 0
    """LoRA rank; 0 trains every weight (full fine-tuning). Above 0, the base model is frozen
    and only the low-rank adapters (and their optimizer state) train and are checkpointed."""
    alpha: float = 16.0
    """LoRA scaling numerator: an adapter's update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: list[str] | Literal["auto"] = "auto"
    """Linear layers that get adapters, by name (q_proj, ...), or auto: every linear projection
    inside the decoder layers whatever the family calls it (Llama's q/k/v/o/gate/up/down,
    Phi-3's fused qkv_proj and gate_up_proj, GPT-2's c_attn/c_proj/c_fc), except a
    mixture-of-experts router."""
    base_quantization: Literal["none", "nf4"] = "none"
    """QLoRA: ``nf4`` holds the frozen base weights of the adapted layers in 4-bit NormalFloat
    (torchao's NF4 tensor, which FSDP2 shards and all-gathers as 4-bit data), dequantized per
    layer in the forward pass. CUDA workers only (``scaling.use_gpu``: true, or auto on a
    cluster with GPUs)."""

    def __post_init__(self) -> None:
        lo = self
        _check(lo.rank >= 0, "lora.rank", lo.rank, "0 (full fine-tuning) or a rank >= 1")
        _check(lo.alpha > 0, "lora.alpha", lo.alpha, "a number > 0")
        _check(0 <= lo.dropout < 1, "lora.dropout", lo.dropout, "0 <= x < 1")
        _check(lo.target_modules == "auto"
               or (bool(lo.target_modules) and all(lo.target_modules)),
               "lora.target_modules", lo.target_modules,
               "auto, or a non-empty list of linear layer names (q_proj, ...)")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 200
    """Optimizer steps to train to (a resume continues to it): 2**30 samples per worker at most."""
    global_batch_size: int = 16
    """Sequences per optimizer step, summed over workers and accumulation steps."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one worker."""
    seed: int = 0
    """Seeds the model initialisation and the global sample order."""
    precision: Literal["auto", "fp32", "bf16-mixed", "bf16-true"] = "auto"
    """'auto' is bf16-mixed on CUDA devices with bf16 and fp32 elsewhere."""
    objective: Literal["sft", "dpo", "grpo"] = "sft"
    """sft: next-token cross-entropy (pretraining and supervised fine-tuning); dpo: preference
    tuning on data.format=preference pairs with the dpo section's loss, averaged over every
    pair in the step's train.global_batch_size blocks (a block holds as many whole pairs as
    fit in data.seq_len + 1 tokens); grpo: reinforcement learning from the rl section's reward
    on data.format=prompt rows, rl.group_size completions of each of the step's
    train.global_batch_size prompts (one prompt a block)."""
    fused_loss: bool = True
    """Compute the output head and the cross-entropy a chunk of tokens at a time, so that a
    batch's logits never exist whole (at a 150k vocabulary they are the largest item of a
    small model's memory); the same loss and gradients as the plain head. Not under pipeline
    parallelism, where the last stage runs the plain head (see raylm.model.head_loss)."""
    max_failures: int = 3
    """Worker-group restarts allowed after failures (a lost worker or node, a preempted worker)
    before the run fails; -1 for no limit. Each restart resumes from the latest checkpoint."""
    max_failures_at_one_step: int = 3
    """Failures in a row without training past the furthest step reached before them end the
    run, whatever train.max_failures allows: a fault that recurs at the same place (a bad
    stretch of data, a bug, a node that cannot hold the step) is not a machine lost at random.
    0: no such limit."""
    log_every: int = 10
    """Report metrics every this many steps (at most 1,000: the batches of the steps since
    the last report stay on the host, for a rewind to find the samples at fault)."""
    eval_every: int = 100
    """Validate every this many steps (and at the end)."""
    eval_batches: int = 8
    """Validation micro-batches per worker at each evaluation."""
    sample_ledger: bool = True
    """Keep in every checkpoint the stored rows each optimizer step trained on (4 bytes per
    sample) and account for them in summary.json: samples duplicated or skipped across
    restarts and resizes."""
    on_nonfinite: Literal["skip", "rewind", "stop"] = "skip"
    """A step whose loss or gradient norm is not finite never updates the weights. skip: the
    run goes on (the step's samples are recorded as withheld); rewind: the run goes back to
    its latest checkpoint and leaves that step's samples out of the order (each rewind is a
    restart and uses one of train.max_failures); stop: the run ends, not retried."""
    on_spike: Literal["off", "skip", "rewind", "stop"] = "off"
    """A step whose loss exceeds train.spike_factor times the median loss of the last
    train.spike_window steps (after optim.warmup_steps, once the window is full) is a fault,
    handled as train.on_nonfinite's choices are; off: losses are not checked for spikes."""
    spike_factor: float = 2.0
    """How many times the running median loss a step's loss must exceed to be a spike."""
    spike_window: int = 50
    """Steps whose losses the running median is taken over (3 to 10,000)."""
    max_rewinds: int = 2
    """Rewinds for faults at the same step before the run stops with their record: a fault
    that comes back after its samples were left out is not in the data."""
    collective_timeout_s: float = 1800.0
    """Longest any rank waits in a collective (an all-reduce, a barrier) for the others: past
    it the collective fails on the ranks that came, naming it, and the group restarts (the
    process group's timeout, given to it as the workers form it: raylm/run/group.py)."""
    skip_positions: list[list[int]] = field(default_factory=list)
    """Ranges [start, end) of global sample positions to leave out of the training order
    (a run's rewinds list those they left out in its skipped_samples.json): another run
    given them trains on what that run trained on."""

    def __post_init__(self) -> None:
        tr = self
        _at_least("train", tr, steps=1, global_batch_size=1, micro_batch_size=1, eval_every=1,
                  eval_batches=1, collective_timeout_s=1, max_rewinds=1,
                  max_failures_at_one_step=0)
        _check(tr.max_failures >= -1, "train.max_failures", tr.max_failures,
               "-1 (unlimited) or an integer >= 0")
        _check(1 <= tr.log_every <= MAX_LOG_EVERY, "train.log_every", tr.log_every,
               f"1 to {MAX_LOG_EVERY:,}")
        _check(tr.spike_factor > 1, "train.spike_factor", tr.spike_factor, "a number > 1")
        _check(3 <= tr.spike_window <= MAX_SPIKE_WINDOW, "train.spike_window",
               tr.spike_window, f"an integer 3 to {MAX_SPIKE_WINDOW:,}")
        _check(all(isinstance(r, (list, tuple)) and len(r) == 2
                   and all(isinstance(v, int) for v in r) and 0 <= r[0] < r[1]
                   for r in tr.skip_positions), "train.skip_positions", tr.skip_positions,
               "a list of [start, end) ranges of sample positions, 0 <= start < end")
        rewinds = "rewind" in (tr.on_nonfinite, tr.on_spike)
        _check(not rewinds or tr.max_failures != 0, "train.max_failures", tr.max_failures,
               ">= 1 (or -1) when train.on_nonfinite or train.on_spike is rewind: a rewind "
               "restarts the worker group")


@dataclass(frozen=True, kw_only=True)
class DpoConfig:
    beta: float = 0.1
    """Strength of the preference objective: how far the policy's log-probability ratios to
    the reference are pushed (DPO, IPO), or the scale of the mean log-probabilities (SimPO,
    where 2.0 to 2.5 is usual)."""
    loss: PreferenceLoss = "sigmoid"
    """sigmoid: DPO; ipo: IPO's squared loss on length-normalized log-ratios; simpo: SimPO,
    on the answers' mean log-probabilities with a margin and no reference model. sigmoid and
    ipo compare with the pretrained model.path: with LoRA, the base with the adapters
    switched off; a full fine-tune scores every pair with the starting weights once before
    training and reads the figures beside the blocks (run.cache_dir/reference)."""
    label_smoothing: float = 0.0
    """Share of pairs assumed mislabeled (conservative DPO; sigmoid and simpo), 0 <= x < 0.5."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (beta x mean log-probability units)."""

    def __post_init__(self) -> None:
        _check(self.beta > 0, "dpo.beta", self.beta, "a number > 0")
        _check(0 <= self.label_smoothing < 0.5, "dpo.label_smoothing", self.label_smoothing,
               "0 <= x < 0.5")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares the policy with a reference model (sigmoid and ipo do;
        SimPO does not)."""
        return self.loss != "simpo"


# The largest value of each rl setting (see RlConfig.__post_init__), and the lowest temperature.
RL_CEILINGS = {"group_size": 1024, "generators": 1024, "max_staleness": 64,
               "max_completion_tokens": 1_048_576, "reward_timeout_s": 86_400.0,
               "updates_per_step": 1024}
MIN_TEMPERATURE = 0.01


@dataclass(frozen=True, kw_only=True)
class RlConfig:
    reward: str | None = None
    """train.objective=grpo: the reward function, module:function (called as fn(prompt,
    completion, **columns), returning a number or a mapping of named numbers, summed), or a
    built-in: exact_match or final_number, against the row's answer column."""
    reward_timeout_s: float = 0.0
    """> 0: the reward function runs in a process of its own beside each generator (a Ray
    actor on its node), and a call that takes longer is ended with its process (its completion
    scores 0, counted as a failure); a process that dies is replaced and the call made again
    once. For rewards that run generated code. 0: in the generator's process."""
    group_size: int = 8
    """Completions sampled for each prompt; each one's advantage is its reward against its
    group's."""
    temperature: float = 1.0
    """Sampling temperature; the trainers score completions at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens holding this much probability."""
    max_completion_tokens: int = 128
    """The longest completion; one cut there counts as truncated (with no EOS)."""
    clip_low: float = 0.2
    """The policy ratio is clipped below at 1 - clip_low where the advantage is negative."""
    clip_high: float = 0.2
    """... and above at 1 + clip_high where it is positive (DAPO's "clip higher": 0.28)."""
    normalize_advantages: bool = True
    """Divide each group's centered rewards by their standard deviation (GRPO); false keeps
    them centered only (Dr. GRPO: no bias towards prompts all answered alike)."""
    aggregation: Literal["token", "sequence", "constant"] = "token"
    """How the step averages its completions' token losses: every token alike (DAPO), each
    completion's mean then their mean (GRPO as published), or the sum over completions x
    rl.max_completion_tokens (Dr. GRPO)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty against the starting model (the k3 estimate per token), scored
    by the generators: with LoRA the base with the adapters switched off, else a frozen copy of
    the starting weights beside each generator's policy (twice its model's memory); 0: none."""
    generators: int | list[int] = 1
    """Generator actors sampling completions beside the trainers: an int, or [min, max] to
    sample with as many as the cluster places, steps waiting only while fewer than min are
    (one placed later joins with the newest weights). One that dies is replaced while the
    trainers continue; its prompts go to the others. 0: colocated, no actor: each trainer
    samples its own share of the step's groups with the weights it trains (one GPU or one
    CPU worker runs GRPO), synchronously (rl.max_staleness=0)."""
    generator_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    """Ray resources each generator actor holds (e.g. {"GPU": 1})."""
    updates_per_step: int = 1
    """Optimizer updates each step's completions feed: its groups split into this many
    mini-batches of whole groups, one update each, in order (PPO's mini-batches); the later
    ones train completions their earlier updates moved the policy from, weighed by importance
    and clipped. It must divide train.global_batch_size / the workers."""
    max_staleness: int = 0
    """0: synchronous (on-policy): each step's completions are sampled by the weights it
    trains. K > 0: generation runs up to K steps ahead, while the trainers train, so a step
    trains on completions of weights up to K versions old, weighed by importance; a checkpoint
    keeps those generated and not yet trained on."""

    @property
    def colocated(self) -> bool:
        """The trainers sample their own completions (rl.generators=0)."""
        return self.generators == 0

    @property
    def generator_range(self) -> tuple[int, int]:
        """(fewest, most) generators."""
        g = self.generators
        return (g[0], g[1]) if isinstance(g, list) else (g, g)

    def __post_init__(self) -> None:
        g = self.generators
        _check(len(g) == 2 and 1 <= g[0] <= g[1] if isinstance(g, list) else g >= 0,
               "rl.generators", g, "an integer >= 0 (0: colocated) or [min, max] with "
               "1 <= min <= max")
        _check(not (self.colocated and self.max_staleness), "rl.max_staleness",
               self.max_staleness, "0 with rl.generators=0: colocated trainers sample with "
               "the weights they train, so nothing is generated ahead; generator actors "
               "(rl.generators >= 1) sample ahead")
        _at_least("rl", self, group_size=2, max_completion_tokens=1,
                  reward_timeout_s=0,
                  clip_low=0, clip_high=0, kl_coef=0, max_staleness=0, updates_per_step=1)
        # Beyond these, a setting is a typo, not a run: a group is one batch of group_size
        # copies of its prompt; each generator is an actor; the pool keeps max_staleness + 1
        # weight copies in the object store; logits / temperature stay finite in float32.
        for key, most in RL_CEILINGS.items():
            v = getattr(self, key)
            _check(all(x <= most for x in (v if isinstance(v, list) else [v])), f"rl.{key}",
                   v, f"at most {most:g}")
        _check(self.temperature >= MIN_TEMPERATURE, "rl.temperature", self.temperature,
               f">= {MIN_TEMPERATURE} (logits / temperature must stay finite)")
        _check(0 < self.top_p <= 1, "rl.top_p", self.top_p, "0 < x <= 1")
        _check(self.clip_low < 1, "rl.clip_low", self.clip_low, "0 <= x < 1")
        _check(all(v >= 0 for v in self.generator_resources.values()),
               "rl.generator_resources", self.generator_resources,
               "a mapping of Ray resource names to amounts >= 0")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate, reached at the end of warmup."""
    schedule: Schedule = "cosine"
    """Learning-rate schedule after warmup."""
    warmup_steps: int = 20
    """Steps of linear warmup from 0 to lr."""
    min_lr_ratio: float = 0.1
    """Final (or lowest) learning rate as a fraction of lr."""
    decay_fraction: float = 0.2
    """wsd: share of the post-warmup steps spent decaying to the minimum."""
    cycle_steps: int = 100
    """cyclical: steps in one triangular cycle (peak -> minimum -> peak)."""
    weight_decay: float = 0.1
    """AdamW weight decay; never applied to norms, biases and embeddings."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""

    def __post_init__(self) -> None:
        op = self
        _check(op.lr > 0, "optim.lr", op.lr, "a number > 0")
        _at_least("optim", op, warmup_steps=0, cycle_steps=2, weight_decay=0)
        _check(0.0 <= op.min_lr_ratio <= 1.0, "optim.min_lr_ratio", op.min_lr_ratio,
               "0 <= x <= 1")
        _check(0.0 < op.decay_fraction <= 1.0, "optim.decay_fraction", op.decay_fraction,
               "0 < x <= 1")
        _check(0 <= op.beta1 < 1, "optim.beta1", op.beta1, "0 <= x < 1")
        _check(0 <= op.beta2 < 1, "optim.beta2", op.beta2, "0 <= x < 1")
        _check(op.grad_clip >= 0, "optim.grad_clip", op.grad_clip, ">= 0 (0 disables)")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every: int = 100
    """Save a checkpoint every this many steps (and at the end)."""
    keep: int = 3
    """Checkpoints kept; older ones are deleted."""
    asynchronous: bool = True
    """Write and upload periodic checkpoints in the background while training goes on (the
    state is first copied to host memory: one more copy of this worker's shards of weights and
    optimizer state). The last checkpoint and a preemption's are always written before the
    run or the group stops. A checkpoint counts once its marker is written, after every rank's
    files."""
    writer: Literal["auto", "thread", "process"] = "auto"
    """Where an asynchronous checkpoint is written from: a thread of the worker, or a daemon
    process of the worker's own (DCP's; started at the first save, then kept), which does not
    share the training loop's interpreter lock. auto: the process on a GPU worker, whose host
    cores are free while the step runs on the GPU; the thread on a CPU worker, where the
    step takes the worker's cores and a process would only add its start."""
    accept_changes: list[Literal["data", "tokenizer", "base_model"]] = field(
        default_factory=list)
    """A resume continues the same run: one whose checkpoint was trained on other data (another
    corpus, preparation or data.format), with another tokenizer or another model.path is
    refused, unless this lists what may change (continued training on new data, on purpose;
    the summary records it)."""
    timeout_s: float = 1800.0
    """Longest a worker waits for a checkpoint to be read (the restore) or written (a save, or
    the background save before the next): past it, the worker says which rank waited for what
    and ends, and the group restarts (train.max_failures applies). 0: no bound."""

    def __post_init__(self) -> None:
        _at_least("checkpoint", self, every=1, keep=1)
        _check(self.timeout_s >= 0, "checkpoint.timeout_s", self.timeout_s, ">= 0 (0: none)")


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    num_workers: int | list[int] = 1
    """Training workers: an int, or [min, max] for elastic scaling."""
    use_gpu: bool | Literal["auto"] = "auto"
    """One GPU per worker. auto: GPU workers when the cluster the run joins or starts has a
    GPU, CPU workers otherwise; the run's first lines and its summary say which, and why. An
    autoscaling cluster (scaling.wait_for_nodes) with no GPU yet cannot tell: set true or
    false there."""
    cpus_per_worker: float = 1.0
    """CPUs reserved per training worker."""
    worker_resources: dict[str, float] = field(default_factory=dict)
    """Extra Ray resources each training worker asks for, e.g. ``{trainer: 1}`` to place
    workers only on the nodes (or the autoscaling node group) that advertise that resource."""
    data_resources: dict[str, float] = field(default_factory=dict)
    """Extra Ray resources every data task and actor asks for (the preparation's tasks, each
    worker's Ray Data reader), e.g. ``{data_node: 0.001}`` where a CPU node group advertises
    ``data_node: 1000``: the autoscaler then grows that group for data work, and data work never
    lands on training nodes that lack the resource."""
    wait_for_nodes: bool = False
    """The cluster autoscales: a run or sweep that does not fit the nodes running now waits for
    the autoscaler to add nodes, instead of being refused before it starts."""
    resize_interval_s: float = 60.0
    """Elastic runs: how often Ray Train looks for room to grow the worker group (seconds).
    Growing restarts the group from the latest checkpoint, so each check that finds room costs
    up to ``checkpoint.every`` steps."""

    @property
    def worker_range(self) -> tuple[int, int]:
        """(fewest, most) training workers."""
        nw = self.num_workers
        return (nw[0], nw[1]) if isinstance(nw, list) else (nw, nw)

    def __post_init__(self) -> None:
        sc, nw = self, self.num_workers
        if isinstance(nw, list):
            _check(len(nw) == 2 and 1 <= nw[0] <= nw[1] <= MAX_WORKERS, "scaling.num_workers",
                   nw, f"an integer 1 to {MAX_WORKERS:,} or [min, max] with 1 <= min <= max")
        else:
            _check(1 <= nw <= MAX_WORKERS, "scaling.num_workers", nw,
                   f"an integer 1 to {MAX_WORKERS:,} or [min, max]")
        _check(sc.cpus_per_worker > 0, "scaling.cpus_per_worker", sc.cpus_per_worker, "> 0")
        for key in ("worker_resources", "data_resources"):
            res = getattr(sc, key)
            _check(all(v > 0 and k not in ("CPU", "GPU") for k, v in res.items()),
                   f"scaling.{key}", res, "custom resource names (not CPU/GPU: use "
                   "scaling.cpus_per_worker and scaling.use_gpu) with amounts > 0")
        _at_least("scaling", sc, resize_interval_s=0)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tensor: int = 1
    """Tensor-parallel degree: each decoder block's projections, and the activations between
    them, are split over this many workers (with sequence parallelism for the norms and the
    residual stream). The data-parallel degree is scaling.num_workers / (tensor x
    pipeline); FSDP2 shards over it. Use it when one worker cannot hold a block's activations
    or gathered weights; keep a tensor-parallel group inside one node (it talks at every
    block)."""
    pipeline: int = 1
    """Pipeline-parallel degree: the decoder layers are cut into this many stages of
    consecutive layers (the embedding on the first, the final norm and head on the last), one
    per worker of a pipeline. Use it when the model's weights and optimizer state do not fit
    the workers of one node even sharded, or to go across nodes with slow links: only the
    activations at stage boundaries travel, once per micro-batch. Needs untied embeddings
    and at least one layer per stage; layers that do not divide are split as evenly as they
    can be (the split is printed at start)."""
    context: int = 1
    """Context-parallel degree: each sequence of a micro-batch is split into this many
    contiguous shards over as many workers, which hold 1/N of its activations each (the
    longest sequence that trains grows about N-fold); attention exchanges q, k, v and its
    output between them (all-to-all: each worker attends over the whole sequence for 1/N of
    the heads), per-document attention included. It must divide the attention heads and
    data.seq_len; the data-parallel degree is scaling.num_workers / context, and
    train.global_batch_size counts whole sequences."""
    pipeline_schedule: PipelineSchedule = "1f1b"
    """Order of the micro-batches' forward and backward passes: gpipe (all forwards, then all
    backwards: every micro-batch's activations held at once) or 1f1b (backward starts as
    soon as it can: at most parallel.pipeline micro-batches' activations held). The idle
    share is the same: (pipeline - 1) / (micro-batches + pipeline - 1)."""
    pipeline_microbatches: int = 0
    """Micro-batches a pipeline step splits each data-parallel rank's share of
    train.global_batch_size into (at least parallel.pipeline; more of them shrink the idle
    share but make each smaller). 0: the share split into micro-batches of
    train.micro_batch_size sequences, as gradient accumulation would split it."""
    reduce_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Precision of the gradients' reduce-scatter between data-parallel workers (FSDP2): fp32
    sums in full precision; bf16 moves half the bytes but rounds each gradient to 8
    significant bits before the sum (see docs/performance.md for the measured bytes and loss
    difference). auto: fp32, except under train.precision=bf16-true, whose gradients are
    bf16 already. Only data-parallel degrees above 1 reduce."""
    prefetch: int = 0
    """Decoder blocks whose weights each block all-gathers ahead (FSDP2 explicit prefetching,
    forward and backward): more hides more of the gathers behind compute on slow links, and
    holds that many more blocks' gathered weights. 0: FSDP2's own prefetching (the next block
    in backward; in forward as far as the CPU runs ahead of the GPU)."""


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    enabled: bool = True
    """Record the run in MLflow."""
    uri: str | None = None
    """MLflow tracking URI; unset uses MLFLOW_TRACKING_URI, else a SQLite store beside the
    runs, ``sqlite:///<run.storage_path>/mlflow.db`` (object storage needs one of the two)."""
    experiment: str = "raylm"
    """MLflow experiment name."""
    gpu_hour_price: float | None = None
    """Price of one GPU-hour, in any currency: the run then reports ``cost`` = GPU-hours x
    this (unset: no cost figure)."""
    log_model: bool = True
    """Log the final model to MLflow when the run finishes (a LoggedModel: the Hugging Face
    export in MLflow's transformers flavor, or a LoRA run's peft adapter). A sweep's trials
    log none."""
    register_as: str | None = None
    """Register the final model in MLflow's model registry under this name (a new version
    each time a run finishes training)."""

    def __post_init__(self) -> None:
        _check(self.register_as is None
               or (bool(self.register_as.strip()) and self.enabled and self.log_model),
               "tracking.register_as", self.register_as,
               "unset, or a model name with tracking.enabled=true and tracking.log_model=true "
               "(the registry holds the logged model)")
        _check(self.gpu_hour_price is None or self.gpu_hour_price >= 0,
               "tracking.gpu_hour_price", self.gpu_hour_price, "unset or a price >= 0")


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    lr_min: float = 1e-4
    """Lower bound of the log-uniform peak-LR search space."""
    lr_max: float = 1e-2
    """Upper bound of the log-uniform peak-LR search space."""
    schedules: list[str] = field(default_factory=lambda: ["cosine", "linear", "wsd"])
    """Schedules the sweep chooses among."""
    warmup_steps: list[int] = field(default_factory=list)
    """Warmup steps to choose among; empty keeps optim.warmup_steps."""
    weight_decays: list[float] = field(default_factory=list)
    """Weight decays to choose among; empty keeps optim.weight_decay."""
    lora_ranks: list[int] = field(default_factory=list)
    """LoRA ranks to choose among (each >= 1; needs model.path); empty keeps lora.rank."""
    lora_alphas: list[float] = field(default_factory=list)
    """LoRA alphas to choose among; empty keeps lora.alpha."""
    dpo_betas: list[float] = field(default_factory=list)
    """train.objective=dpo: dpo.beta values to choose among; empty keeps dpo.beta. A DPO
    sweep ranks its trials by held-out preference accuracy (val_accuracy), which, unlike the
    DPO loss, does not move with beta."""
    choices: dict[str, list[Any]] = field(default_factory=dict)
    """Any other settings to choose among, by key: {"rl.clip_high": [0.2, 0.28],
    "rl.temperature": [0.7, 1.0]}. Each value is checked as that key's own setting is; the
    settings with lists of their own above keep them."""
    num_samples: int = 8
    """Trials in the sweep (random and optuna); grid runs every combination once."""
    lr_points: int = 3
    """grid: peak LRs, spaced evenly on a log scale from lr_max down to lr_min."""
    search: Literal["random", "grid", "optuna"] = "random"
    """Search algorithm: random, grid, or optuna (TPE, through Ray Tune's OptunaSearch)."""
    max_concurrent: int = 0
    """Trials at a time; 0 runs as many as the cluster has room for."""
    metric: str | None = None
    """Rank trials by a benchmark score instead: ``eval/<task>/<metric>`` of one of eval.tasks
    (``eval/arc_easy/acc_norm``); whether higher is better is lm-eval's word for the metric.
    Trials report at each scored checkpoint, so ASHA stops trials on the scores as they
    arrive. Unset: validation loss (preference accuracy for DPO)."""

    def __post_init__(self) -> None:
        tu = self
        _check(0 < tu.lr_min < tu.lr_max, "tune.lr_min/tune.lr_max", [tu.lr_min, tu.lr_max],
               "0 < lr_min < lr_max")
        _at_least("tune", tu, num_samples=1, lr_points=1, max_concurrent=0, warmup_steps=0,
                  weight_decays=0)
        _check(all(r >= 1 for r in tu.lora_ranks), "tune.lora_ranks", tu.lora_ranks,
               "ranks >= 1, with model.path naming the pretrained model they adapt")
        _at_least("tune", tu, above=True, lora_alphas=0, dpo_betas=0)
        bad = [s for s in tu.schedules if s not in SCHEDULES]
        _check(bool(tu.schedules) and not bad, "tune.schedules", tu.schedules,
               f"a non-empty list drawn from {', '.join(SCHEDULES)}")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    tasks: list[str] = field(default_factory=list)
    """Benchmarks that score the run's checkpoints while it trains, on Ray beside it: task and
    group names of EleutherAI's lm-evaluation-harness (arc_easy, hellaswag, mmlu ...), or of
    the task files in eval.include_path. Empty: none. Needs the eval extra
    (``pip install 'raylm[eval]'``); a task's data is read where the evaluation runs (a hub
    data set needs the network there, a local task's files that path)."""
    include_path: str | None = None
    """A directory of the user's own lm-eval task YAML files (their data in local JSON, JSONL
    or Parquet files), whose task names eval.tasks may use; a relative one is made absolute
    where the run starts (the paths inside the files are read as written)."""
    every: int = 1
    """Score every this many checkpoints (counted from step 0 in checkpoint.every steps); the
    final checkpoint is always scored."""
    limit: int | None = None
    """Examples per task at most (unset: all of them), for a quick, noisier score."""
    num_fewshot: int | None = None
    """Examples shown before each question; unset: each task's own setting."""
    batch_size: int = 8
    """Sequences the evaluation scores at a time."""
    resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    """What one evaluation takes on the cluster, apart from the training workers: CPU, GPU and
    custom resources, e.g. ``{GPU: 1}``, or ``{CPU: 2, GPU: 1, eval_node: 1}`` for the
    cluster files' evaluation node group. An evaluation that cannot be placed beside training
    waits for room (said in the run's lines), so training never waits for it."""

    def __post_init__(self) -> None:
        _check(all(isinstance(t, str) and t.strip() for t in self.tasks), "eval.tasks",
               self.tasks, "lm-eval task or group names")
        _at_least("eval", self, every=1, batch_size=1)
        _check(self.limit is None or self.limit >= 1, "eval.limit", self.limit,
               "unset or >= 1")
        _check(self.num_fewshot is None or self.num_fewshot >= 0, "eval.num_fewshot",
               self.num_fewshot, "unset or >= 0")
        _check(bool(self.resources) and all(v > 0 for v in self.resources.values()),
               "eval.resources", self.resources,
               "resource names (CPU, GPU or custom) with amounts > 0")


@dataclass(frozen=True, kw_only=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    rl: RlConfig = field(default_factory=RlConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.run.name is None:
            object.__setattr__(self, "run",
                               dataclasses.replace(self.run, name=default_run_name(self)))

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """``{"section.key": value}``: the shape MLflow params and overrides use."""
        return {f"{s}.{k}": v for s, sec in self.to_dict().items() for k, v in sec.items()}


# The suffix of a file source that names its format, left out of a run's default name.
_DATA_SUFFIXES = (".txt", ".md", ".jsonl", ".json", ".parquet", ".arrow")
_NAME_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
SWEEP_SUFFIX = "-sweep"


def default_run_name(cfg: Config) -> str:
    """``run.name`` when it is not given: the model, the first data source and how they train
    (see :attr:`RunConfig.name`)."""
    m, d = cfg.model, cfg.data
    model = m.path.rstrip("/").rsplit("/", 1)[-1] if m.path else m.preset
    sources = [d.source] if isinstance(d.source, str) else list(d.source)
    first = str(sources[0]) if sources else "data"
    if first.startswith("hf:"):
        data = first[3:].split(":", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    else:
        # A glob is named by the folder it searches: data/*.txt is "data".
        data = re.split(r"[*?\[]", first, maxsplit=1)[0].rstrip("/").rsplit("/", 1)[-1]
        for suffix in _DATA_SUFFIXES:
            data = data.removesuffix(suffix)
    parts = [model, data or "data"]
    if len(sources) > 1:
        parts[-1] += f"-and-{len(sources) - 1}-more"
    if cfg.lora.rank:
        parts.append("qlora" if cfg.lora.base_quantization == "nf4" else "lora")
    if cfg.train.objective == "dpo":
        parts.append({"sigmoid": "dpo"}.get(cfg.dpo.loss, cfg.dpo.loss))
    name = _NAME_SAFE.sub("-", "-".join(parts)).strip("-._")[:128]
    return name or "run"


def for_sweep(cfg: Config) -> Config:
    """A sweep's config: a run name derived for a training run (:func:`default_run_name`)
    gains :data:`SWEEP_SUFFIX`, so a sweep never reopens the run of the same job."""
    if cfg.run.name != default_run_name(cfg):
        return cfg
    name = cfg.run.name[:128 - len(SWEEP_SUFFIX)] + SWEEP_SUFFIX
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=name))


SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)
}


# Keys a release removed: their default, which a run directory's saved config written before
# holds and which is read as their absence, and what took their place.
REMOVED = {"tune.min_lr_ratios": ([], 'tune.choices, as {"optim.min_lr_ratio": [0.05, 0.1]}')}


def _closest(name: str, choices: list[str], prefix: str = "") -> str:
    if prefix + name in REMOVED:
        return f" It was removed: use {REMOVED[prefix + name][1]}."
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" Did you mean '{prefix}{match[0]}'?" if match else ""


def _describe(tp: Any) -> str:
    if tp is Any:
        return "any value"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin is dict:
        k, v = typing.get_args(tp)
        return f"a mapping of {_describe(k)} to {_describe(v)}"
    if tp is type(None):
        return "null"
    return {int: "an integer", float: "a finite number", bool: "true/false", str: "a string"}.get(
        tp, str(tp)
    )


_NO = object()


def _coerce(value: Any, tp: Any) -> Any:
    """Return ``value`` as type ``tp`` or ``_NO``; never converts lossily (1.5 is not an int)."""
    if tp is Any:  # tune.choices' values: checked as their own keys' settings
        return value
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value if value in typing.get_args(tp) else _NO
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            out = _coerce(value, arg)
            if out is not _NO:
                return out
        return _NO
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return _NO
        (item_tp,) = typing.get_args(tp)
        items = [_coerce(v, item_tp) for v in value]
        return _NO if any(i is _NO for i in items) else items
    if origin is dict:
        if not isinstance(value, dict):
            return _NO
        key_tp, value_tp = typing.get_args(tp)
        out = {_coerce(k, key_tp): _coerce(v, value_tp) for k, v in value.items()}
        return _NO if any(k is _NO or v is _NO for k, v in out.items()) else out
    if tp is type(None):
        return None if value is None else _NO
    if tp is bool:
        return value if isinstance(value, bool) else _NO
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if tp is float:
        # No field takes infinity or NaN (a learning rate, a clip, a fraction, a resource).
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value) if math.isfinite(value) else _NO
        if isinstance(value, str):
            # YAML 1.1 reads 3e-4 (no dot) as a string.
            try:
                out = float(value)
            except ValueError:
                return _NO
            return out if math.isfinite(out) else _NO
        return _NO
    if tp is str:
        # YAML reads `name: 123` as an int; a string field takes it as written.
        if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
            return _NO
        return str(value)
    raise AssertionError(f"unsupported config type {tp}")


def _build_section(name: str, values: dict[str, Any]) -> Any:
    cls = SECTIONS[name]
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        removed = REMOVED.get(f"{name}.{key}")
        if key not in hints and removed is not None and removed[0] == value:
            continue  # a removed key at its default: a config saved before it went
        if key not in hints:
            raise ConfigError(
                f"Unknown config key '{name}.{key}'.{_closest(key, list(hints), name + '.')} "
                f"Valid keys in '{name}': {', '.join(hints)}."
            )
        out = _coerce(value, hints[key])
        if out is _NO:
            raise ConfigError(
                f"Invalid value for '{name}.{key}': {_short(value)}. Expected "
                f"{_describe(hints[key])}."
            )
        kwargs[key] = out
    return cls(**kwargs)


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"Invalid value for '{key}': {_short(value)}. Allowed: {allowed}.")


def _at_least(section: str, obj: Any, *, above: bool = False, **floors: float) -> None:
    """Each key at least its floor, or ``above`` it (each item, for a list)."""
    for key, floor in floors.items():
        v = getattr(obj, key)
        _check(all(x > floor if above else x >= floor for x in (v if isinstance(v, list) else [v])),
               f"{section}.{key}", v, f"{'>' if above else '>='} {floor}")


def model_parallel_group(cfg: Config) -> tuple[int, str]:
    """Workers that share one data-parallel rank (a tensor-parallel group times the pipeline
    stages), and how a message names them."""
    p = cfg.parallel
    parts = [f"parallel.{k}={v}" for k, v in (("tensor", p.tensor), ("pipeline", p.pipeline),
                                              ("context", p.context)) if v > 1]
    return p.tensor * p.pipeline * p.context, " x ".join(parts) or "parallel.tensor=1"


def _check_layout(cfg: Config) -> None:
    """The workers must split into whole model-parallel groups (tensor x pipeline) at every
    count the run may have. Ray Train's elastic scaling may start any count in a range, so
    with groups of more than one worker only a fixed count (or [n, n]) guarantees that. A
    pipeline must have at least one micro-batch per stage."""
    p, sc = cfg.parallel, cfg.scaling
    _at_least("parallel", p, tensor=1, pipeline=1, context=1, pipeline_microbatches=0,
              prefetch=0)
    if p.context > 1:
        _check(p.tensor == 1 and p.pipeline == 1, "parallel.context", p.context,
               "1 with parallel.tensor or parallel.pipeline > 1 (sequences are split over "
               "data-parallel workers only)")
        _check(cfg.model.compile is not True, "model.compile", True,
               "false or auto with parallel.context > 1 (the all-to-all around attention "
               "runs eagerly; auto leaves the blocks uncompiled)")
        _check(cfg.model.attention in ("auto", "sdpa"), "model.attention",
               cfg.model.attention, "auto or sdpa with parallel.context > 1 (each worker "
               "runs SDPA over whole documents inside its share of the heads)")
        _check(cfg.data.seq_len % p.context == 0, "data.seq_len", cfg.data.seq_len,
               f"a multiple of parallel.context={p.context} (each worker holds an equal "
               f"shard of every sequence)")
    group, named = model_parallel_group(cfg)
    lo, hi = sc.worker_range
    odd = [n for n in range(lo, hi + 1) if n % group]
    if odd:
        n = odd[0]
        raise ConfigError(
            f"scaling.num_workers={sc.num_workers} allows {n} workers, which do not split "
            f"into groups of {named} = {group} workers ({n} = {n // group} x "
            f"{group} + {n % group}); give a worker count that is a multiple of {group}"
            + (" (an elastic range may start any count in between, so a range needs "
               "min = max)" if lo != hi else "") + ".")


def _check_batch_shares(global_batch: int, num_workers: Any, worker_range: tuple[int, int],
                        *, group: int = 1) -> None:
    """Every data-parallel degree the run may have (workers / ``group``, the workers of one
    model-parallel group seeing the same samples) must share each global batch equally
    (ranks take equal slices of it; see raylm.data.packing), so an elastic range must divide it
    throughout."""
    counts = range(worker_range[0], worker_range[1] + 1)
    bad = [n for n in counts if global_batch % (n // group)]
    if bad:
        fits = math.lcm(*(n // group for n in counts))
        shares = ("workers" if group == 1 else
                  f"data-parallel ranks (workers / {group}, the workers of a tensor x "
                  f"pipeline group)")
        raise ConfigError(
            f"train.global_batch_size={global_batch} cannot be split equally over "
            f"{', '.join(str(n // group) for n in bad)} {shares}, which "
            f"scaling.num_workers={num_workers} allows; every count in the range must divide "
            f"the global batch (for example "
            f"train.global_batch_size={fits * max(1, round(global_batch / fits))}), "
            f"or narrow the range.")


def batch_plan(global_batch: int, micro_batch: int, world_size: int, *, splits: int = 0
               ) -> tuple[int, int]:
    """(micro-batch, accumulation steps) so that micro x accumulation x workers = global.

    The global batch is fixed by the config; when the worker count changes (an elastic resize,
    a restart on fewer nodes) each rank's share changes, and it is split into equal
    micro-batches no larger than ``micro_batch`` (16 sequences on 2 workers: 8 each, 1 x 8;
    on 1 worker: 2 x 8), or into ``splits`` equal micro-batches when that is given (a
    pipeline's micro-batch count).
    """
    assert global_batch % world_size == 0, (global_batch, world_size)
    per_rank = global_batch // world_size
    if splits:
        assert per_rank % splits == 0, (per_rank, splits)
        return per_rank // splits, splits
    micro = max(m for m in range(1, min(micro_batch, per_rank) + 1) if per_rank % m == 0)
    return micro, per_rank // micro


def _check_pipeline_batches(cfg: Config) -> None:
    """A pipeline step splits a data-parallel rank's share of the global batch into at least
    one micro-batch per stage, all of one size."""
    p, tr = cfg.parallel, cfg.train
    if p.pipeline == 1:
        return
    workers = cfg.scaling.worker_range[0]  # a fixed count: _check_layout saw to it
    dp = workers // model_parallel_group(cfg)[0]
    share = tr.global_batch_size // dp
    if p.pipeline_microbatches and share % p.pipeline_microbatches:
        raise ConfigError(
            f"parallel.pipeline_microbatches={p.pipeline_microbatches} does not divide each "
            f"data-parallel rank's {share} sequences (train.global_batch_size="
            f"{tr.global_batch_size} over {dp} data-parallel ranks); choose a divisor of "
            f"{share}.")
    _, microbatches = batch_plan(tr.global_batch_size, tr.micro_batch_size, dp,
                                 splits=p.pipeline_microbatches)
    if microbatches < p.pipeline:
        raise ConfigError(
            f"parallel.pipeline={p.pipeline} stages over {microbatches} micro-batch"
            f"{'es' if microbatches > 1 else ''} per step would leave stages idle: each "
            f"data-parallel rank's {share} sequences (train.global_batch_size="
            f"{tr.global_batch_size} over {dp} ranks) must split into at least "
            f"{p.pipeline} micro-batches; set parallel.pipeline_microbatches={p.pipeline} "
            f"(or more), lower train.micro_batch_size, or raise train.global_batch_size.")


def _check_preference(cfg: Config) -> None:
    """train.objective=dpo and data.format=preference go together, on what the step supports."""
    dpo = cfg.train.objective == "dpo"
    _check(dpo or not cfg.tune.dpo_betas, "tune.dpo_betas", cfg.tune.dpo_betas,
           "empty unless train.objective=dpo")
    _check(dpo or cfg.data.format != "preference", "data.format", cfg.data.format,
           "chat, prompt_completion or text with train.objective=sft; preference pairs train "
           "with train.objective=dpo")
    _check_reinforcement(cfg)
    if not dpo:
        return
    d = cfg.data
    _check(d.format == "preference", "train.objective", "dpo",
           f"sft with data.format={d.format}; dpo trains on data.format=preference")
    _check(d.trains_on == "assistant", "data.loss_on", d.loss_on,
           "assistant (or unset) with train.objective=dpo: the loss scores the answers only")
    _check(not d.across_documents, "data.cross_document_attention",
           d.cross_document_attention, "false (or unset) with train.objective=dpo: a pair's "
           "two halves share a block and must not see each other")
    _check(not cfg.dpo.needs_reference or bool(cfg.model.path), "dpo.loss", cfg.dpo.loss,
           "simpo (no reference model) when training from scratch; sigmoid and ipo compare "
           "the policy with the pretrained model it starts from: set model.path")
    _data_parallel_only(cfg)


def _check_reinforcement(cfg: Config) -> None:
    """train.objective=grpo, data.format=prompt and a reward go together."""
    grpo, d = cfg.train.objective == "grpo", cfg.data
    _check(grpo or d.format != "prompt", "data.format", d.format,
           "chat, prompt_completion or text with train.objective=sft; prompts train with "
           "train.objective=grpo")
    _check(grpo or cfg.rl.reward is None, "rl.reward", cfg.rl.reward,
           "unset unless train.objective=grpo")
    if not grpo:
        return
    _check(d.format == "prompt", "train.objective", "grpo",
           f"sft with data.format={d.format}; grpo trains on data.format=prompt")
    _check(cfg.rl.reward is not None, "rl.reward", None,
           "a reward function for train.objective=grpo: module:function, exact_match or "
           "final_number")
    _check(not d.across_documents, "data.cross_document_attention",
           d.cross_document_attention, "false (or unset) with train.objective=grpo")
    _check(cfg.rl.max_staleness <= cfg.train.steps, "rl.max_staleness", cfg.rl.max_staleness,
           f"at most train.steps={cfg.train.steps}: generation is asked for steps ahead")
    n, gb = cfg.rl.updates_per_step, cfg.train.global_batch_size
    fewest, most = cfg.scaling.worker_range
    uneven = [w for w in range(fewest, most + 1) if gb % w == 0 and (gb // w) % n]
    _check(not uneven, "rl.updates_per_step", n, f"a divisor of each worker's prompts per step "
           f"(train.global_batch_size={gb} / {uneven[0] if uneven else 1} workers)")
    _data_parallel_only(cfg)


# Swept through lists of their own (TuneConfig), or the run's identity: not in tune.choices.
_OWN_LISTS = {"optim.lr", "optim.schedule", "optim.warmup_steps", "optim.weight_decay",
              "lora.rank", "lora.alpha", "dpo.beta"}


def _check_choices(cfg: Config) -> None:
    """tune.choices: known keys, none with a list of its own, each value a valid setting."""
    choices = cfg.tune.choices
    if not choices:
        return
    tree = cfg.to_dict()
    tree["tune"]["choices"] = {}
    for key, values in choices.items():
        section = key.split(".", 1)[0]
        _check(key in cfg.flat() and key not in _OWN_LISTS and section not in ("run", "tune"),
               "tune.choices", key, "config keys outside run.* and tune.*, other than "
               f"{', '.join(sorted(_OWN_LISTS))} (which have tune lists of their own)")
        _check(isinstance(values, list) and bool(values), f"tune.choices[{key}]", values,
               "a non-empty list of values")
        for value in values:
            candidate = {name: dict(v) for name, v in tree.items()}
            candidate[section][key.split(".", 1)[1]] = value
            config_from_dict(candidate)  # a value that key refuses is refused by its name


def _data_parallel_only(cfg: Config) -> None:
    """The preference and reinforcement steps run on data-parallel workers only."""
    objective = cfg.train.objective
    p = cfg.parallel
    _check(p.tensor == 1 and p.pipeline == 1 and p.context == 1, "train.objective",
           objective, "sft with tensor, pipeline or context parallelism (parallel.tensor, "
           f"parallel.pipeline, parallel.context > 1); {objective} runs on data-parallel "
           f"FSDP2 workers")


def validate(cfg: Config) -> Config:
    """Check the rules that span sections (each section checks its own fields when it is
    made); return ``cfg`` unchanged."""
    lo, sc, tu = cfg.lora, cfg.scaling, cfg.tune
    _check(not lo.rank or bool(cfg.model.path), "lora.rank", lo.rank,
           "0 unless model.path names the pretrained model the adapters adapt")
    if lo.base_quantization == "nf4":
        _check(bool(lo.rank), "lora.base_quantization", lo.base_quantization,
               "none unless lora.rank >= 1 (an NF4 base is frozen: only adapters train)")
        # auto is checked once the cluster is known (raylm.run.resources.choose_device).
        _check(sc.use_gpu is not False, "lora.base_quantization", lo.base_quantization,
               "none on CPU workers: NF4 bases run on CUDA (set scaling.use_gpu=true or auto "
               "on a cluster with GPUs, or train the adapters on an unquantized base)")
    if cfg.model.float8 != "off":
        _check(sc.use_gpu is not False, "model.float8", cfg.model.float8,
               "off on CPU workers: float8 matmuls need CUDA GPUs of compute capability 8.9+ "
               "(set scaling.use_gpu=true or auto on a cluster with GPUs)")
        _check(not lo.rank, "model.float8", cfg.model.float8,
               "off with LoRA (lora.rank > 0): the frozen base and the small adapter matmuls "
               "gain nothing from float8 training")
        _check(cfg.parallel.tensor == 1, "model.float8", cfg.model.float8,
               "off with parallel.tensor > 1 (float8 under tensor parallelism is not "
               "supported); use data or pipeline parallelism")
    _check_choices(cfg)
    _check(not tu.lora_ranks or bool(cfg.model.path), "tune.lora_ranks", tu.lora_ranks,
           "ranks >= 1, with model.path naming the pretrained model they adapt")
    if tu.metric is not None:
        parts = tu.metric.split("/")
        _check(len(parts) >= 3 and parts[0] == "eval" and parts[1] in cfg.eval.tasks,
               "tune.metric", tu.metric, f"unset, or eval/<task>/<metric> with <task> one of "
               f"eval.tasks ({', '.join(cfg.eval.tasks) or 'none set'})")
    _check_preference(cfg)
    _check_layout(cfg)
    _check_batch_shares(cfg.train.global_batch_size, sc.num_workers, sc.worker_range,
                        group=model_parallel_group(cfg)[0])
    _check_pipeline_batches(cfg)
    dp = max(1, sc.worker_range[0] // model_parallel_group(cfg)[0])
    most = MAX_RANK_SAMPLES * dp // cfg.train.global_batch_size
    _check(cfg.train.steps <= most, "train.steps", cfg.train.steps, f"at most {most:,} with "
           f"train.global_batch_size={cfg.train.global_batch_size} over {dp} data-parallel "
           f"worker(s) at the fewest: {MAX_RANK_SAMPLES:,} samples per worker")
    return cfg


def parse_override(arg: str) -> tuple[str, Any]:
    """``--section.key=value`` -> ``("section.key", value)``; the value is read as YAML."""
    body = arg[2:] if arg.startswith("--") else arg
    if "=" not in body or "." not in body.split("=", 1)[0]:
        raise ConfigError(
            f"Cannot read override {_short(arg)}: write it as --section.key=value "
            f"(for example --train.steps=100)."
        )
    key, raw = body.split("=", 1)
    try:
        value = read_yaml(raw) if raw != "" else ""
    except _Refused as e:
        raise ConfigError(f"Override {_short(arg)} is refused: {e}.") from None
    except yaml.YAMLError:
        value = raw
    return key, value


def load_config(path: str | os.PathLike | Config | None = None,
                overrides: Sequence[str] | Mapping[str, Any] = ()) -> Config:
    """Defaults (or the given :class:`Config`), then the YAML file at ``path``, then the
    overrides: ``--section.key=value`` strings (the CLI's, values read as YAML) or a mapping of
    ``section.key`` to a value (the Python API's), checked alike."""
    tree: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    if isinstance(path, Config):
        tree = {name: dict(values) for name, values in path.to_dict().items()}
        if path.run.name == default_run_name(path):
            tree["run"]["name"] = None  # derived again, from the config the overrides make
    elif path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"Config file not found: {p}")
        try:
            loaded = read_yaml(p.read_text()) or {}
        except _Refused as e:
            raise ConfigError(f"Config file {p} is refused: {e}.") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"Config file {p} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"Config file {p} must hold a mapping of sections, not "
                              f"{type(loaded).__name__}.")
        for section, values in loaded.items():
            _merge(tree, section, values, origin=str(p))
    if isinstance(overrides, Mapping):
        pairs, origin = list(overrides.items()), "overrides"
    else:
        pairs, origin = [parse_override(a) for a in overrides], "command line"
    for key, value in pairs:
        if not isinstance(key, str) or "." not in key:
            raise ConfigError(f"Override key {key!r} is not 'section.key' (for example "
                              f"'train.steps').")
        section, _, name = key.partition(".")
        _merge(tree, section, {name: value}, origin=origin)
    # A relative model.path means the caller's directory; workers, Tune trials and later
    # exports run elsewhere, so it travels absolute. A hub id stays one until the entry point
    # resolves it (raylm.hub).
    path = tree["model"].get("path")
    if isinstance(path, str) and path and not storage.is_uri(path) and not is_hub_id(path):
        tree["model"]["path"] = str(Path(path).expanduser().resolve())
    # So does eval.include_path: the benchmarks' Ray tasks read it from another directory;
    # and a reward named by its file (rl.reward=path/to/file.py:function).
    tasks = tree["eval"].get("include_path")
    if isinstance(tasks, str) and tasks:
        tree["eval"]["include_path"] = str(Path(tasks).expanduser().resolve())
    reward = tree["rl"].get("reward")
    if isinstance(reward, str) and ".py:" in reward:
        file, _, fn = reward.rpartition(":")
        tree["rl"]["reward"] = f"{Path(file).expanduser().resolve()}:{fn}"
    cfg = Config(**{name: _build_section(name, values) for name, values in tree.items()})
    return validate(cfg)


def config_from_dict(tree: dict[str, dict[str, Any]]) -> Config:
    """Rebuild a Config from :meth:`Config.to_dict` output (how workers receive it)."""
    return validate(Config(**{name: _build_section(name, dict(values))
                              for name, values in tree.items()}))


def _merge(tree: dict, section: str, values: Any, *, origin: str) -> None:
    if section not in tree:
        raise ConfigError(
            f"Unknown config section '{section}' ({origin}).{_closest(section, list(tree))} "
            f"Sections: {', '.join(tree)}."
        )
    if not isinstance(values, dict):
        raise ConfigError(f"Config section '{section}' ({origin}) must be a mapping of keys, "
                          f"not {_short(values)}.")
    tree[section].update(values)


def storage_root(cfg: Config) -> str:
    """``run.storage_path`` as Ray Train and Tune take it: a URI as given, a path absolute."""
    return storage.normalize(cfg.run.storage_path)


def run_dir(cfg: Config) -> str:
    """RUN_DIR: ``storage_path/name``, a local path or a URI (see :mod:`raylm.storage`)."""
    return storage.join(storage_root(cfg), cfg.run.name)


def cache_dir(cfg: Config) -> Path:
    return Path(cfg.run.cache_dir).expanduser().resolve()
