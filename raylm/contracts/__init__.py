"""What more than one process agrees on: the names of a prepared and a run directory's files,
the kinds of event a run records, and the records read back by a process other than their
writer's (Ray Data tasks, workers, the controller, the driver, later commands, later releases
of raylm), each a versioned dataclass with ``to_json`` and ``from_json``: a checkpoint's
:class:`Marker` and the run's :class:`LeaseRecord`. ``from_json`` reads every version raylm has
written and refuses anything else with :class:`Malformed`, naming what is wrong, so a damaged
record is found where it is read, not as a ``KeyError`` somewhere after. No torch: every
process imports it.
"""

import functools
import json
import os
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any, ClassVar

# A prepared directory (raylm.data.preparation writes it; workers and the driver read it).
PREPARED_MANIFEST = "manifest.json"   # counts, sources, tokenizer, fingerprint
LAYOUT = "layout.json"                # the packed blocks of each split
SPLITS = ("train", "val")             # one folder of block files each
PROMPT_ROW = "prompt_row"             # a prompt block's column: its data row, every column, as
                                      # JSON (what the reward reads; layout.json's prompt_rows)

# A reference directory (raylm.run.reference): per split, a file beside each block file with
# the same row groups, holding the starting model's log-probability of every trained target.
REFERENCE_INFO = "reference.json"     # what it was computed from, and when
REFERENCE_COLUMN = "ref_logp"         # its column, and the batches' key in the stream

# A run directory, RUN_DIR = run.storage_path/run.name, and who writes each of its files.
RUN_INFO = "run.json"                 # the driver at each start: config and tokenizer/ beside it
SUMMARY = "summary.json"              # the controller's record, while the run goes and at its
                                      # end; the driver adds the final model's MLflow URI
EVENTS = "events.jsonl"               # the controller's record of events (raylm.run.record)
EVENT_SEGMENTS = "events"             # the same in object storage, as <invocation>-<n>.jsonl
MLFLOW_RUN = "mlflow_run.json"        # the driver: the MLflow run this run logs into
JOB_CONFIG = "raylm_job.yaml"         # raylm submit: the config a submitted job runs
LEASE = "lease.json"                  # the driver holding the run (raylm.run.lease), with
                                      # lease.json.lock beside it on a file system
SKIPPED = "skipped_samples.json"      # rank 0 at a rewind: positions left out, bad checkpoints
TUNE_EXPERIMENT = "tune"              # a sweep's Ray Tune experiment, its trials in trials/
BENCHMARKS = ".benchmarks"            # the controller: step_N/, hard links of a checkpoint's
                                      # files while its benchmark evaluation waits
RAY_TRAIN_STATE = "checkpoint_manager_snapshot.json"  # Ray Train: the checkpoints it keeps

# An exported model directory (raylm export): what it is, from which run and step.
EXPORT_INFO = "raylm_export.json"

# A checkpoint directory, checkpoint_*: Ray Train's upload of every rank's DCP shards and
# .metadata, with rank 0's ledger and, last, its marker (raylm.rundir.verify reads them).
CHECKPOINT_MARKER = "raylm_checkpoint.json"   # present once the checkpoint is complete
CHECKPOINT_SAMPLES = "samples.npy"            # the per-sample ledger at the checkpoint
CHECKPOINT_ROLLOUTS = "rollouts.json"         # off-policy RL: completions not yet trained on

# The kinds of record in a run's events.jsonl, each its ``event`` (the name in lower case), and
# of the interruptions its summary lists (RESTART, RESIZE). A new worker group reports
# GROUP_START first; the controller's record writes the rest.
Event = StrEnum("Event", " ".join(("INVOCATION DEVICE SCHEDULE_MOVED RESUMED_WITH_CHANGES PLACING",
                                   "PLACED GROUP_START PROGRESS NUMERICAL_FAULT FAILURE RESTART",
                                   "RESIZE BENCHMARK BENCHMARK_FAILED WAITED_FOR_BENCHMARKS",
                                   "TRACKING_LOST END")), module=__name__)
# The key of a report that carries the reports a worker held back while the one before waited
# for the controller (raylm.workers.checkpoint.Checkpointer), oldest first.
EARLIER_REPORTS = "earlier_reports"


class Malformed(ValueError):
    """A record that is not of its contract's shape (damaged, or not written by raylm)."""


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _time(v) -> bool:  # seconds since the epoch; NaN and infinities fail it
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e11


def _of(test) -> Callable[[Any], bool]:
    """A test of a JSON object whose every value passes ``test``."""
    return lambda v: isinstance(v, dict) and all(isinstance(k, str) and test(x)
                                                 for k, x in v.items())


def fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value is of a field's annotated type (an int is a float; ``Any`` is
    anything; of a list or mapping, only the container is checked)."""
    if hint is Any:
        return True
    if isinstance(hint, types.UnionType):
        return any(fits(value, h) for h in typing.get_args(hint))
    kind = typing.get_origin(hint) or hint
    if kind is type(None):
        return value is None
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


@functools.cache
def hints(cls) -> dict[str, Any]:
    """A record's fields' annotations, resolved once (a run's history reads thousands)."""
    return typing.get_type_hints(cls)


def typed(cls, data: Any, what: str):
    """``cls`` (a dataclass) of the JSON object ``data``: every key one of its fields, every
    field without a default there, every value of its field's type; else :class:`Malformed`,
    naming ``what``."""
    types = hints(cls)
    needed = {f.name for f in fields(cls) if f.default is f.default_factory is MISSING}
    if (not isinstance(data, dict) or not needed <= set(data) <= set(types)
            or not all(fits(v, types[k]) for k, v in data.items())):
        raise Malformed(f"{what} is malformed ({data!r:.200})")
    return cls(**data)


class _Record:
    """A JSON record of version :data:`VERSION`, read back from every earlier one: ``CHECKS``
    says, per field, what its value must be; a field an older version lacks has a default."""

    FILE: ClassVar[str]
    VERSION: ClassVar[int] = 2  # 1: the records raylm wrote before they carried a version
    CHECKS: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]]

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "version": self.VERSION}, indent=1)

    @classmethod
    def _decoded(cls, text: str | bytes) -> dict:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            data = None
        if not isinstance(data, dict) or not _count(data.get("version", 1)):
            raise Malformed(f"{cls.FILE} is malformed (not a JSON object of a version)")
        if data.get("version", 1) > cls.VERSION:
            raise Malformed(f"{cls.FILE} is of version {data['version']}, newer than this "
                            f"raylm reads: upgrade raylm")
        return data

    @classmethod
    def from_json(cls, text: str | bytes):
        return cls._checked(cls._decoded(text))

    @classmethod
    def _checked(cls, data: dict):
        found = {}
        for f in fields(cls):
            if f.name not in data:
                if f.default is MISSING and f.default_factory is MISSING:
                    raise Malformed(f"{cls.FILE} is malformed ({f.name} is missing)")
                continue
            test, should = cls.CHECKS[f.name]
            if not test(data[f.name]):
                raise Malformed(f"{cls.FILE} is malformed ({f.name} is not {should})")
            found[f.name] = data[f.name]
        return cls(**found)


@dataclass(frozen=True)
class Marker(_Record):
    """``raylm_checkpoint.json``, which rank 0 writes last into a checkpoint directory, so a
    checkpoint without one is unfinished. ``state``: the train state to resume from (step,
    tokens seen, data position, clocks); ``model``: the shape its weights fit; ``files`` and
    ``hashes``: every rank's files, by size and by digest; ``adapters``: its LoRA settings;
    ``identity``: what it trained on (data, tokenizer, base model). The oldest markers (of
    version 1) lack ``hashes``, ``identity`` and ``world_size``."""

    FILE = CHECKPOINT_MARKER
    CHECKS = {"state": (lambda v: isinstance(v, dict) and _count(v.get("step")),
                        "an object with a step number"),
              "model": (_of(lambda x: True), "an object"),
              "files": (lambda v: bool(v) and _of(_count)(v), "an object of sizes, not empty"),
              "hashes": (_of(lambda x: isinstance(x, str)), "an object of digests"),
              "world_size": (lambda v: _count(v) and v > 0, "a number of ranks"),
              "adapters": (_of(lambda x: True), "an object"),
              "identity": (_of(lambda x: isinstance(x, str)), "an object of strings")}

    state: dict
    model: dict
    files: dict[str, int]
    hashes: dict[str, str] = field(default_factory=dict)
    world_size: int = 1
    adapters: dict = field(default_factory=dict)
    identity: dict[str, str] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return self.state["step"]


@dataclass(frozen=True)
class LeaseRecord(_Record):
    """``lease.json``: who drives the run now (:mod:`raylm.run.lease`): its host and pid, when
    it started, when it last renewed the lease (``beat``), the token its run's workers check,
    and ``owner``, what holds it across processes (a Tune trial)."""

    FILE = LEASE
    RELEASED = json.dumps({"released": True})  # what a store that cannot delete leaves
    CHECKS = {"host": (lambda v: isinstance(v, str), "a host name"),
              "pid": (lambda v: _count(v) and v > 0, "a process id"),
              "started": (_time, "a time"), "beat": (_time, "a time"),
              "token": (lambda v: isinstance(v, str), "a string"),
              "owner": (lambda v: v is None or isinstance(v, str), "a name"),
              "machine": (lambda v: v is None or isinstance(v, str), "a boot and PID namespace")}

    host: str
    pid: int
    started: float
    beat: float
    token: str
    owner: str | None = None
    machine: str | None = None
    """Its boot and PID namespace (:func:`raylm.run.lease.this_machine`; None before 0.3)."""

    @classmethod
    def from_json(cls, text: str | bytes) -> "LeaseRecord | None":
        """The holder; None for a lease given back."""
        data = cls._decoded(text)
        return None if data.get("released") is True else cls._checked(data)


#: How a run renders a prompt given as a string (``RunInfo.string_prompts``): ``as_written``,
#: the text as it is with no template, in every format (the ecosystem's rule, TRL's; a list of
#: messages goes through the chat template); ``user_turn``, a preference or prompt row's string
#: as one user turn through the template, the rule of runs started before ``as_written``, which
#: keep it.
STRING_PROMPTS = ("as_written", "user_turn")


@dataclass(frozen=True)
class RunInfo(_Record):
    """``run.json``, which the driver writes at each start
    (:func:`raylm.formats.exporter.write_run_info`): the run's resolved config (secrets
    redacted), its tokenizer's vocabulary and EOS id, the prepared data it trains on, and the
    version of raylm's default chat template it renders with (1 where a run.json names none: a
    run started before version 2), and how it renders string prompts (:data:`STRING_PROMPTS`;
    ``user_turn`` where it names none). Those of version 1 carry no version."""

    FILE = RUN_INFO
    CHECKS = {"config": (_of(lambda x: isinstance(x, dict)), "an object of config sections"),
              "vocab_size": (lambda v: _count(v) and v > 0, "a number of tokens"),
              "eos_id": (_count, "a token id"),
              "prepared": (lambda v: v is None or isinstance(v, str), "a path"),
              "default_template": (_count, "a template version"),
              "string_prompts": (lambda v: v in STRING_PROMPTS, " or ".join(STRING_PROMPTS))}

    config: dict
    vocab_size: int
    eos_id: int
    prepared: str | None = None
    default_template: int = 1
    string_prompts: str = "user_turn"


@dataclass(kw_only=True)
class ExportInfo:
    """``raylm_export.json``, beside an export (``raylm export``, ``raylm prune``): its
    ``kind`` (``model``, ``lora-adapter``, ``model-int8``, ``gguf-<type>``, ``pruned``), the
    run and step it came from, the default template version and string-prompt rule it was
    trained with (:class:`RunInfo`'s), and what
    its kind adds (``details``: a quantization's sizes and losses, a GGUF file's tensors,
    pruning's report), written beside them."""

    kind: str
    step: int | None = None
    run_dir: str | None = None
    default_template: int = 1
    string_prompts: str = "user_turn"
    details: dict[str, Any] = field(default_factory=dict)

    HEAD = ("run_dir", "step", "kind", "default_template", "string_prompts")

    def to_json(self) -> str:
        head = {k: getattr(self, k) for k in self.HEAD}
        return json.dumps({**head, **self.details}, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> "ExportInfo":
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
            raise Malformed(f"{EXPORT_INFO} is malformed (not a JSON object with a kind)")
        named = {k: data[k] for k in cls.HEAD if k in data}
        for k, v in named.items():
            if not fits(v, hints(cls)[k]):
                raise Malformed(f"{EXPORT_INFO} is malformed ({k} is {v!r:.100})")
        return cls(**named, details={k: v for k, v in data.items() if k not in named})

    @classmethod
    def read(cls, directory) -> "ExportInfo | None":
        """The record of the export in ``directory``; None where it has none."""
        path = os.path.join(directory, EXPORT_INFO)
        if not os.path.isfile(path):
            return None
        with open(path, "rb") as f:
            return cls.from_json(f.read())
