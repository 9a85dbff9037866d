"""Choosing the Ray cluster: explicit addresses, RAY_ADDRESS, the head `ray start` recorded on
this machine, and a local cluster; dead addresses are named, not retried forever."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raylm.run.cluster import choose
from tests.ranks import free_port


@pytest.fixture
def ray_tmp(tmp_path, monkeypatch):
    """Ray's temp directory, where `ray start` records its head, made the test's own."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path / "ray"


def record(ray_tmp: Path, address: str) -> None:
    ray_tmp.mkdir(exist_ok=True)
    (ray_tmp / "ray_current_cluster").write_text(address)


@pytest.fixture
def listening():
    """An address something answers at, standing in for a live head's GCS port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


def test_nothing_recorded_starts_a_local_cluster(ray_tmp):
    assert choose(None).address is None


def test_a_live_recorded_head_is_joined(ray_tmp, listening):
    record(ray_tmp, listening)
    c = choose(None, timeout_s=1)
    assert (c.address, c.origin) == (listening, "the head `ray start` runs on this machine")
    # Joined as Ray joins a head it finds itself: with the head's token, where it has one.
    assert c.recorded


def test_a_dead_recorded_head_is_named_and_passed_over(ray_tmp):
    dead = f"127.0.0.1:{free_port()}"
    record(ray_tmp, dead)
    t0 = time.monotonic()
    c = choose(None, timeout_s=1)
    assert c.address is None and time.monotonic() - t0 < 5
    assert c.note == (f"not joined: the head `ray start` recorded at {dead} does not answer, "
                      f"stopped without `ray stop`?")


def test_given_addresses_must_answer(ray_tmp, listening, monkeypatch):
    dead = f"127.0.0.1:{free_port()}"
    assert choose(listening, timeout_s=1).origin == "run.ray_address"
    assert not choose(listening, timeout_s=1).recorded
    with pytest.raises(ValueError, match=rf"^the Ray cluster at {dead} \(run.ray_address\) does "
                                         rf"not answer: nothing accepted a connection in 1 s"):
        choose(dead, timeout_s=1)
    monkeypatch.setenv("RAY_ADDRESS", f"ray://{dead}")
    with pytest.raises(ValueError, match=r"\(RAY_ADDRESS\) does not answer.* fix RAY_ADDRESS"):
        choose(None, timeout_s=1)
    # run.ray_address wins over RAY_ADDRESS; `local` starts a new cluster whatever is recorded.
    assert choose(listening, timeout_s=1).address == listening
    record(ray_tmp, listening)
    assert choose("local").address is None
    monkeypatch.delenv("RAY_ADDRESS")
    c = choose("auto", timeout_s=1)
    assert c.address == listening and c.origin.startswith("run.ray_address=auto")
    assert c.recorded
    (ray_tmp / "ray_current_cluster").unlink()
    with pytest.raises(ValueError, match="no `ray start` head is recorded"):
        choose("auto")


def test_raylm_train_against_a_dead_address_fails_in_one_line(ray_tmp):
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{free_port()}"}
    t0 = time.monotonic()
    p = subprocess.run([Path(sys.executable).parent / "raylm", "train",
                        "--tracking.enabled=false", "--run.connect_timeout_s=2"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith(f"raylm: error: the Ray cluster at {env['RAY_ADDRESS']} "
                               f"(RAY_ADDRESS) does not answer: nothing accepted a "
                               f"connection in 2 s")
    assert p.stderr.count("\n") == 1
    assert time.monotonic() - t0 < 60
