"""Which writer an asynchronous checkpoint gets, and what it stages."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from raylm import rundir
from raylm.workers.checkpoint import choose_writer, staged_bytes

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def model() -> nn.Module:
    m = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 10, bias=False))
    m[0].requires_grad_(False)  # frozen, as a LoRA base: not checkpointed
    return m


def test_a_save_stages_the_trainable_weights_and_their_two_moments():
    assert staged_bytes(model()) == 3 * 100 * 10 * 4


def test_auto_writes_from_a_thread_on_a_cpu_and_from_a_process_on_a_gpu(tmp_path):
    assert choose_writer("auto", device=CPU, model=model(), workers_on_node=1,
                         shm=str(tmp_path)) == "thread"
    assert choose_writer("auto", device=CUDA, model=model(), workers_on_node=8,
                         shm=str(tmp_path)) == "process"
    assert choose_writer("process", device=CPU, model=model(), workers_on_node=1,
                         shm=str(tmp_path)) == "process"
    assert choose_writer("thread", device=CUDA, model=model(), workers_on_node=1,
                         shm=str(tmp_path)) == "thread"


def test_too_little_shared_memory_for_the_process_writer_is_named(tmp_path, capsys):
    # As many workers as make the node's staged state larger than any disk.
    crowd = 10**12
    assert choose_writer("auto", device=CUDA, model=model(), workers_on_node=crowd,
                         shm=str(tmp_path)) == "thread"
    said = capsys.readouterr().out
    assert f"but {tmp_path} has" in said and "--shm-size" in said and "from a thread" in said
    with pytest.raises(ValueError, match="or set checkpoint.writer=thread"):
        choose_writer("process", device=CUDA, model=model(), workers_on_node=crowd,
                      shm=str(tmp_path))
    assert choose_writer("auto", device=CUDA, model=model(), workers_on_node=1,
                         shm=str(tmp_path / "absent")) == "thread"


IDENTITY = {"data": "fp-a", "format": "chat", "tokenizer": "tok-a", "base_model": "base-a"}


def saved(tmp_path, identity=IDENTITY):
    """A real checkpoint of a small model, its marker verified."""
    from raylm.workers import checkpoint

    m = model()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    checkpoint.save(tmp_path / "ck", model=m, optimizer=opt, state={"step": 3},
                    config=saved_config(), identity=identity)
    return rundir.verify(tmp_path / "ck")


def test_a_resume_on_other_data_or_another_tokenizer_is_refused_unless_accepted(tmp_path):
    from raylm.rundir import CheckpointError, check_same_run

    marker = saved(tmp_path)
    assert marker.identity == IDENTITY
    assert check_same_run(marker, IDENTITY, "ck", accept=[]) == []
    with pytest.raises(CheckpointError, match=r"other the prepared data .* than this run has"
                                              r".*checkpoint.accept_changes=\[data\]"):
        check_same_run(marker, {**IDENTITY, "data": "fp-b"}, "ck", accept=[])
    with pytest.raises(CheckpointError, match=r"other the tokenizer .*accept_changes="
                                              r"\[tokenizer\]"):
        check_same_run(marker, {**IDENTITY, "tokenizer": "tok-b"}, "ck", accept=["data"])
    with pytest.raises(CheckpointError, match="model.path"):
        check_same_run(marker, {**IDENTITY, "base_model": "base-b"}, "ck", accept=[])
    # On purpose: what changed is returned, for the summary.
    changed = {**IDENTITY, "data": "fp-b", "format": "text"}
    assert check_same_run(marker, changed, "ck", accept=["data"]) == ["data", "format"]
    # A checkpoint from before identities were recorded has nothing to compare.
    assert check_same_run(dataclasses.replace(marker, identity={}), changed, "ck", accept=[]) == []


def test_a_marker_that_lists_no_files_does_not_verify(tmp_path):
    import json

    from raylm.contracts import CHECKPOINT_MARKER
    from raylm.rundir import CheckpointError, verify

    saved(tmp_path)
    marker_path = tmp_path / "ck" / CHECKPOINT_MARKER
    marker = json.loads(marker_path.read_text())
    marker_path.write_text(json.dumps({**marker, "files": {}}))
    with pytest.raises(CheckpointError, match="files is not an object of sizes, not empty"):
        verify(tmp_path / "ck")


def test_a_planted_pickle_in_checkpoint_metadata_does_not_run(tmp_path):
    """Whoever can write under run.storage_path could plant code in DCP's metadata (a pickle)
    and rewrite the marker to match: the resume refuses it unread."""
    import json
    import pickle

    from raylm.contracts import CHECKPOINT_MARKER
    from raylm.workers import checkpoint

    saved(tmp_path)
    ck = tmp_path / "ck"
    m = model()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    # A real checkpoint loads through the restricted reader.
    assert checkpoint.load(ck, model=m, optimizer=opt, config=saved_config(),
                           adapters=None) == {"step": 3}
    proof = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(proof)!r}, 'w').write('x')",))

    (ck / ".metadata").write_bytes(pickle.dumps(Payload()))
    marker = json.loads((ck / CHECKPOINT_MARKER).read_text())
    marker["files"][".metadata"] = (ck / ".metadata").stat().st_size
    marker["hashes"][".metadata"] = rundir.file_hash([(ck / ".metadata").read_bytes()])
    (ck / CHECKPOINT_MARKER).write_text(json.dumps(marker))
    with pytest.raises(rundir.CheckpointError, match=r"refers to builtins.exec.*refused"):
        checkpoint.load(ck, model=m, optimizer=opt, config=saved_config(), adapters=None)
    assert not proof.exists()


class _Payload:
    """An object whose unpickling writes a file: what a planted pickle would do instead."""

    def __init__(self, proof) -> None:
        self.proof = str(proof)

    def __reduce__(self):
        return (exec, (f"open({self.proof!r}, 'w').write('x')",))


def _planted(tmp_path, plant) -> tuple:
    """A real checkpoint rewritten as a writer of its storage could: its state changed by
    ``plant``, saved again with DCP and its marker's sizes and hashes recomputed."""
    import torch.distributed.checkpoint as dcp

    from raylm.workers import checkpoint

    saved(tmp_path)
    ck = tmp_path / "ck"
    m = model()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    state = checkpoint._state_dicts(m, opt)
    plant(state)
    for f in ck.iterdir():
        f.unlink()
    dcp.save(state, checkpoint_id=str(ck))
    checkpoint._write_marker(ck, state={"step": 3}, config=saved_config(), samples=None,
                             adapters=None, identity=IDENTITY)
    rundir.verify(ck, every_hash=True)
    return ck, m, opt


def test_a_planted_pickle_in_the_optimizer_state_does_not_run(tmp_path):
    """AdamW's hyperparameters are stored as pickles: one replaced by an object that runs code
    is refused, and the code never runs."""
    from raylm.workers import checkpoint

    proof = tmp_path / "ran"

    def plant(state):
        state["optim"]["param_groups"][0]["lr"] = _Payload(proof)

    ck, m, opt = _planted(tmp_path, plant)
    with pytest.raises(rundir.CheckpointError,
                       match=r"param_groups\.0\.lr holds a pickle that names \S*exec.*refused"):
        checkpoint.load(ck, model=m, optimizer=opt, config=saved_config(), adapters=None)
    assert not proof.exists()


class _Mesh:
    """Unpickles as a DeviceMesh, a class torch's restricted unpickler allows and calls."""

    def __reduce__(self):
        from torch.distributed.device_mesh import DeviceMesh

        return (DeviceMesh, ("cpu", [0, 1]))


def test_a_class_torch_registers_as_safe_is_not_called_either(tmp_path, monkeypatch):
    """A DeviceMesh planted in the optimizer's state: torch's restricted unpickler calls it,
    and with a rendezvous in the environment (as on a worker) it connects and waits for the
    store; raylm unpickles those items with no global at all, so it is refused unread."""
    from raylm.workers import checkpoint
    from tests.ranks import free_port

    def plant(state):
        state["optim"]["param_groups"][0]["lr"] = _Mesh()

    ck, m, opt = _planted(tmp_path, plant)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)
    with pytest.raises(rundir.CheckpointError, match=r"names \S*DeviceMesh.*refused unread"):
        checkpoint.load(ck, model=m, optimizer=opt, config=saved_config(), adapters=None)


def _remarked(ck) -> None:
    """The marker's sizes and hashes recomputed, as a writer of the storage could."""
    import json

    from raylm.contracts import CHECKPOINT_MARKER

    marker = json.loads((ck / CHECKPOINT_MARKER).read_text())
    for name in marker["files"]:
        marker["files"][name] = (ck / name).stat().st_size
        marker["hashes"][name] = rundir.file_hash([(ck / name).read_bytes()])
    (ck / CHECKPOINT_MARKER).write_text(json.dumps(marker))


def test_metadata_reads_only_the_files_the_marker_lists_and_dcp_fails_in_one_line(tmp_path):
    """DCP's metadata names the file each item is read from: pointed at a file the marker
    does not list (outside the checkpoint), it is refused unread. A listed shard cut short
    fails DCP's read: one line naming the checkpoint, a fault (retried), not DCP's traceback."""
    import pickle

    from raylm.workers import checkpoint

    ck, m, opt = _planted(tmp_path, lambda state: None)
    (tmp_path / "outside").write_bytes(b"x" * 4096)
    meta = pickle.loads((ck / ".metadata").read_bytes())
    shard = next(iter(meta.storage_data.values())).relative_path
    kept = (ck / ".metadata").read_bytes()
    for info in meta.storage_data.values():
        info.relative_path = "../outside"
    (ck / ".metadata").write_bytes(pickle.dumps(meta))
    _remarked(ck)
    with pytest.raises(rundir.CheckpointError, match=r"points at \.\./outside, which its "
                                                     r"marker does not list: refused unread"):
        checkpoint.load(ck, model=m, optimizer=opt, config=saved_config(), adapters=None)
    (ck / ".metadata").write_bytes(kept)
    (ck / shard).write_bytes((ck / shard).read_bytes()[:100])
    _remarked(ck)
    with pytest.raises(RuntimeError) as failed:
        checkpoint.load(ck, model=m, optimizer=opt, config=saved_config(), adapters=None)
    assert "DCP could not read it" in str(failed.value) and "\n" not in str(failed.value)


def test_a_model_weight_stored_as_a_pickle_is_refused_unread(tmp_path):
    """A weight marked in the metadata as a pickled object reaches model-only loads (export,
    generate) too: refused before it is unpickled."""
    from raylm.workers import checkpoint

    proof = tmp_path / "ran"

    def plant(state):
        state["model"]["1.weight"] = _Payload(proof)

    ck, m, _ = _planted(tmp_path, plant)
    with pytest.raises(rundir.CheckpointError,
                       match=r"1\.weight is stored as a pickled object where the model has a "
                             r"tensor"):
        checkpoint.load(ck, model=m, optimizer=None, config=saved_config(), adapters=None)
    assert not proof.exists()


def test_the_optimizer_state_round_trips_as_data(tmp_path):
    """What DataOnlyPlanner reads back is what was saved (AdamW's groups, step counts)."""
    from raylm.workers import checkpoint

    saved(tmp_path)
    m = model()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.5)
    checkpoint.load(tmp_path / "ck", model=m, optimizer=opt, config=saved_config(),
                    adapters=None)
    group = opt.param_groups[0]
    assert group["lr"] == 1e-3 and group["betas"] == (0.9, 0.999) and group["amsgrad"] is False


def saved_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=16)


def test_only_raylms_own_stale_staging_directories_are_removed(tmp_path, monkeypatch):
    import subprocess
    import sys

    from raylm.workers import checkpoint

    monkeypatch.setattr(checkpoint.tempfile, "gettempdir", lambda: str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f"raylm-ckpt-{gone}-step5-abc"
    stale.mkdir()
    others = [tmp_path / "raylm-ckpt-notes-step1", tmp_path / "raylm-ckpt-12-step3-file",
              tmp_path / "raylm-ckpt-\u00b2-step1", tmp_path / f"raylm-ckpt-{'9' * 20}-step1"]
    others[0].mkdir()
    others[2].mkdir()
    others[3].mkdir()
    others[1].write_text("someone's file")
    checkpoint.remove_stale_staging()
    assert not stale.exists() and all(p.exists() for p in others)


def test_a_small_file_changed_in_place_does_not_verify(tmp_path):
    """Same size, other bytes (bit rot, an overwrite): the hash in the marker tells."""
    from raylm.rundir import CheckpointError, verify

    marker = saved(tmp_path)
    assert set(marker.hashes) == set(marker.files)
    ledger = tmp_path / "ck" / ".metadata"
    data = bytearray(ledger.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ledger.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"\.metadata does not match its hash"):
        verify(tmp_path / "ck")


def test_a_full_disk_during_a_save_leaves_nothing_a_resume_would_take(tmp_path):
    """A real ENOSPC (the kernel's, from writes into /dev/full) while a shard, and then while
    the marker, is written: the save fails loudly, and the resume takes the checkpoint before."""
    import errno
    import os

    from raylm.contracts import CHECKPOINT_MARKER
    from raylm.workers import checkpoint

    run = tmp_path / "run"
    m = model()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])

    def save(name: str, step: int) -> None:
        checkpoint.save(run / name, model=m, optimizer=opt, state={"step": step},
                        config=saved_config())

    save("checkpoint_1", 1)
    shards = [p.name for p in (run / "checkpoint_1").iterdir() if p.suffix == ".distcp"]
    for name, full in [("checkpoint_2", shards[0]), ("checkpoint_3", f".{CHECKPOINT_MARKER}.tmp")]:
        (run / name).mkdir()
        os.symlink("/dev/full", run / name / full)
        # DCP wraps a rank's failure in CheckpointException, a BaseException.
        with pytest.raises(BaseException) as failed:
            save(name, int(name[-1]))
        chain = [failed.value, failed.value.__cause__, failed.value.__context__,
                 *getattr(failed.value, "failures", {}).values()]
        assert any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain
                   if e is not None) or "No space left" in str(failed.value), failed.value
    path, marker = rundir.latest_verified(run)
    assert path.endswith("checkpoint_1") and marker.state == {"step": 1}
    # A checkpoint a rewind marked bad is passed over as a broken one is.
    save("checkpoint_0", 0)
    path, _ = rundir.latest_verified(run, exclude=["checkpoint_1"])
    assert path.endswith("checkpoint_0")
    for name in ("checkpoint_2", "checkpoint_3"):
        with pytest.raises(rundir.CheckpointError, match="save did not finish"):
            rundir.verify(run / name)


def two_checkpoints(run):
    """A run directory with real checkpoints at steps 2 and 4."""
    from raylm.workers import checkpoint

    m = model()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    for step in (2, 4):
        checkpoint.save(run / f"checkpoint_{step}", model=m, optimizer=opt,
                        state={"step": step}, config=saved_config())
    return run


def test_a_run_whose_every_checkpoint_is_marked_bad_refuses_to_start_over(tmp_path):

    run = two_checkpoints(tmp_path / "run")
    path, _ = rundir.latest_usable(run, bad=["checkpoint_4"])
    assert path.endswith("checkpoint_2")
    with pytest.raises(rundir.CheckpointError,
                       match=r"every verified checkpoint of .* is marked bad .*from step 0"):
        rundir.latest_usable(run, bad=["checkpoint_4", "checkpoint_2"])
    assert rundir.latest_usable(tmp_path / "new", bad=[]) is None


@pytest.mark.parametrize("damage", [{"state": None}, {"state": {"step": "3"}},
                                    {"files": {"a": "big"}}, {"hashes": []}, {"identity": 1}])
def test_a_malformed_marker_is_a_broken_checkpoint_passed_over(tmp_path, damage):
    """A marker that is JSON but not the shape raylm writes: the checkpoint is skipped with a
    warning, and the one before it used, rather than every restart stopping on a TypeError."""
    import json

    from raylm.contracts import CHECKPOINT_MARKER

    run = two_checkpoints(tmp_path / "run")
    marker = run / "checkpoint_4" / CHECKPOINT_MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), **damage}))
    path, _ = rundir.latest_verified(run, warn=lambda _: None)
    assert path.endswith("checkpoint_2")
    with pytest.raises(rundir.CheckpointError, match=f"{CHECKPOINT_MARKER} is malformed"):
        rundir.verify(run / "checkpoint_4")
