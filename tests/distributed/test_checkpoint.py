"""Sharded checkpoints: saved by 2 gloo ranks, resumed on 1 (resharded) and on 2, from a
directory and from object storage (a file:// URI, read through pyarrow as S3 or GCS would be),
verified first. The checkpoints are saved asynchronously, as training saves them: the ranks
train on while the write is in flight, and the checkpoint still holds its step."""

from __future__ import annotations

import json
import os

import pytest
import torch

from raylm import rundir
from raylm.contracts import CHECKPOINT_MARKER
from tests.distributed.shared import VOCAB, data, exit_now
from tests.ranks import free_port, run_ranks

STEPS = 4


def session(world: int, rank: int, ckpt: str, *, resume: bool, preset: str = "tiny",
            fetched: dict | None = None) -> list:
    import torch.distributed as dist

    from raylm.model.assemble import build_training_model
    from raylm.workers import checkpoint
    from raylm.workers.optim import build_optimizer
    from raylm.workers.step import train_step

    built = build_training_model(preset=preset, path=None, vocab_size=VOCAB, eos_id=0,
                                 device=torch.device("cpu"), precision="fp32", seed=0)
    opt = build_optimizer(built.model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95),
                          device_type="cpu")
    per = 4 // world
    start = 0
    if resume:
        start = checkpoint.load(ckpt, model=built.model, optimizer=opt,
                                config=built.config, fetched=fetched)["step"]
    losses = []
    pending = group = None
    # Two saves, as a run makes them: the second stages into the buffers the first made. Ranks
    # write from DCP's daemon process (the writer of a GPU worker), one process alone from a
    # thread (the writer of a CPU worker; the daemon needs a process group to join).
    writer = "process" if dist.is_initialized() else "thread"
    stager = checkpoint.stager(writer=writer, device=torch.device("cpu"))
    for step in range(start, STEPS):
        batch = {k: v[rank * per:(rank + 1) * per] for k, v in data(step % 2).items()}
        losses.append(float(train_step(built, opt, [batch], accumulation=1, grad_clip=1.0)[0]))
        if step + 1 in (2, 3) and not resume:
            if pending is not None:
                pending.finish()
            if group is None and dist.is_initialized():
                group = dist.new_group(backend="gloo")
            pending = checkpoint.AsyncSave(
                ckpt if step + 1 == 2 else f"{ckpt}_step3", model=built.model, optimizer=opt,
                config=built.config, samples=None, adapters=None, group=group, stager=stager,
                writer=writer,
                state={"step": step + 1, "tokens_seen": (step + 1) * 4 * 32,
                       "data_position": (step + 1) * 4})
    if pending is not None:
        with pytest.raises(rundir.CheckpointError, match="save did not finish"):
            rundir.verify(pending.path)  # not a checkpoint until every rank's write is done
        pending.finish()
    stager.close()
    return losses


def worker(rank: int, world: int, port: int, ckpt: str, out: str, resume: bool = False) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fetched: dict = {}
        losses = session(world, rank, ckpt, resume=resume, fetched=fetched)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(losses, f)
        with open(f"{out}.fetched.{rank}", "w") as f:
            json.dump(fetched, f)
        # Leave together: the store lives in rank 0 and must outlive every rank's last call.
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_now()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    ckpt, out = str(root / "checkpoint_000"), str(root / "losses.json")
    run_ranks(worker, args=(2, free_port(), ckpt, out), world=2)
    with open(out) as f:
        return ckpt, json.load(f)


def test_two_rank_checkpoint_resumes_on_one_rank_exactly(saved):

    ckpt, uninterrupted = saved
    marker = rundir.verify(ckpt)
    assert marker.world_size == 2 and marker.step == 2
    assert any(name.startswith("__1_") for name in marker.files)  # rank 1's shard is listed
    torch.set_num_threads(1)
    resumed = session(1, 0, ckpt, resume=True)
    assert resumed == pytest.approx(uninterrupted[2:], abs=1e-5)


def test_a_second_save_into_the_same_buffers_holds_its_own_step(saved):
    """The step-3 checkpoint, staged into the buffers the step-2 one was staged into, resumes
    at step 3 exactly."""

    ckpt, uninterrupted = saved
    assert rundir.verify(f"{ckpt}_step3").step == 3
    torch.set_num_threads(1)
    resumed = session(1, 0, f"{ckpt}_step3", resume=True)
    assert resumed == pytest.approx(uninterrupted[3:], abs=1e-5)


def resume_on_two_ranks(ckpt: str, out: str) -> tuple[list, list[int]]:
    """Rank 0's losses and each rank's fetched bytes, resuming ``ckpt`` on 2 ranks."""
    run_ranks(worker, args=(2, free_port(), ckpt, out, True), world=2)
    with open(out) as f:
        losses = json.load(f)
    fetched = []
    for rank in range(2):
        with open(f"{out}.fetched.{rank}") as f:
            fetched.append(json.load(f).get("bytes"))
    return losses, fetched


def size_of(ckpt) -> int:

    return sum(rundir.verify(ckpt).files.values())


def test_one_rank_checkpoint_resumes_on_two_ranks_from_object_storage_exactly(tmp_path):
    """Saved by one rank, resumed by two from a URI: each rank reads the chunks its shards
    overlap, here the whole of each stored tensor (one rank stored each whole)."""
    torch.set_num_threads(1)
    ckpt, out = tmp_path / "run" / "checkpoint_1", str(tmp_path / "losses.json")
    uninterrupted = session(1, 0, str(ckpt), resume=False)  # saves plain tensors at step 2
    resumed, fetched = resume_on_two_ranks(f"file://{ckpt}", out)
    assert resumed == pytest.approx(uninterrupted[2:], abs=1e-5)
    whole = size_of(ckpt)
    assert all(0.8 * whole < f <= whole for f in fetched), (fetched, whole)


def test_two_ranks_resuming_from_object_storage_fetch_their_own_shards(saved, tmp_path):
    """The 2-rank checkpoint resumed by 2 ranks from a URI: each rank fetches its own shards
    and the metadata, about half the checkpoint, and the run goes on exactly."""
    import shutil

    ckpt, uninterrupted = saved
    shutil.copytree(ckpt, tmp_path / "run" / "checkpoint_000")
    resumed, fetched = resume_on_two_ranks(f"file://{tmp_path}/run/checkpoint_000",
                                           str(tmp_path / "losses.json"))
    assert resumed == pytest.approx(uninterrupted[2:], abs=1e-5)
    whole = size_of(ckpt)
    assert all(0.3 * whole < f <= (0.5 + 0.05) * whole for f in fetched), (fetched, whole)


def test_truncated_checkpoint_is_refused_and_skipped(saved, tmp_path):
    import shutil


    ckpt, _ = saved
    good = tmp_path / "checkpoint_a"
    bad = tmp_path / "checkpoint_b"
    shutil.copytree(ckpt, good)
    shutil.copytree(ckpt, bad)
    marker = json.loads((bad / CHECKPOINT_MARKER).read_text())
    marker["state"]["step"] = 3  # the newer one
    (bad / CHECKPOINT_MARKER).write_text(json.dumps(marker))
    shard = next(p for p in bad.iterdir() if p.name.startswith("__1_"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(rundir.CheckpointError, match="truncated"):
        rundir.verify(bad)
    warnings = []
    path, found = rundir.latest_verified(tmp_path, warn=warnings.append)
    assert path == str(good) and found.step == 2
    assert len(warnings) == 1 and "checkpoint_b" in warnings[0]


def test_changed_model_shape_refuses_to_load(saved):
    from raylm.model.build import build_config

    ckpt, _ = saved

    other = build_config(preset="125m", path=None, vocab_size=VOCAB, eos_id=0,
                         attn_implementation="sdpa")
    with pytest.raises(rundir.CheckpointError, match="for a different model .*hidden_size: "
                       "checkpoint 64 vs model 768"):
        rundir.check_compatible(rundir.verify(ckpt), other, ckpt)


def test_checkpoint_in_object_storage_is_found_verified_and_resumed(saved, tmp_path):
    """The same checkpoint under a URI (file://, which takes raylm's object-storage path:
    listing, verifying and fetching through pyarrow's filesystems) resumes exactly."""
    import shutil


    ckpt, uninterrupted = saved
    shutil.copytree(ckpt, tmp_path / "run" / "checkpoint_000")
    run_uri = f"file://{tmp_path}/run"
    path, marker = rundir.latest_verified(run_uri)
    assert path == f"{run_uri}/checkpoint_000" and marker.step == 2
    torch.set_num_threads(1)
    fetched: dict = {}
    resumed = session(1, 0, path, resume=True, fetched=fetched)
    assert resumed == pytest.approx(uninterrupted[2:], abs=1e-5)
    # One rank loads everything: it reads every stored chunk once, nothing twice.
    whole = size_of(ckpt)
    assert 0.8 * whole < fetched["bytes"] <= whole


def torn_down(rank: int, world: int, port: int, ckpt: str, out: str) -> None:
    """Both ranks save in the background; the process group is destroyed before the save's
    finish (Ray Train tears a group down when a node is lost, while its upload thread still
    finishes the checkpoint in flight)."""
    import torch.distributed as dist

    from raylm.model.assemble import build_training_model
    from raylm.workers import checkpoint
    from raylm.workers.optim import build_optimizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    built = build_training_model(preset="tiny", path=None, vocab_size=VOCAB, eos_id=0,
                                 device=torch.device("cpu"), precision="fp32", seed=0)
    opt = build_optimizer(built.model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95),
                          device_type="cpu")
    pending = checkpoint.AsyncSave(
        ckpt, model=built.model, optimizer=opt, config=built.config, samples=None,
        adapters=None, group=dist.new_group(backend="gloo"), writer="thread",
        state={"step": 1, "tokens_seen": 128, "data_position": 4})
    pending._write.result()  # every shard and DCP's metadata are written
    dist.barrier()
    dist.destroy_process_group()
    try:
        pending.finish()
        said = "finished"
    except rundir.CheckpointError as e:
        said = str(e)
    with open(f"{out}.{rank}", "w") as f:
        f.write(said)
    exit_now()


def test_a_save_whose_group_is_torn_down_before_it_finishes_gets_no_marker(tmp_path):
    """A checkpoint in flight when its group ends (a node lost) is left unmarked, so resuming
    passes it over; a marker listing rank 0's files alone once passed for a whole 1-rank
    checkpoint, and every restart of the run failed in DCP's load on rank 1's missing
    shard."""
    ckpt, out = tmp_path / "checkpoint_000", str(tmp_path / "said")
    run_ranks(torn_down, args=(2, free_port(), str(ckpt), out), world=2)
    for rank in range(2):
        said = open(f"{out}.{rank}").read()
        assert "process group of its 2 ranks ended" in said and "no marker" in said, said
    assert not (ckpt / CHECKPOINT_MARKER).exists()
    assert any(p.name.startswith("__1_") for p in ckpt.iterdir())  # the shards were written
    assert rundir.latest_verified(tmp_path, warn=lambda _: None) is None
