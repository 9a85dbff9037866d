"""The run directory's own format, read and checked without torch: the driver, the Ray Train
controller, the sweep, the exporter and the workers all read a run through this module, and
the workers also write it (:mod:`raylm.workers.checkpoint` writes checkpoints with DCP; the
skip manifest is written by a rewind).

What a run directory ``RUN_DIR = run.storage_path/run.name`` holds, and who writes each
file, is listed where the files are named, in :mod:`raylm.contracts`.

A resume finds its checkpoint by listing ``checkpoint_*`` in storage and verifying markers
(:func:`latest_usable`) rather than through ``ray.train.get_checkpoint()``: Ray Train knows
only the checkpoints its current controller registered, while a run resumed by a new
invocation, a checkpoint skipped because it is incomplete, or one a rewind marked bad must be
decided from what storage holds.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
from collections.abc import Collection
from typing import Any

import numpy as np

from raylm import storage
from raylm.contracts import (
    CHECKPOINT_MARKER,
    CHECKPOINT_ROLLOUTS,
    CHECKPOINT_SAMPLES,
    RAY_TRAIN_STATE,
    RUN_INFO,
    SKIPPED,
    SUMMARY,
    TUNE_EXPERIMENT,
    Malformed,
    Marker,
    RunInfo,
)
from raylm.contracts.summary import Summary
from raylm.data.packing import SampleOrder, Skips

log = logging.getLogger("raylm.rundir")

# The model settings a checkpoint must agree with to be loaded into a model.
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "tie_word_embeddings")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: incomplete, corrupted or for another model."""


def read_run_info(run_dir: str) -> RunInfo:
    """``RUN_DIR/run.json``: the resolved config, vocabulary, EOS id and prepared data."""
    path = storage.join(run_dir, RUN_INFO)
    if not storage.is_file(path):
        raise ValueError(f"{run_dir} is not a raylm run directory (no {RUN_INFO}); pass the "
                         f"directory `raylm train` printed as its run dir.")
    try:
        return RunInfo.from_json(storage.read_text(path))
    except Malformed as e:
        raise Malformed(f"{run_dir}: {e}") from None


def read_summary(run_dir: str) -> Summary | None:
    """``RUN_DIR/summary.json``; None where the run has written none yet."""
    path = storage.join(run_dir, SUMMARY)
    if not storage.is_file(path):
        return None
    try:
        return Summary.from_json(storage.read_text(path))
    except Malformed as e:
        raise Malformed(f"{run_dir}: {e}") from None


def write_summary(run_dir: str, summary: Summary) -> None:
    storage.write_text(storage.join(run_dir, SUMMARY), summary.to_json())


def model_shape(config) -> dict[str, Any]:
    return {k: getattr(config, k, None) for k in SHAPE_KEYS}


HASHED_ON_RESUME = 64 << 20
"""Files up to this size are checked by hash whenever a checkpoint is verified."""


def file_hash(read_chunks) -> str:
    """BLAKE2b-128 of the bytes ``read_chunks`` yields, in hex."""
    h = hashlib.blake2b(digest_size=16)
    for chunk in read_chunks:
        h.update(chunk)
    return h.hexdigest()


def verify(directory: str | os.PathLike, *, every_hash: bool = False) -> Marker:
    """The marker of a complete checkpoint (a path or URI); :class:`CheckpointError` saying
    what is wrong. Files are checked by size, and by hash up to :data:`HASHED_ON_RESUME` (all of
    them with ``every_hash``). Checkpoints from before hashes were recorded have sizes only."""
    d = str(directory)
    try:
        marker = Marker.from_json(storage.read_text(storage.join(d, CHECKPOINT_MARKER)))
    except FileNotFoundError:
        raise CheckpointError(f"{d}: no {CHECKPOINT_MARKER} (save did not finish)") from None
    except Malformed as e:
        # Skipped as a broken checkpoint, not an error that stops every restart.
        raise CheckpointError(f"{d}: {e}") from None
    for name, size in marker.files.items():
        found = storage.size(storage.join(d, name))
        if found is None:
            raise CheckpointError(f"{d}: {name} is missing")
        if found != size:
            raise CheckpointError(f"{d}: {name} has {found} bytes, expected {size} (truncated)")
    for name, digest in marker.hashes.items():
        if name not in marker.files:
            raise CheckpointError(f"{d}: {CHECKPOINT_MARKER} hashes {name}, which it does not "
                                  f"list")
        # What a step reads whole (kept rollouts, the ledger) is checked whole whatever its
        # size: only the model's and optimizer's shards, read as tensors, go by size.
        if (every_hash or marker.files[name] <= HASHED_ON_RESUME
                or name in (CHECKPOINT_ROLLOUTS, CHECKPOINT_SAMPLES)):
            if file_hash(storage.read_chunks(storage.join(d, name))) != digest:
                raise CheckpointError(f"{d}: {name} does not match its hash (changed or "
                                      f"corrupted since it was written)")
    return marker


def check_compatible(marker: Marker, config, where: str,
                     adapters: dict[str, Any] | None = None) -> None:
    want, have = model_shape(config), marker.model
    diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a} vs model {b}" for k, (a, b) in diff.items())
        raise CheckpointError(
            f"The checkpoint {where} is for a different model ({detail}). Use the model.preset "
            f"or model.path it was trained with, or start a new run (a new run.name).")
    if marker.adapters != (adapters or {}):
        raise CheckpointError(
            f"The checkpoint {where} holds LoRA adapters {marker.adapters or 'none'} "
            f"but the run asks for {adapters or 'none'} (lora.*): resume with the settings it "
            f"was trained with, or start a new run (a new run.name).")


# What a checkpoint's identity names, and how a user says so when it changed on purpose.
IDENTITY = {"data": "the prepared data (corpus and preparation settings)",
            "format": "data.format", "tokenizer": "the tokenizer", "base_model": "model.path"}


def _comparable(recorded: str, now: str | None) -> bool:
    """Whether two identity values are of one format: a base model identified by a release
    of raylm that identified it otherwise (by its files' sizes before the ``v2:`` prefix, by
    spans of each file before ``v3:``) cannot be compared with today's, and is not."""
    if now is None or now.startswith("preset:") or recorded.startswith("preset:"):
        return True
    return recorded.rpartition(":")[0] == now.rpartition(":")[0]


def check_same_run(marker: Marker, identity: dict[str, str], where: str, *,
                   accept: list[str]) -> list[str]:
    """What changed since the checkpoint ``where`` was written, among the run's data,
    tokenizer and base model, when ``accept`` (``checkpoint.accept_changes``) allows all of
    it; :class:`CheckpointError` naming the rest otherwise. Checkpoints written before raylm
    recorded an identity have none to compare."""
    recorded = marker.identity
    changed = [k for k in IDENTITY if k in recorded and recorded[k] != identity.get(k)
               and _comparable(recorded[k], identity.get(k))]
    owner = {"format": "data"}
    refused = [k for k in changed if owner.get(k, k) not in accept]
    if refused:
        raise CheckpointError(
            f"The checkpoint {where} was trained with other "
            f"{', '.join(IDENTITY[k] for k in refused)} than this run has: a resume continues "
            f"the same run. Start a new run (a new run.name) with model.path set to an export "
            f"of this one, or, to continue training on purpose, set checkpoint.accept_changes="
            f"[{', '.join(sorted({owner.get(k, k) for k in refused}))}].")
    return changed


def load_samples(directory: str | os.PathLike) -> np.ndarray | None:
    """The sample ledger of a checkpoint: the stored rows of every step, ``(steps, global
    batch)``; None if the run did not keep one."""
    path = storage.join(str(directory), CHECKPOINT_SAMPLES)
    return np.load(io.BytesIO(storage.read_bytes(path))) if storage.is_file(path) else None


_RAY_CKPT = re.compile(r"checkpoint_[\w.-]+", re.ASCII)


def account_samples(rows: np.ndarray, *, group_sizes: list[int], seed: int, window: int,
                    skips: list[list[int]] = ()) -> dict[str, Any]:
    """A ledger ``(steps, global batch)`` against the seed's order for as many samples, less
    the position ranges ``skips`` left out of it (:class:`raylm.data.packing.Skips`).

    ``duplicated``: samples trained more often than the order asks; ``skipped``: less often
    (among them ``withheld``: those of steps the numerical check kept from the weights);
    ``in_order``: the exact sequence, sample by sample; ``left_out``: positions the run left
    out of the order, up to where it trained.
    """
    order = SampleOrder(group_sizes, seed=seed, window=window, global_batch=rows.shape[1])
    flat = rows.reshape(-1).astype(np.int64)
    applied = flat >= 0
    trained = np.where(applied, flat, -1 - flat)
    positions = Skips(skips).positions(np.arange(len(flat)))
    expected = order.rows(positions)
    want = np.bincount(expected, minlength=order.num_rows)
    have = np.bincount(trained[applied], minlength=order.num_rows)
    return {
        "steps": int(rows.shape[0]),
        "trained": int(applied.sum()),
        "duplicated": int(np.maximum(have - want, 0).sum()),
        "skipped": int(np.maximum(want - have, 0).sum()),
        "withheld": int((~applied).sum()),
        "in_order": bool(np.array_equal(trained, expected)),
        "left_out": int(positions[-1] + 1 - len(flat)) if len(flat) else 0,
    }


def candidates(run_dir: str | os.PathLike) -> list[str]:
    """Checkpoint directories under ``run_dir`` (Ray Train names them checkpoint_*), newest
    step first (by marker; unreadable ones last)."""
    root = str(run_dir)

    def step_of(p: str) -> int:
        try:
            return Marker.from_json(storage.read_text(storage.join(p, CHECKPOINT_MARKER))).step
        except (OSError, Malformed):
            return -1

    dirs = [storage.join(root, n) for n in storage.list_dirs(root) if _RAY_CKPT.match(n)]
    return sorted(dirs, key=lambda p: (step_of(p), p), reverse=True)


def latest_verified(run_dir: str | os.PathLike, *, warn=log.warning,
                    exclude: Collection[str] = ()) -> tuple[str, Marker] | None:
    """The newest complete checkpoint of a run, skipping (and warning about) broken ones, and
    those named in ``exclude`` (checkpoint directory names)."""
    for path in candidates(run_dir):
        if storage.name(path) in exclude:
            continue
        try:
            return path, verify(path)
        except CheckpointError as e:
            warn(f"skipping incomplete checkpoint: {e}")
    return None


def check_ray_state(run_dir: str) -> None:
    """Ray Train reads back its record of the checkpoints it keeps and deletes the oldest it
    names beyond checkpoint.keep, wherever a name points (pyarrow deletes ``RUN/../x``): read
    by the driver before Ray Train starts (while it runs, Ray rewrites the file)."""
    path, names = storage.join(run_dir, RAY_TRAIN_STATE), []
    try:  # every value of a key naming checkpoint folders, at any depth
        json.loads(storage.read_text(path) if storage.is_file(path) else "{}",
                   object_pairs_hook=lambda kv: names.extend(
                       v for k, v in kv if "checkpoint_dir_name" in k) or dict(kv))
    except ValueError:
        names.append("(not JSON)")
    bad = [n for v in names for n in (v if isinstance(v, list) else [v])
           if not (isinstance(n, str) and _RAY_CKPT.fullmatch(n))]
    if bad:
        raise CheckpointError(
            f"{storage.redact(path)}, Ray Train's record of this run's checkpoints, names "
            f"{bad[0]!r}, which is not a checkpoint folder's name: Ray Train would delete it "
            f"once newer checkpoints pass checkpoint.keep. Remove that file if you did not put "
            f"it there (raylm finds its checkpoints by their markers, not through it).")


def latest_usable(run_dir: str | os.PathLike, *, bad: Collection[str], warn=log.warning
                  ) -> tuple[str, Marker] | None:
    """:func:`latest_verified` without the checkpoints a rewind marked ``bad``
    (``skipped_samples.json``); :class:`CheckpointError` when the run has verified checkpoints
    and every one is marked bad: starting from step 0 would silently drop the run's progress
    (and its new checkpoints would replace the kept ones)."""
    found = latest_verified(run_dir, warn=warn, exclude=bad)
    if found is None and bad and latest_verified(run_dir, warn=lambda _: None) is not None:
        raise CheckpointError(
            f"every verified checkpoint of {storage.redact(str(run_dir))} is marked bad in its "
            f"skipped_samples.json ({', '.join(bad)}): the run would start again from step 0. "
            f"If the loss that marked them was the device's or a setting's, fix that and "
            f"remove the names from bad_checkpoints there, or start a new run (run.name).")
    return found


def tune_experiment(run_dir: str) -> str | None:
    """The Ray Tune experiment a sweep in ``run_dir`` resumes, if it has one: ``tune/``, or
    the run directory itself for a sweep laid out before Tune had a folder of its own."""
    for path in (storage.join(run_dir, TUNE_EXPERIMENT), run_dir):
        if storage.is_file(storage.join(path, "tuner.pkl")):
            return path
    return None


def empty_manifest() -> dict[str, Any]:
    return {"ranges": [], "faults": [], "bad_checkpoints": []}


def read_manifest(run_dir: str) -> dict[str, Any]:
    """The run's ``skipped_samples.json``: the position ranges its rewinds left out, each
    fault that made one, and the checkpoints marked bad; :class:`ValueError` for one that
    raylm's rewinds could not have written (:func:`check_manifest`)."""
    path = storage.join(run_dir, SKIPPED)
    if not storage.is_file(path):
        return empty_manifest()
    try:
        manifest = json.loads(storage.read_text(path))
    except ValueError:
        raise ValueError(f"{storage.redact(path)} is not JSON") from None
    check_manifest(manifest, where=storage.redact(path))
    return manifest


def check_manifest(manifest: Any, *, where: str) -> None:
    """Refuse a skip manifest that does not hold together: the ranges it leaves out must be
    exactly what its fault records left out, each within the positions of its fault's step,
    and each checkpoint marked bad must be named by the fault that marked it. (The file is
    the run's own; this catches a damaged or hand-edited one, whose ranges would silently
    move what every later step trains.)"""
    def bad(why: str) -> ValueError:
        return ValueError(f"{where}: {why}; it is not as raylm's rewinds write it. Restore it, "
                          f"or start a new run (run.name)")

    if not isinstance(manifest, dict) or not all(
            isinstance(manifest.get(k), list) for k in ("ranges", "faults", "bad_checkpoints")):
        raise bad("it lacks the lists ranges, faults and bad_checkpoints")
    try:
        left_out: list[list[int]] = []
        for f in manifest["faults"]:
            mine = Skips(f["left_out"]).ranges
            within = Skips(f.get("positions", []))
            if any(within.overlap(a, b) != b - a for a, b in mine):
                raise bad(f"the fault at step {f['step']} leaves out positions its step did "
                          f"not train")
            left_out += mine
        if Skips(left_out).ranges != Skips(manifest["ranges"]).ranges:
            raise bad("its ranges are not those its faults left out")
    except (TypeError, KeyError, ValueError) as e:
        if isinstance(e, ValueError) and str(e).startswith(where):
            raise
        raise bad(f"a record is malformed ({type(e).__name__}: {e})") from None
    marked = {f.get("bad_checkpoint") for f in manifest["faults"]}
    unmarked = [c for c in manifest["bad_checkpoints"] if c not in marked]
    if unmarked:
        raise bad(f"it marks {', '.join(map(str, unmarked))} bad with no fault that did")


def describe_manifest(manifest: dict[str, Any]) -> str | None:
    """One line on what a run's skip manifest leaves out; None when it leaves out nothing."""
    skips = Skips(manifest["ranges"])
    if not skips and not manifest["bad_checkpoints"]:
        return None
    rewinds = sum(1 for f in manifest["faults"] if f["left_out"])
    bad = manifest["bad_checkpoints"]
    return (f"skipped_samples.json leaves out {skips.total:,} sample positions "
            f"({len(skips.ranges)} ranges, from {rewinds} rewinds)"
            + (f"; checkpoints marked bad: {', '.join(bad)}" if bad else ""))


def write_manifest(run_dir: str, manifest: dict[str, Any]) -> None:
    storage.write_text(storage.join(run_dir, SKIPPED), json.dumps(manifest, indent=1))
