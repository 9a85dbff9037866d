"""What grows with the corpus and the cluster: the preparation driver's share of the work, how
much of the training data each rank reads, how much of a checkpoint in object storage each
resuming rank fetches, and the training time a checkpoint costs.

``prepare``: the builtin corpus (every docstring, duplicates included) written as JSONL shards,
prepared at 1x and at 8x (eight variants of every shard whose documents differ by a prefix, so
deduplication keeps them all) on a Ray cluster started beforehand with ``ray start --head``,
each by a driver of its own (a subprocess that joins the cluster), so the driver's peak RSS and
CPU time are its own and not those of Ray's processes. The tokenizer is trained once beforehand
and given, so the driver's work is the preparation's: planning the pieces, collecting their
counts, writing the layout and manifest. Goals: the driver's RSS and CPU time at 8x within 1.2x
and 1.5x of 1x. A 1x preparation runs first untimed (it starts Ray's worker processes).

``reads``: the 1x corpus prepared with the default row groups (256 blocks) at seq_len 256 (so
it spans several shuffle windows of 16 row groups), then each rank of 1, 2 and 4 reads one
epoch of its training samples through the training reader (in this process: what a rank reads
does not depend on where its reader runs) with the default global batch of 16.
``read_over_share`` is the worst rank's bytes read (counted at the file, footers included) over
the bytes of its own samples (each sample costs its row group's bytes over the group's rows);
goal <= 1.5. ``epoch_reads_over_split``: all ranks' bytes over the split's, where reading the
whole shuffle window on every rank, as raylm did before, gives the worker count.

``checkpoint_fetch``: for each rank count N, N gloo processes build the model through raylm's
step core (FSDP2 over N ranks), take one AdamW step (so the optimizer state exists) and save a
checkpoint with :func:`raylm.workers.checkpoint.save`; N fresh processes then resume it from a
``file://`` URI, which takes the object-storage path (pyarrow's filesystems, as ``s3://`` and
``gs://`` do), and each counts the bytes it fetched. ``fetched_over_size`` is the worst rank's
bytes over the checkpoint's size; the goal is ``1/N + 0.05`` (its own shards plus the
metadata). The baseline, measured in the same run, is a download of the checkpoint directory
(:func:`raylm.storage.download`), which is what every rank fetched before ranged reads.

``async_checkpoint``: a gloo rank trains a preset with AdamW on every core but one (the core a
GPU's host leaves free; where training takes every core, as 2 CPU ranks do on 2 cores, the
background write competes with the step for the CPU and hides nothing: measured 0.93) and
checkpoints twice in its steady state, either synchronously (:func:`raylm.workers.checkpoint.save`,
then a copy to a ``file://`` URI, as Ray Train's upload does) or as training checkpoints by
default (:class:`raylm.workers.checkpoint.AsyncSave`: staged into buffers kept from one save to the
next, written by DCP from a thread or from its daemon process; a second thread then writes
the marker and copies, as Ray Train's upload thread does in a worker). Each writer is measured
in processes of its own, beside the synchronous save. The stall is the training time lost to
a checkpoint: the wall time of the checkpointing step and the steps after it (until the
background write is done, and any wait for it at the end) minus the same number of steps at
the median time of the steps measured before, between and after. The first checkpoint pays
once for what later ones reuse (the staging buffers, the writer process): it is reported as
``first_stall_s``, and the second is the one compared. ``ratio`` = async / sync, for the
writer ``checkpoint.writer: auto`` picks on this device; the goal is <= 0.25.

``checkpoint_fetch`` and ``async_checkpoint`` need torch, transformers and pyarrow only (no
Ray). Where CUDA is present, ``async_checkpoint`` trains on one GPU per rank in bf16-mixed
(``--preset 1b`` is the largest preset that fits one H100 with AdamW), so the asynchronous save
stages the state from device to host memory and the step runs on the GPU meanwhile.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp

from raylm.bench.layouts import VOCAB, _free_port
from raylm.contracts import LAYOUT

if TYPE_CHECKING:
    from raylm.data.streams import PackedSplit


def _rank(rank: int, world: int, port: int, spec: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    from raylm.model.assemble import build_training_model
    from raylm.workers import checkpoint
    from raylm.workers.optim import build_optimizer
    from raylm.workers.step import train_step

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


def _spawn(world: int, spec: dict[str, Any], out: Path, fn=None) -> list[dict[str, Any]]:
    mp.spawn(fn or _rank, args=(world, _free_port(), spec, str(out)), nprocs=world, join=True)
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def checkpoint_fetch(*, preset: str, ranks: list[int], root: Path) -> dict[str, Any]:
    from raylm import rundir, storage

    results = {}
    for n in ranks:
        where = root / f"ranks-{n}" / "checkpoint_000"
        spec = {"preset": preset, "checkpoint": str(where), "resume": False}
        _spawn(n, spec, root / f"save-{n}")
        size = sum(rundir.verify(where).files.values())
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


def _stall_rank(rank: int, world: int, port: int, spec: dict[str, Any], out: str) -> None:
    import statistics
    import threading

    import torch.distributed as dist

    from raylm import storage
    from raylm.model.assemble import build_training_model
    from raylm.workers import checkpoint
    from raylm.workers.optim import build_optimizer
    from raylm.workers.step import train_step

    # Training leaves a core to the writer, as a GPU leaves its host's CPUs (on a CPU-only
    # machine training on every core, the write competes with the step and stalls it anyway).
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world - 1))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # On GPUs: one per rank, bf16-mixed, NCCL for the tensors and gloo for the host's
    # collectives (the ranks' "still writing" vote, the checkpoints' own group).
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank,
                            world_size=world)
    group = dist.new_group(backend="gloo")
    built = build_training_model(preset=spec["preset"], path=None, vocab_size=VOCAB, eos_id=0,
                                 device=device, precision="bf16-mixed" if cuda else "fp32",
                                 seed=0)
    opt = build_optimizer(built.model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95),
                          device_type=device.type)
    gen = torch.Generator().manual_seed(rank)

    def step() -> float:
        batch = {"input_ids": torch.randint(1, VOCAB, (spec["micro_batch"], spec["seq_len"] + 1),
                                            generator=gen)}
        dist.barrier()
        t0 = time.perf_counter()
        loss, _ = train_step(built, opt, [batch], accumulation=1, grad_clip=1.0)
        float(loss)  # waits for the device
        dist.barrier()
        return time.perf_counter() - t0

    for _ in range(2):
        step()  # warm-up: the optimizer state exists from here
    stager = checkpoint.stager(writer=spec["writer"], device=device)

    def checkpoint_once(n: int) -> tuple[float, int]:
        """Checkpoint ``n`` as the mode does; the wall time until it is uploaded (training
        meanwhile when asynchronous) and the steps trained meanwhile."""
        local = Path(spec["root"]) / f"local-{spec['mode']}" / f"rank{rank}-{n}"
        uri = f"file://{spec['root']}/bucket-{spec['mode']}/checkpoint_{n:03d}"
        saving = dict(model=built.model, optimizer=opt, state={"step": n}, config=built.config,
                      samples=None, adapters=None)
        dist.barrier()
        t0 = time.perf_counter()
        steps = 0
        if spec["mode"] == "sync":
            checkpoint.save(local, **saving)
            storage.upload(local, uri)
        else:
            pending = checkpoint.AsyncSave(local, group=group, stager=stager,
                                           writer=spec["writer"], **saving)
            done = threading.Event()

            def finish_and_upload() -> None:
                pending.finish()
                storage.upload(local, uri)
                done.set()

            threading.Thread(target=finish_and_upload, daemon=True).start()
            while steps < spec["max_steps_after"]:
                busy = torch.tensor([0 if done.is_set() else 1])
                dist.all_reduce(busy, op=dist.ReduceOp.MAX)  # the ranks step together
                if not busy.item():
                    break
                step()
                steps += 1
            done.wait()
        dist.barrier()
        return time.perf_counter() - t0, steps

    # The step time without checkpoints: steps before, between and after (the machine's speed
    # drifts). The first checkpoint pays for what later ones reuse (the staging buffers, the
    # writer process); a run checkpoints many times, so the second is the one that counts.
    before = [step() for _ in range(spec["baseline_steps"])]
    first = checkpoint_once(1)
    between = [step() for _ in range(spec["baseline_steps"])]
    steady = checkpoint_once(2)
    after = [step() for _ in range(spec["baseline_steps"])]
    base = statistics.median(before + between + after)
    Path(f"{out}.{rank}").write_text(json.dumps({
        "median_step_s": base, "steps_s": before + between + after,
        "first": {"wall_s": first[0], "steps_during": first[1],
                  "stall_s": first[0] - first[1] * base},
        "steps_during": steady[1], "wall_s": steady[0], "stall_s": steady[0] - steady[1] * base}))
    stager.close()
    dist.barrier()
    dist.destroy_process_group()


def async_checkpoint(*, preset: str, root: Path, ranks: int = 1,
                     writers: tuple[str, ...] = ("thread", "process")) -> dict[str, Any]:
    """The stall of a synchronous checkpoint and of an asynchronous one from each writer, each
    in processes of its own; ``ratio`` is that of the writer ``checkpoint.writer: auto`` picks
    on this machine's device (the process on a GPU, the thread on a CPU)."""
    from raylm import rundir

    cuda = torch.cuda.is_available()
    # A GPU step is short next to writing the checkpoint: longer sequences, and room for the
    # many steps that run during the write.
    shape = ({"seq_len": 2048, "micro_batch": 4, "max_steps_after": 1000} if cuda else
             {"seq_len": 128, "micro_batch": 2, "max_steps_after": 50})
    results: dict[str, Any] = {}
    for mode in ("sync", *writers):
        spec = {"preset": preset, "mode": mode, "root": str(root), "baseline_steps": 4,
                "writer": "thread" if mode == "sync" else mode, **shape}
        per_rank = _spawn(ranks, spec, root / f"stall-{mode}", fn=_stall_rank)
        worst = max(per_rank, key=lambda r: r["stall_s"])
        where = str(root / f"bucket-{mode}" / "checkpoint_002")
        results[mode] = {
            "stall_s": round(worst["stall_s"], 3),
            "first_stall_s": round(max(r["first"]["stall_s"] for r in per_rank), 3),
            "checkpoint_bytes": sum(rundir.verify(where).files.values()),
            "detail": per_rank}
        shutil.rmtree(root / f"bucket-{mode}")
        shutil.rmtree(root / f"local-{mode}")
    sync = results["sync"]["stall_s"]
    for writer in writers:
        results[writer]["ratio"] = round(results[writer]["stall_s"] / sync, 3)
    auto = "process" if cuda else "thread"
    device = torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"
    ratio = results[auto]["ratio"] if auto in results else None
    return {"preset": preset, "ranks": ranks, "device": device, **shape,
            "checkpoint_bytes": results["sync"]["checkpoint_bytes"],
            "sync_stall_s": sync, "async_writer": auto,
            "async_stall_s": results[auto]["stall_s"] if auto in results else None,
            "ratio": ratio, "goal": 0.25, "met": ratio is not None and ratio <= 0.25,
            **results}


def write_builtin_shards(packages: list[str], root: Path, *, shards: int, variants: int
                         ) -> dict[str, Any]:
    """The builtin corpus's documents, duplicates included, as ``shards`` JSONL files per
    variant; variant k > 0 prefixes every document with ``k:``."""
    from raylm.data.corpus import builtin_files, read_records

    docs = [r.text for f in builtin_files(packages) for r in read_records(f) if r.text]
    root.mkdir(parents=True, exist_ok=True)
    for k in range(variants):
        prefix = f"{k}: " if k else ""
        for i in range(shards):
            with open(root / f"v{k}-{i:03d}.jsonl", "w") as out:
                for d in docs[i * len(docs) // shards:(i + 1) * len(docs) // shards]:
                    out.write(json.dumps({"text": prefix + d}) + "\n")
    return {"documents": len(docs) * variants,
            "bytes": sum(p.stat().st_size for p in root.iterdir())}


_DRIVER = """
import json, os, resource, sys, time
import ray
from raylm.config import load_config
from raylm.data.preparation import prepare
ray.init(address=sys.argv[1], log_to_driver=False)
cfg = load_config(None, sys.argv[3:])
cpu0, t0 = sum(os.times()[:2]), time.perf_counter()
m = prepare(cfg, sys.argv[2], log=lambda s: None)
print(json.dumps({"seconds": time.perf_counter() - t0,
                  "driver_cpu_s": sum(os.times()[:2]) - cpu0,
                  "driver_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "documents_read": m["documents_read"], "tokens": m["tokens"],
                  "pieces": m["pieces"]}))
"""


def prepare_scale(*, packages: list[str], root: Path) -> dict[str, Any]:
    from raylm.data.tokenizer import build_tokenizer

    corpora = {"1x": write_builtin_shards(packages, root / "1x", shards=8, variants=1),
               "8x": write_builtin_shards(packages, root / "8x", shards=8, variants=8)}
    from raylm.data.corpus import resolve_sources

    files = resolve_sources(str(root / "1x"), builtin_packages=[])
    tokenizer = build_tokenizer(files, corpus_fingerprint="bench-scale",
                                cache_dir=root / "cache", vocab_size=8192, min_frequency=2,
                                train_chars=20_000_000, text_field="text",
                                text_unit="paragraph", examples=None, log=lambda s: None)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    ray_cli = str(Path(sys.executable).parent / "ray")
    # `ray start` turns token authentication on; the drivers then need the token too.
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    if not Path("~/.ray/auth_token").expanduser().is_file():
        subprocess.run([ray_cli, "get-auth-token", "--generate"], check=True,
                       capture_output=True)
    head = subprocess.Popen([ray_cli, "start", "--head", f"--port={port}", "--block",
                             "--include-dashboard=false", "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while subprocess.run([ray_cli, "health-check", "--address", address], env=env,
                             capture_output=True).returncode != 0:
            if time.monotonic() > deadline or head.poll() is not None:
                raise RuntimeError(f"the Ray head on {address} did not start")
            time.sleep(1)

        def once(size: str) -> dict[str, Any]:
            out = root / f"out-{size}"
            shutil.rmtree(out, ignore_errors=True)
            proc = subprocess.run(
                [sys.executable, "-c", _DRIVER, address, str(out),
                 f"--data.source={root / size}", f"--tokenizer.path={tokenizer}",
                 f"--run.cache_dir={root / 'cache'}"],
                env=env, capture_output=True, text=True, check=False)
            if proc.returncode:
                raise RuntimeError(f"preparing {size} failed:\n{proc.stderr[-3000:]}")
            return json.loads(proc.stdout.strip().splitlines()[-1])

        once("1x")  # starts the cluster's worker processes
        runs = {size: once(size) for size in ("1x", "8x")}
    finally:
        head.terminate()
        head.wait(timeout=60)
        # `ray start` recorded this head as the machine's cluster; a later ray.init() with no
        # address would try to join it.
        from raylm.compat import reset_ray_address

        reset_ray_address()
    a, b = runs["1x"], runs["8x"]
    rss, cpu = b["driver_rss_mb"] / a["driver_rss_mb"], b["driver_cpu_s"] / a["driver_cpu_s"]
    return {
        "corpus": corpora,
        **{f"{k}_{size}": round(runs[size][k], 3) for size in runs
           for k in ("seconds", "driver_rss_mb", "driver_cpu_s")},
        **{f"{k}_{size}": runs[size][k] for size in runs
           for k in ("documents_read", "tokens", "pieces")},
        "rss_ratio": round(rss, 3), "cpu_ratio": round(cpu, 3),
        "goals": {"rss_ratio": 1.2, "cpu_ratio": 1.5},
        "met": rss <= 1.2 and cpu <= 1.5,
    }


def rank_reads(train: PackedSplit, *, rank: int, world: int, steps: int, seed: int = 0,
               window: int = 16, global_batch: int = 16) -> dict[str, int]:
    """What rank ``rank`` of ``world`` reads of ``train`` in ``steps`` steps from the start:
    the bytes read, the bytes of its own samples and of the whole split (how close a rank's
    reads come to its share: :func:`reads` reports it per worker count). Rank ``rank``'s own
    reader (raylm.data.streams' ``_ReadBlocks``) counts the bytes it reads."""
    import numpy as np
    import pyarrow.parquet as pq

    from raylm.data.streams import _ReadBlocks

    group_bytes = np.array([
        sum(md.row_group(g).column(c).total_compressed_size for c in range(md.num_columns))
        for name in train.files
        for md in [pq.ParquetFile(Path(train.directory) / name).metadata]
        for g in range(md.num_row_groups)], dtype=np.float64)
    reader = _ReadBlocks(train, mode="train", seed=seed, window=window, rank=rank,
                         world_size=world, global_batch=global_batch)
    samples = steps * global_batch // world
    own = 0.0
    for start in range(0, samples, 256):
        rows = reader({"id": np.arange(start, min(start + 256, samples))})["row"]
        g = np.searchsorted(reader.order.group_offsets, rows, side="right") - 1
        own += float((group_bytes[g] / reader.order.group_sizes[g]).sum())
    return {"bytes_read": reader.bytes_read, "own_bytes": round(own),
            "split_bytes": int(group_bytes.sum())}


def reads(*, packages: list[str], root: Path, workers: tuple[int, ...] = (1, 2, 4),
          seq_len: int = 256) -> dict[str, Any]:
    import ray

    from raylm.config import load_config
    from raylm.data.preparation import prepare
    from raylm.data.streams import PackedSplit

    corpus = write_builtin_shards(packages, root / "corpus", shards=8, variants=1)
    cfg = load_config(None, [f"--data.source={root / 'corpus'}", f"--data.seq_len={seq_len}",
                             f"--run.cache_dir={root / 'cache'}"])
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        manifest = prepare(cfg, root / "prepared", log=lambda s: None)
    finally:
        ray.shutdown()
    blocks = json.loads((root / "prepared" / LAYOUT).read_text())["splits"]["train"]
    d, t = cfg.data, cfg.train
    steps = blocks["blocks"] // t.global_batch_size  # one epoch
    out: dict[str, Any] = {
        "corpus": corpus, "seq_len": seq_len, "pieces": manifest["pieces"],
        "train_blocks": blocks["blocks"], "row_groups": len(blocks["row_group_sizes"]),
        "rows_per_row_group": d.rows_per_row_group, "shuffle_window": d.shuffle_window,
        "global_batch": t.global_batch_size, "steps": steps}
    train = PackedSplit.load(root / "prepared", "train")
    worst = 0.0
    for w in workers:
        per_rank = [rank_reads(train, rank=r, world=w, steps=steps,
                               window=d.shuffle_window, global_batch=t.global_batch_size)
                    for r in range(w)]
        ratio = max(x["bytes_read"] / x["own_bytes"] for x in per_rank)
        worst = max(worst, ratio)
        out[f"workers_{w}"] = {
            "read_over_share": round(ratio, 3),
            "epoch_reads_over_split": round(sum(x["bytes_read"] for x in per_rank)
                                            / per_rank[0]["split_bytes"], 3),
            "bytes_read": [x["bytes_read"] for x in per_rank],
            "own_bytes": [x["own_bytes"] for x in per_rank]}
    out.update(read_over_share=round(worst, 3), goal=1.5, met=worst <= 1.5)
    return out


def run(*, preset: str, ranks: list[int], parts: list[str], packages: list[str],
        workdir: str | None, writers: tuple[str, ...] = ("thread", "process")
        ) -> dict[str, Any]:
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="raylm-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"benchmark": "scale", "cpu": platform.processor() or "cpu",
                              "cpus": os.cpu_count(), "torch": torch.__version__}
    if "prepare" in parts:
        result["prepare"] = prepare_scale(packages=packages, root=root / "prepare")
    if "reads" in parts:
        result["reads"] = reads(packages=packages, root=root / "reads")
    if "async_checkpoint" in parts:
        result["async_checkpoint"] = async_checkpoint(preset=preset, root=root, writers=writers)
    if "checkpoint_fetch" in parts:
        result["checkpoint_fetch"] = {
            "preset": preset, "vocab_size": VOCAB,
            **checkpoint_fetch(preset=preset, ranks=ranks, root=root)}
    return result
