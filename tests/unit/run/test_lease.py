"""One live run per name (raylm.run.lease): a second driver of a run directory is refused,
naming the first, while a lease whose holder is gone is taken over."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from raylm.cli import main
from raylm.names import LEASE
from raylm.run import lease
from raylm.run.lease import Lease, LeaseError, hold


def test_a_second_live_train_of_a_run_is_refused_before_ray_naming_the_first(
        tmp_path, capsys, ray_never_starts):
    run_dir = tmp_path / "runs" / "shared"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom raylm.run.lease import Lease\n"
         f"Lease({str(run_dir)!r}).take()\nprint('held', flush=True)\ntime.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        args = ["train", f"--run.storage_path={tmp_path / 'runs'}", "--run.name=shared",
                "--tracking.enabled=false"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert (f"run directory {run_dir} is in use by pid {holder.pid} on "
                f"{socket.gethostname()}") in err and err.count("\n") == 1, err
    finally:
        holder.kill()
        holder.wait()
    # Its holder is gone (killed, no lease given back): the next driver takes it at once.
    with hold(str(run_dir)):
        assert json.loads((run_dir / LEASE).read_text())["pid"] != holder.pid
    assert not (run_dir / LEASE).exists()


def test_a_lease_of_another_host_expires_when_its_heartbeat_stops(tmp_path):
    path = tmp_path / LEASE
    other = {"host": "elsewhere", "pid": 1, "started": time.time() - 600, "token": "t"}
    path.write_text(json.dumps({**other, "beat": time.time() - 5}))
    with pytest.raises(LeaseError, match="is in use by pid 1 on elsewhere"):
        Lease(str(tmp_path)).take()
    path.write_text(json.dumps({**other, "beat": time.time() - lease.EXPIRES_S - 1}))
    taken = Lease(str(tmp_path)).take()
    try:
        assert json.loads(path.read_text())["token"] == taken.holder["token"]
    finally:
        taken.release()


def test_the_entry_paths_lease_covers_the_training_code_it_calls(tmp_path):
    with hold(str(tmp_path)) as outer:
        with hold(str(tmp_path)) as inner:  # launch.train inside api.train: not taken again
            assert inner.lease is None and outer.lease is not None
        assert (tmp_path / LEASE).exists()
    assert not (tmp_path / LEASE).exists()


def test_the_heartbeat_renews_the_lease(tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "BEAT_S", 0.05)
    held = Lease(str(tmp_path)).take()
    try:
        first = json.loads((tmp_path / LEASE).read_text())["beat"]
        time.sleep(0.5)
        assert json.loads((tmp_path / LEASE).read_text())["beat"] > first
    finally:
        held.release()


def test_a_restarted_trial_waits_out_its_earlier_attempts_lease_and_no_other(tmp_path):
    """Tune restarts a trial on another node after its node was lost: the earlier attempt's
    lease (another host, so its liveness is unknown here) is waited out, not refused; a
    different owner is refused at once, and a lease still renewed is a live holder."""
    path = tmp_path / LEASE
    beat = time.time() - lease.EXPIRES_S + 1.5  # expires in 1.5 s
    earlier = {"host": "lost-node", "pid": 7, "started": beat - 100, "beat": beat,
               "token": "t0", "owner": "trial a1 of sweep"}
    path.write_text(json.dumps(earlier))
    with pytest.raises(LeaseError, match="in use by pid 7 on lost-node"):
        Lease(str(tmp_path), owner="trial b2 of sweep").take()
    said: list[str] = []
    started = time.monotonic()
    taken = Lease(str(tmp_path), owner="trial a1 of sweep", log=said.append).take()
    try:
        assert 1.0 < time.monotonic() - started < 10
        assert "earlier attempt of trial a1 of sweep (pid 7 on lost-node)" in said[0]
        assert json.loads(path.read_text())["token"] == taken.holder["token"]
    finally:
        taken.release()

    # Renewed while waited for: alive, refused.
    path.write_text(json.dumps({**earlier, "beat": time.time() - lease.EXPIRES_S + 1.0}))

    def renew():
        time.sleep(0.3)
        path.write_text(json.dumps({**earlier, "beat": time.time()}))

    import threading

    threading.Thread(target=renew).start()
    with pytest.raises(LeaseError, match="in use by pid 7 on lost-node"):
        Lease(str(tmp_path), owner="trial a1 of sweep", log=said.append).take()
