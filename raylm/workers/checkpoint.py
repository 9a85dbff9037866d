"""Sharded checkpoints with torch.distributed.checkpoint, verified before they are trusted.

A checkpoint directory holds the DCP shards of model and optimizer (each rank writes its own
files; DCP's metadata lets a different world size load and reshard them), the sample ledger
``samples.npy`` (see ``raylm.workers.ledger``), an objective's own files (an off-policy RL
run's rollouts not yet trained on, ``rollouts.json``: :mod:`raylm.contracts.rollouts`), and
``raylm_checkpoint.json``, written last by rank 0: the train state (step, tokens seen, data
position), the model's shape, and the name, size and BLAKE2b hash of every file of every rank.
The marker's format and its verification are :mod:`raylm.rundir`'s, which every process reads a
run through; this module writes checkpoints and loads them into a model. A directory counts as
a checkpoint only if that marker exists and every file it lists is there at its size, and, for
files up to :data:`HASHED_ON_RESUME` (DCP's metadata, the ledger, small shards), with its hash;
so a save cut short (a killed worker, a full disk, an interrupted upload) or a small file
changed in place is skipped with a warning and the one before it is used. Large shards are
checked by size on resume (hashing them would read the whole checkpoint at every resume, which
the ranged reads below exist to avoid); ``verify(..., every_hash=True)`` checks them all.
Checkpoints may live in object storage (see ``raylm.storage``): they are verified there, and
each resuming rank reads from there only what it loads (:class:`RangeReader`): the metadata,
then one ranged read per stored chunk its shards overlap. A rank of N resuming a checkpoint
that N ranks saved fetches ~1/N of it, where downloading the directory first would cost every
rank all of it (16 x 12.5 GB per restart for the 1B multi-node config). The learning-rate
schedule is a pure function of the step, so it needs no state of its own.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
import shutil
import tempfile
import threading
import time
import types
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pyarrow import fs as pafs
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from raylm import storage
from raylm.compat import set_element
from raylm.contracts import (
    CHECKPOINT_MARKER,
    CHECKPOINT_SAMPLES,
    EARLIER_REPORTS,
    Marker,
)
from raylm.outputs import alive
from raylm.rundir import CheckpointError, check_compatible, file_hash, model_shape, verify
from raylm.workers.preemption import report_queue

log = logging.getLogger("raylm.workers.checkpoint")

def _options(model: nn.Module):
    """A model with frozen parameters (LoRA) checkpoints only what trains: the frozen base is
    read from model.path on every start."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    # Loading such a checkpoint sets the trainable parameters only (the keys it holds).
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": _without_frozen(model, get_model_state_dict(model,
                                                                     options=_options(model)))}
    msd, osd = get_state_dict(model, optimizer, options=_options(model))
    return {"model": _without_frozen(model, msd), "optim": osd}


def _parameter_names(model: nn.Module) -> dict[str, str | None]:
    """Every name of every parameter (wrappers removed, as in state dicts) -> the one name it is
    checkpointed under: the first of a tied weight's names, None for a frozen one."""
    first: dict[int, str] = {}
    names: dict[str, str | None] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        n = n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        first.setdefault(id(p), n)
        names[n] = first[id(p)] if p.requires_grad else None
    return names


def _without_frozen(model: nn.Module, msd: dict[str, Any]) -> dict[str, Any]:
    """``msd`` with each trainable parameter under one name and no frozen one.
    ``ignore_frozen_params`` drops a frozen weight under the one name ``named_parameters()``
    gives it, so a tied model's frozen head stayed under its second name (every LoRA
    checkpoint of Qwen3 1.7B held its 311 M-value head: 835 MB beside 210 MB of adapters and
    their AdamW moments), and a full fine-tune stored its tied embedding twice."""
    names = _parameter_names(model)
    return {k: v for k, v in msd.items() if k not in names or names[k] == k}


def _with_aliases(model: nn.Module, msd: dict[str, Any]) -> dict[str, Any]:
    """``msd`` with a tied weight under each of its names again, as loading it strictly needs."""
    aliases = {n: kept for n, kept in _parameter_names(model).items()
               if kept is not None and kept != n and kept in msd}
    return {**msd, **{n: msd[kept] for n, kept in aliases.items()}}


def save(directory: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer,
         state: dict[str, Any], config, samples: np.ndarray | None = None,
         adapters: dict[str, Any] | None = None, identity: dict[str, str] | None = None,
         extra: dict[str, bytes] | None = None) -> None:
    """Write this rank's shards into ``directory`` (rank 0 also ``samples``, the sample
    ledger, ``extra``, the objective's own files by name (an off-policy RL run's rollouts
    not yet trained on), and the marker, last). ``identity``: what the run trains with (data,
    tokenizer, base model; see :func:`raylm.rundir.check_same_run`)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(_state_dicts(model, optimizer), checkpoint_id=str(path))
    _write_marker(path, state=state, config=config, samples=samples, adapters=adapters,
                  identity=identity, extra=extra)


SHM = "/dev/shm"


def staged_bytes(model: nn.Module) -> int:
    """What a save of this rank stages: its shards of the trainable weights and of their two
    AdamW moments (a LoRA run checkpoints its adapters only)."""
    n = 0
    for p in model.parameters():
        if p.requires_grad:
            local = p.to_local() if hasattr(p, "to_local") else p
            n += local.numel() * local.element_size()
    return 3 * n


def choose_writer(writer: str, *, device: torch.device, model: nn.Module,
                  workers_on_node: int, shm: str = SHM) -> str:
    """The writer ``checkpoint.writer`` asks for on this worker. The process writer stages
    into shared memory, so the node's ``/dev/shm`` must hold every local worker's staged state
    (a container's default is 64 MB): where it cannot, ``auto`` writes from a thread and says
    so, and ``process`` is refused, both naming the fix, rather than failing at the first save
    (a bus error when the staging copy runs out of room)."""
    if writer == "thread" or (writer == "auto" and device.type != "cuda"):
        return "thread"
    need = staged_bytes(model) * workers_on_node
    free = shutil.disk_usage(shm).free if os.path.isdir(shm) else 0
    if free >= need:
        return "process"
    detail = (f"checkpoint.writer=process stages {workers_on_node} workers' checkpoints in "
              f"shared memory ({need / 1e9:.2f} GB) but {shm} has {free / 1e9:.2f} GB free: "
              f"give the node more (docker run --shm-size, a Kubernetes emptyDir with medium: "
              f"Memory)")
    if writer == "process":
        raise ValueError(f"{detail}, or set checkpoint.writer=thread")
    print(f"raylm: {detail}; writing checkpoints from a thread meanwhile", flush=True)
    return "thread"


def stager(*, writer: str, device: torch.device):
    """Where asynchronous saves copy the state to before training goes on: host buffers made at
    the first save and reused by every later one (DCP's default stager allocates and frees
    them at every save, and copying 1.6 GB into fresh pages took 1.0-2.3 s on a CPU here,
    into kept ones 0.24 s). Pinned on a GPU host, so the copy from the device runs at full
    speed; in shared memory for the ``process`` writer, so only handles cross to it. Owned by
    the caller, who keeps one per worker."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = device.type == "cuda"
    return DefaultStager(StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=writer == "process",
        use_async_staging=False, use_non_blocking_copy=cuda))


class AsyncSave:
    """A save whose shards are written in the background. Made by every rank at the same step:
    the state is copied (staged, into ``stager``'s buffers) before the constructor returns, so
    training may go on and change it; DCP's planning and writing then run over ``group`` (a
    gloo group used by nothing else, so their collectives never interleave with training's),
    from a thread of this process or (``writer="process"``) from DCP's daemon process, started
    at the first save and kept, whose interpreter lock is its own. :meth:`finish`, also on
    every rank and over the same group, waits for the write and then writes the marker, so a
    checkpoint cut short by a crash never has one."""

    def __init__(self, directory: str | os.PathLike, *, model: nn.Module,
                 optimizer: torch.optim.Optimizer, state: dict[str, Any], config,
                 samples: np.ndarray | None, adapters: dict[str, Any] | None,
                 group: dist.ProcessGroup | None, stager=None, writer: str = "thread",
                 identity: dict[str, str] | None = None, extra: dict[str, bytes] | None = None
                 ) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.path = Path(directory)
        self.path.mkdir(parents=True, exist_ok=True)
        self.group = group
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._marker = dict(state=state, config=config, samples=samples, adapters=adapters,
                            identity=identity, extra=extra)
        self._write = dcp.async_save(
            _state_dicts(model, optimizer), checkpoint_id=str(self.path), process_group=group,
            async_stager=stager,
            async_checkpointer_type=(AsyncCheckpointerType.PROCESS if writer == "process"
                                     else AsyncCheckpointerType.THREAD))

    def finish(self) -> None:
        self._write.result()
        _write_marker(self.path, group=self.group, world=self.world, **self._marker)


def _write_marker(path: Path, *, state: dict[str, Any], config, samples: np.ndarray | None,
                  adapters: dict[str, Any] | None, group: dist.ProcessGroup | None = None,
                  identity: dict[str, str] | None = None, world: int | None = None,
                  extra: dict[str, bytes] | None = None) -> None:
    """Rank 0 writes the ledger and then the marker naming every rank's files, their sizes
    and hashes (each rank hashes its own, just written and still in the page cache).
    ``world``: how many ranks saved (an asynchronous save's finish comes later, from Ray
    Train's upload thread)."""
    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1 and not dist.is_initialized():
        # A group torn down while its checkpoint was in flight (a node lost): Ray Train
        # destroys the process group, and the upload thread finished the save after it. A
        # marker of this rank's files alone would pass for a whole checkpoint of one rank
        # (the others' shards named by DCP's metadata, never uploaded), and every resume
        # from it would fail in DCP's load; without a marker it is skipped as unfinished.
        raise CheckpointError(f"{path}: the process group of its {world} ranks ended before "
                              f"every rank's files were known; no marker is written")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if samples is not None and rank0:
        np.save(path / CHECKPOINT_SAMPLES, samples)
    for name, data in (extra or {}).items() if rank0 else ():
        (path / name).write_bytes(data)
    mine = {p.name: (p.stat().st_size, file_hash(storage.read_chunks(str(p))))
            for p in path.iterdir() if p.is_file() and p.name != CHECKPOINT_MARKER}
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine, group=group)
    if rank0:
        found: dict[str, tuple[int, str]] = {}
        for f in everyone:
            found.update(f)
        files = {name: size for name, (size, _) in found.items()}
        hashes = {name: digest for name, (_, digest) in found.items()}
        marker = Marker(state=state, model=model_shape(config), files=files, hashes=hashes,
                        world_size=dist.get_world_size() if dist.is_initialized() else 1,
                        adapters=adapters or {}, identity=identity or {})
        tmp = path / f".{CHECKPOINT_MARKER}.tmp"
        tmp.write_text(marker.to_json())
        os.replace(tmp, path / CHECKPOINT_MARKER)


def load(directory: str | os.PathLike, *, model: nn.Module,
         optimizer: torch.optim.Optimizer | None, config,
         adapters: dict[str, Any] | None = None,
         fetched: dict[str, int] | None = None) -> dict[str, int]:
    """Load a verified checkpoint into ``model`` (and ``optimizer``); return its train state.
    Works for any world size: DCP reshards to the current one. From object storage, this
    rank's fetched byte count goes into ``fetched["bytes"]`` when given."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    marker = verify(directory)
    check_compatible(marker, config, str(directory), adapters)
    sd = _state_dicts(model, optimizer)
    # The metadata first, on its own (DCP would bury a refused one in its collective's error):
    # it may point at the files the marker lists (and verified), at nothing else.
    metadata = (RangeReader if storage.is_uri(directory) else SafeReader)(str(directory))
    named = {s.relative_path for s in metadata.read_metadata().storage_data.values()}
    unlisted = sorted(named - set(marker.files))
    if unlisted:
        raise CheckpointError(f"{directory}: its metadata points at {unlisted[0]}, which its "
                              f"marker does not list: refused unread.")
    reader = (RangeReader if storage.is_uri(directory) else SafeReader)(str(directory))
    try:
        dcp.load(sd, storage_reader=reader, planner=DataOnlyPlanner(str(directory)))
    except CheckpointException as e:
        # A refused item is this module's own error; any other failure a fault, in one line
        # (DCP's own message holds every rank's traceback).
        failures = [exc for exc, _ in e.failures.values()]
        refused = [exc for exc in failures if isinstance(exc, CheckpointError)]
        raise refused[0] if refused else RuntimeError(
            f"{directory}: DCP could not read it: {type(failures[0]).__name__}: "
            f"{str(failures[0]).partition(chr(10))[0][:300]}") from None
    if isinstance(reader, RangeReader):
        if fetched is not None:
            fetched["bytes"] = reader.fetched
        log.info("restored from %s: fetched %d bytes", directory, reader.fetched)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, _with_aliases(model, sd["model"]), options=_options(model))
    else:
        set_state_dict(model, optimizer, model_state_dict=_with_aliases(model, sd["model"]),
                       optim_state_dict=sd["optim"], options=_options(model))
    return marker.state


# What DCP's metadata (a pickle) holds in a checkpoint raylm wrote: DCP's own records, torch's
# sizes, dtypes, layouts and memory formats, and paths. Nothing else is unpickled.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
     ("torch.serialization", "_get_layout"), ("torch", "Size"),
     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        value = getattr(torch, name, None) if module == "torch" else None
        if (module, name) in _METADATA_CLASSES or isinstance(
                value, (torch.dtype, torch.layout, torch.memory_format)):
            return super().find_class(module, name)
        raise CheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which no checkpoint raylm writes "
            f"holds: refused unread (a planted pickle would run code). Remove the checkpoint, "
            f"and see who can write under run.storage_path.")


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:  # plain data names no global
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")


_PLAIN = types.SimpleNamespace(__name__="plain", Unpickler=_NoGlobals,  # torch's legacy format
                               load=lambda f, **kw: _NoGlobals(f, **kw).load())  # uses load


def _plain(value: Any) -> bool:
    """Whether ``value`` is what a checkpoint's non-tensor items hold: numbers, strings, None,
    and lists, tuples and string-keyed dicts of them."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


class DataOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading a checkpoint's non-tensor items as data only. DCP stores
    every value that is not a tensor (AdamW's learning rate, betas and parameter names) as a
    pickle and its default planner unpickles it with ``torch.load(weights_only=False)``, which
    runs whatever the pickle names: whoever can write the checkpoint's storage could run code
    on every worker at a resume. Here such an item is unpickled with no global at all (torch's
    restricted one calls classes registered as safe: DeviceMesh's opened connections) and
    must be plain data; an item stored as an object where the state being loaded has a tensor
    (a model weight, which raylm never stores that way) is refused unread."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        if isinstance(self.state_dict.get(fqn), torch.Tensor):
            raise CheckpointError(
                f"{self.where}: {fqn} is stored as a pickled object where the model has a "
                f"tensor, which no checkpoint raylm writes holds: refused unread. Remove the "
                f"checkpoint, and see who can write under run.storage_path.")
        try:
            obj = torch.load(value, pickle_module=_PLAIN, weights_only=False)
        except pickle.UnpicklingError as e:
            named = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            raise CheckpointError(
                f"{self.where}: {fqn} holds a pickle that names "
                f"{named.group(1) if named else 'code'}, where a checkpoint raylm writes holds "
                f"data: refused unread. Remove the checkpoint, and see who can write under "
                f"run.storage_path.") from None
        if not _plain(obj):
            raise CheckpointError(f"{self.where}: {fqn} holds a {type(obj).__name__}, where a "
                                  f"checkpoint raylm writes holds numbers and names: refused.")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeReader(FileSystemReader):
    """DCP's reader, reading the checkpoint's metadata with :class:`_MetadataUnpickler` rather
    than ``pickle.load``: a checkpoint whose metadata names anything else is refused instead
    of running it. (The tensor data DCP reads with ``torch.load(weights_only=True)``; the
    other items :class:`DataOnlyPlanner` reads as data.)"""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _ArrowFiles(FileSystemBase):
    """The read side of DCP's filesystem interface over a pyarrow filesystem (S3, GCS, HDFS,
    file://): the filesystems raylm's storage uses, so a URI that holds runs holds
    checkpoints, with no second set of credentials. Counts the bytes streamed (the metadata);
    ranged reads are counted by :class:`RangeReader`."""

    def __init__(self, fs: pafs.FileSystem) -> None:
        self.fs = fs
        self.streamed = 0

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if mode != "rb":
            raise ValueError(f"checkpoints in object storage are written by Ray Train's "
                             f"upload, not here (mode {mode!r})")
        with self.fs.open_input_file(str(path)) as f:
            yield f
            self.streamed += f.tell()

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def init_path(self, path: str | os.PathLike) -> str:
        return str(path)

    def exists(self, path: str | os.PathLike) -> bool:
        return self.fs.get_file_info(str(path)).type != pafs.FileType.NotFound

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return storage.is_uri(checkpoint_id)

    def rename(self, path, new_path) -> None:
        raise NotImplementedError("read-only")

    def mkdir(self, path) -> None:
        raise NotImplementedError("read-only")

    def rm_file(self, path) -> None:
        raise NotImplementedError("read-only")


class RangeReader(SafeReader):
    """DCP's file reader for a checkpoint in object storage that reads only what this rank
    loads: each stored chunk its plan asks for is one ranged read (``read_at``) of exactly
    that chunk's bytes. DCP's own reader would stream each chunk through small seeks and
    reads (one request each on S3); torch's fsspec reader needs fsspec's S3/GCS packages and
    their credentials besides pyarrow's. A chunk is read whole even where this rank needs part
    of it (a checkpoint saved by fewer ranks): DCP stores chunks as serialized tensors."""

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        fs, root = pafs.FileSystem.from_uri(uri)
        self.fs = _ArrowFiles(fs)
        self.path = root
        self.ranged = 0

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(None)
        if checkpoint_id:
            self.path = pafs.FileSystem.from_uri(str(checkpoint_id))[1]

    def _slice_file(self, file, sinfo) -> io.BytesIO:
        chunk = file.read_at(sinfo.length, sinfo.offset)
        self.ranged += len(chunk)
        return io.BytesIO(chunk)

    @property
    def fetched(self) -> int:
        """Bytes this reader has fetched: metadata and chunks."""
        return self.fs.streamed + self.ranged


# ---- A worker's checkpoints through Ray Train: staged, written (in the background) and reported


class Checkpointer:
    """Checkpoints of one worker, synchronous or (``checkpoint.asynchronous``) in the
    background: the state is staged at the step (a copy into host buffers kept from one save to
    the next, so training goes on), DCP writes it (from a thread, or from its daemon process:
    ``checkpoint.writer``) over a gloo group only checkpoints use, and Ray Train's upload thread
    (one per worker, reports in order) waits for the write, writes the marker and copies the
    directory to storage. One checkpoint is in flight at most: the next waits for the one
    before, so the group's collectives never interleave. Reports made meanwhile go through the
    same thread, so the loop does not wait for the upload either. (Ray is imported in place.)

    Reports wait for nothing either (docs/training.md, "Reports and Ray Train's poll", says
    why): one without a checkpoint made while any rank's last one is not taken (the ranks
    agree through :class:`raylm.workers.preemption.Vote`) is held back and sent, oldest first,
    under ``EARLIER_REPORTS`` of the next that goes out; the loop waits for the controller
    only at checkpoints, the end and a preemption."""

    def __init__(self, asynchronous: bool, writer: str, *, device: torch.device,
                 model: nn.Module) -> None:
        import ray.train
        self.asynchronous = asynchronous
        remove_stale_staging()
        # Made by every rank in the same order, as new_group needs.
        self.group = (dist.new_group(backend="gloo")
                      if asynchronous and dist.is_initialized() else None)
        self.writer = self.stager = None
        if asynchronous:
            self.writer = choose_writer(
                writer, device=device, model=model,
                workers_on_node=ray.train.get_context().get_local_world_size())
            if self.group is not None:
                # Every rank writes the same way: the ranks' writer processes form a process
                # group of their own, which all of them must join.
                vote = torch.tensor([int(self.writer == "process")])
                dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=self.group)
                self.writer = "process" if vote.item() else "thread"
            # Its host buffers are made at the first save and reused: one checkpoint is in
            # flight at most, so a save never stages into buffers a write still reads.
            self.stager = stager(writer=self.writer, device=device)
        self._uploaded: threading.Event | None = None
        self.held: list[dict[str, Any]] = []  # reports held back, oldest first

    def busy(self) -> bool:
        """Whether a report now could wait: this worker's last report is not taken by the
        controller yet, or a checkpoint is still being uploaded (reports queue behind it)."""
        reports = report_queue()
        return bool(reports is not None and reports.unfinished_tasks) or (
            self._uploaded is not None and not self._uploaded.is_set())

    def _with_held(self, metrics: dict[str, Any]) -> dict[str, Any]:
        if self.held:
            metrics = {**metrics, EARLIER_REPORTS: self.held}
            self.held = []
        return metrics

    def wait(self) -> None:
        """Until the checkpoint in flight (if any) is written, marked and uploaded."""
        if self._uploaded is not None:
            self._uploaded.wait()
            self._uploaded = None

    def report(self, metrics: dict[str, Any], *, hold: bool = False) -> None:
        """Report ``metrics``, or with ``hold`` (every rank alike: some rank's last report is
        not taken yet) keep them for the next report."""
        import ray.train

        if hold:
            self.held.append(metrics)
            return
        metrics = self._with_held(metrics)
        if self._uploaded is None or self._uploaded.is_set():
            ray.train.report(metrics)
        else:
            ray.train.report(metrics,
                             checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)

    def save(self, metrics: dict[str, Any], *, step: int, wait: bool, **saving: Any) -> None:
        """Checkpoint ``saving`` (what :func:`save` takes) at ``step`` and report ``metrics``
        with it: written before this returns if ``wait`` (or not asynchronous), else in the
        background."""
        import ray.train

        self.wait()
        metrics = self._with_held(metrics)
        prefix = staging_prefix(step)
        if wait or not self.asynchronous:
            with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
                t0 = time.perf_counter()
                save(tmp, **saving)
                if "clock" in metrics:  # the report counts the write it reports, and ends
                    metrics["clock"]["checkpoint_s"] += time.perf_counter() - t0
                    metrics["clock"]["t"] = time.time()
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
            return
        # Ray Train deletes the directory once it is uploaded.
        pending = AsyncSave(tempfile.mkdtemp(prefix=prefix), group=self.group,
                            stager=self.stager, writer=self.writer, **saving)
        uploaded = threading.Event()

        def finish_and_upload(checkpoint: ray.train.Checkpoint, name: str):
            try:
                pending.finish()
                return ray.train.get_context().get_storage().persist_current_checkpoint(
                    checkpoint, name)
            finally:
                uploaded.set()

        self._uploaded = uploaded
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(pending.path),
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                         checkpoint_upload_fn=finish_and_upload,
                         delete_local_checkpoint_after_upload=True)


STAGING = "raylm-ckpt-"


def staging_prefix(step: int) -> str:
    """Where a checkpoint is written before Ray Train uploads it: the local temporary directory,
    named by process and step (``raylm-ckpt-<pid>-step<step>-...``)."""
    return f"{STAGING}{os.getpid()}-step{step}-"


def remove_stale_staging() -> None:
    """Delete the staging directories of processes that are gone: a worker killed during a save
    leaves its directory behind, and the workers of the next group on the node clean up."""
    for path in Path(tempfile.gettempdir()).glob(f"{STAGING}*-step*"):
        pid = path.name[len(STAGING):].split("-", 1)[0]
        # ASCII digits a pid can have (str.isdigit() takes '²', which int() refuses, and a
        # number too large for os.kill).
        if not re.fullmatch(r"[0-9]{1,9}", pid) or not path.is_dir() or path.is_symlink():
            continue  # not a staging directory raylm made: not raylm's to remove
        if not alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
