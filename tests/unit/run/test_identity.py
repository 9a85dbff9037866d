"""What makes a run the same run, and a stored DPO reference the same reference: the base
model is identified by what its files hold, not by their sizes."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from raylm import rundir
from raylm.config import load_config
from raylm.contracts import Marker
from raylm.run.launch import base_model_identity, choose_device
from tests.conftest import save_tiny_qwen3

VOCAB = 8000  # embeddings of 2 MB each: files larger than the part read whole


def identity_of(path) -> str:
    return base_model_identity(load_config(None, [f"--model.path={path}"]))


def test_a_base_re_exported_into_the_same_folder_is_another_base(tmp_path):
    """Same config, same file names and sizes, other weights (a corrected model saved over the
    old one, a new hub commit of the same shape): another identity. A byte-for-byte copy (new
    files, new times) is the same base."""
    base = save_tiny_qwen3(tmp_path / "base", vocab_size=VOCAB, seed=0)
    before = identity_of(base)
    shutil.copytree(base, tmp_path / "copy")
    assert identity_of(tmp_path / "copy") == before and before.startswith("v3:")
    sizes = {f.name: f.stat().st_size for f in base.iterdir()}
    save_tiny_qwen3(base, vocab_size=VOCAB, seed=1)
    assert {f.name: f.stat().st_size for f in base.iterdir()} == sizes
    assert identity_of(base) != before
    # A change far from the file's start (the output head's last rows) shows too.
    save_tiny_qwen3(base, vocab_size=VOCAB, seed=0)
    (weights,) = base.glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    data[-10:] = bytes(b ^ 0xFF for b in data[-10:])
    weights.write_bytes(bytes(data))
    assert identity_of(base) != before


def test_a_tensor_changed_in_place_anywhere_in_the_file_is_another_base(tmp_path):
    """Every tensor's ends are read: one projection of the top layer rewritten in place (same
    header, same size, as another tool that tunes a layer and saves over the file leaves it)
    is seen, where spans spread over the file missed most of a published model's tensors."""
    base = save_tiny_qwen3(tmp_path / "base", vocab_size=VOCAB, seed=0)
    before = identity_of(base)
    (weights,) = base.glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    n = int.from_bytes(data[:8], "little")
    a, b = json.loads(data[8:8 + n])["model.layers.1.mlp.up_proj.weight"]["data_offsets"]
    data[8 + n + a:8 + n + b] = bytes(x ^ 0x01 for x in data[8 + n + a:8 + n + b])
    weights.write_bytes(bytes(data))
    assert identity_of(base) != before
    # A run recorded with the spans' identity (v2) is not compared: it cannot be.
    marker = Marker(state={"step": 1}, model={}, files={}, identity={
        "data": "d", "format": "chat", "tokenizer": "t", "base_model": "v2:0a1b2c3d4e5f"})
    now = {**marker.identity, "base_model": identity_of(base)}
    assert rundir.check_same_run(marker, now, "ck", accept=[]) == []


def test_a_lora_resume_on_a_changed_base_is_refused_unless_accepted(tmp_path):
    base = save_tiny_qwen3(tmp_path / "base", vocab_size=VOCAB, seed=0)
    marker = Marker(state={"step": 1}, model={}, files={}, identity={
        "data": "d", "format": "chat", "tokenizer": "t", "base_model": identity_of(base)})
    save_tiny_qwen3(base, vocab_size=VOCAB, seed=1)
    now = {**marker.identity, "base_model": identity_of(base)}
    with pytest.raises(rundir.CheckpointError, match=r"other model.path than this run has"):
        rundir.check_same_run(marker, now, "ck", accept=[])
    assert rundir.check_same_run(marker, now, "ck", accept=["base_model"]) == ["base_model"]
    # A checkpoint of a release that identified bases by their sizes cannot be compared.
    older = dataclasses.replace(marker, identity={**marker.identity,
                                                  "base_model": "0a1b2c3d4e5f60718293a4b5"})
    assert rundir.check_same_run(older, now, "ck", accept=[]) == []


def test_a_stored_reference_is_used_only_for_the_inputs_it_records_and_whole(tmp_path):
    from raylm.contracts import REFERENCE_INFO
    from raylm.run import reference

    base = save_tiny_qwen3(tmp_path / "base", vocab_size=64)

    def cfg(*args):
        return choose_device(load_config(None, [
            "--train.objective=dpo", "--data.format=preference", f"--model.path={base}",
            *args]), {"CPU": 2.0})[0]

    identity = {"data": "d", "format": "preference", "tokenizer": "t",
                "base_model": identity_of(base)}
    what = reference.reference_inputs(cfg(), identity)
    out = tmp_path / "ref"
    (out / "train").mkdir(parents=True)
    (out / "train" / "a.parquet").write_bytes(b"x")
    assert reference._usable(out, what) == f"it has no {REFERENCE_INFO}"
    info = {"inputs": what, "files": ["train/a.parquet", "val/b.parquet"]}
    (out / REFERENCE_INFO).write_text(json.dumps(info))
    assert reference._usable(out, what) == "1 of its files are missing"
    (out / "val").mkdir()
    (out / "val" / "b.parquet").write_bytes(b"y")
    assert reference._usable(out, what) is None
    other = reference.reference_inputs(cfg("--train.precision=bf16-mixed"), identity)
    assert reference._usable(out, other) == "it was computed from other inputs"
