"""What grows with the cluster: how much of a checkpoint in object storage each resuming rank
fetches.

``checkpoint_fetch``: for each rank count N, N gloo processes build the model through raylm's
step core (FSDP2 over N ranks), take one AdamW step (so the optimizer state exists) and save a
checkpoint with :func:`raylm.checkpoint.save`; N fresh processes then resume it from a
``file://`` URI, which takes the object-storage path (pyarrow's filesystems, as ``s3://`` and
``gs://`` do), and each counts the bytes it fetched. ``fetched_over_size`` is the worst rank's
bytes over the checkpoint's size; the goal is ``1/N + 0.05`` (its own shards plus the
metadata). The baseline, measured in the same run, is a download of the checkpoint directory
(:func:`raylm.storage.download`), which is what every rank fetched before ranged reads.

Needs torch and transformers only (no Ray).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from raylm.bench.layouts import VOCAB, _free_port


def _rank(rank: int, world: int, port: int, spec: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    from raylm import checkpoint
    from raylm.optim import build_optimizer
    from raylm.step import build_training_model, train_step

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    built = build_training_model(preset=spec["preset"], path=None, vocab_size=VOCAB, eos_id=0,
                                 device=torch.device("cpu"), precision="fp32", seed=0)
    opt = build_optimizer(built.model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95),
                          device_type="cpu")
    fetched: dict[str, int] = {}
    if spec["resume"]:
        checkpoint.load(spec["checkpoint"], model=built.model, optimizer=opt,
                        config=built.config, fetched=fetched)
    else:
        batch = {"input_ids": torch.randint(1, VOCAB, (1, 33),
                                            generator=torch.Generator().manual_seed(rank))}
        train_step(built, opt, [batch], accumulation=1, grad_clip=1.0)
        checkpoint.save(spec["checkpoint"], model=built.model, optimizer=opt,
                        config=built.config, state={"step": 1})
    Path(f"{out}.{rank}").write_text(json.dumps(fetched))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(world: int, spec: dict[str, Any], out: Path) -> list[dict[str, int]]:
    mp.spawn(_rank, args=(world, _free_port(), spec, str(out)), nprocs=world, join=True)
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def checkpoint_fetch(*, preset: str, ranks: list[int], root: Path) -> dict[str, Any]:
    from raylm import checkpoint, storage

    results = {}
    for n in ranks:
        where = root / f"ranks-{n}" / "checkpoint_000"
        spec = {"preset": preset, "checkpoint": str(where), "resume": False}
        _spawn(n, spec, root / f"save-{n}")
        size = sum(checkpoint.verify(where)["files"].values())
        fetched = [r["bytes"] for r in _spawn(n, {**spec, "checkpoint": f"file://{where}",
                                                  "resume": True}, root / f"load-{n}")]
        # What each rank fetched before: the whole directory.
        local = root / f"download-{n}"
        downloaded = sum(p.stat().st_size for p in storage.download(f"file://{where}", local)
                         .rglob("*") if p.is_file())
        shutil.rmtree(local)
        worst = max(fetched) / size
        results[str(n)] = {
            "checkpoint_bytes": size, "fetched_bytes": fetched, "fetched_over_size": worst,
            "download_over_size": downloaded / size, "ratio": max(fetched) / downloaded,
            "goal": 1 / n + 0.05, "met": worst <= 1 / n + 0.05}
        shutil.rmtree(where.parent)
    return results


def run(*, preset: str, ranks: list[int], workdir: str | None) -> dict[str, Any]:
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="raylm-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    return {"benchmark": "scale", "preset": preset, "vocab_size": VOCAB,
            "cpu": platform.processor() or "cpu", "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "checkpoint_fetch": checkpoint_fetch(preset=preset, ranks=ranks, root=root)}
