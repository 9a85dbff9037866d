"""The reference pass of a DPO or IPO full fine-tune: before training, a Ray Data
batch-inference pass scores every prepared pair with the starting weights
(:class:`raylm.workers.scorer.ReferenceScorer` as its actors) and stores each trained
target's log-probability beside the blocks; the workers then hold one model, the policy.

Stored under ``run.cache_dir/reference/<key>``, where the key digests what the figures depend
on: the prepared data, the tokenizer, the base model (its config and weight files' content,
see :func:`raylm.run.launch.base_model_identity`), the precision, the attention kernel, the
device kind and the stored format. What the key digests is stored beside the figures and
compared when they are read, with the list of their files, so a planted or partial directory
is scored again rather than used. A resumed run, a resized one, a second run on the same data
and model and every trial of a sweep read the same copy; the pass runs again only
when one of those changes. The directory is built under a temporary name and renamed into
place (:mod:`raylm.outputs`): of two drivers computing it at once, the first to finish
publishes and the other's copy is dropped.

The pass places the training workers' own resources (one GPU each on a GPU cluster): it runs
before they start, on what they will use, with as many actors as the run's fewest workers
(at most one per row group of blocks, the unit each actor scores and writes).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import ray

from raylm.config import Config, cache_dir
from raylm.contracts import LAYOUT, REFERENCE_INFO, SPLITS
from raylm.outputs import building, publish
from raylm.run.objectives import objective_of
from raylm.workers.scorer import ReferenceScorer

# The layout of a stored reference (its files and REFERENCE_INFO); a change of it makes new keys.
REFERENCE_FORMAT = 2


def reference_inputs(cfg: Config, identity: dict[str, str]) -> dict[str, Any]:
    """What the stored figures depend on (``identity``: the run's data, tokenizer and base
    model, :func:`raylm.run.launch.run_identity`): with them the precision, the attention
    kernel, the device kind (``cfg`` has it decided, :func:`raylm.run.resources.choose_device`:
    the figures differ between CPU and GPU) and the stored format. (A base is always a
    ``model.path``: a loss with a reference is refused on a preset.)"""
    assert cfg.scaling.use_gpu != "auto", "choose_device decides it first"
    return {"identity": identity, "precision": cfg.train.precision,
            "attention": cfg.model.attention, "gpu": cfg.scaling.use_gpu,
            "format": REFERENCE_FORMAT}


def reference_key(cfg: Config, identity: dict[str, str]) -> str:
    """:func:`reference_inputs`, digested: the stored reference's directory name."""
    what = reference_inputs(cfg, identity)
    return hashlib.blake2b(json.dumps(what, sort_keys=True).encode(), digest_size=12).hexdigest()


def _usable(out: Path, what: dict[str, Any]) -> str | None:
    """Why the stored reference ``out`` cannot be used for ``what`` (its inputs); None if it
    can: it was computed from the same inputs, and every file it lists is there."""
    try:
        info = json.loads((out / REFERENCE_INFO).read_text())
    except FileNotFoundError:
        return "it has no " + REFERENCE_INFO
    except (OSError, ValueError):
        return f"its {REFERENCE_INFO} is unreadable"
    if not isinstance(info, dict) or info.get("inputs") != what:
        return "it was computed from other inputs"
    missing = [f for f in info.get("files", []) if not (out / f).is_file()]
    if missing or not info.get("files"):
        return f"{len(missing)} of its files are missing"
    return None


def stored_reference(cfg: Config, prepared: str | Path, *, identity: dict[str, str],
                     resources: dict[str, float], vocab_size: int, eos_id: int,
                     log=print) -> str | None:
    """The run's reference directory, computed first if no earlier run left it; None when
    the run needs none (the objective's ``needs_stored_reference``). ``resources``: one training
    worker's, given to each actor of the pass. Needs ``ray.init``."""
    if not objective_of(cfg).needs_stored_reference(cfg):
        return None
    what = reference_inputs(cfg, identity)
    out = cache_dir(cfg) / "reference" / reference_key(cfg, identity)
    unusable = _usable(out, what) if out.exists() else None
    if out.exists() and unusable is None:
        log(f"raylm: reference log-probabilities of {cfg.model.path} from {out}")
        return str(out)
    if unusable is not None:
        log(f"raylm: warning: the stored reference {out} is not used ({unusable}); scoring "
            f"the pairs again")
    layout = json.loads((Path(prepared) / LAYOUT).read_text())
    groups = [{"split": split, "file": name, "group": g} for split in SPLITS
              for name, n in zip(layout["splits"][split]["files"],
                                 layout["splits"][split]["file_groups"], strict=True)
              for g in range(n)]
    actors = max(1, min(len(groups), cfg.scaling.worker_range[0]))
    log(f"raylm: scoring the prepared pairs with the starting weights of {cfg.model.path} "
        f"(the DPO reference, once; {len(groups)} row groups, {actors} actor"
        f"{'s' if actors > 1 else ''})")
    t0 = time.perf_counter()
    with building(out) as tmp:
        ds = ray.data.from_items(groups)
        ds.context.enable_progress_bars = False
        done = ds.map_batches(
            ReferenceScorer,
            fn_constructor_kwargs=dict(config=cfg.to_dict(), prepared=str(prepared),
                                       out=str(tmp), vocab_size=vocab_size, eos_id=eos_id,
                                       block_length=layout["block_length"]),
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=actors),
            num_cpus=resources.get("CPU", 0.0),
            num_gpus=resources.get("GPU", 0.0),
            resources={k: v for k, v in resources.items() if k not in ("CPU", "GPU")} or None,
        ).take_all()
        info: dict[str, Any] = {
            "model": cfg.model.path, "inputs": what,
            "files": sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file()),
            "blocks": sum(int(r["blocks"]) for r in done),
            "targets": sum(int(r["targets"]) for r in done),
            "seconds": round(time.perf_counter() - t0, 1)}
        if len(done) != len(groups):
            raise RuntimeError(f"the reference pass scored {len(done)} of {len(groups)} row "
                               f"groups")
        (tmp / REFERENCE_INFO).write_text(json.dumps(info, indent=2))
    # Another driver's copy published meanwhile is kept if it is usable, replaced if not.
    publish(tmp, out, same=out.exists() and _usable(out, what) is None)
    log(f"raylm: reference log-probabilities of {info['targets']:,} answer tokens in "
        f"{info['blocks']:,} blocks, {info['seconds']:g} s, in {out}")
    return str(out)
