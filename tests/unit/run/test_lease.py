"""One live run per name (raylm.run.lease): a second driver of a run directory is refused,
naming the first, while a lease whose holder is gone is taken over."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from raylm.cli import main
from raylm.contracts import LEASE, LeaseRecord
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


def test_a_lease_of_another_machine_expires_only_unrenewed_for_the_expiry_by_the_takers_clock(
        tmp_path, monkeypatch):
    """A holder on another host, or on this host name in another PID namespace or boot (a
    container, a pod): its pid means nothing here and its clock may differ, so its lease is
    watched for EXPIRES_S by the taker's own clock: renewed meanwhile, refused; unchanged,
    taken, however recent its beat reads."""
    monkeypatch.setattr(lease, "EXPIRES_S", 1.0)
    path = tmp_path / LEASE
    now = time.time() + 3600  # a holder whose clock runs an hour ahead
    others = [{"host": "elsewhere", "pid": 1, "started": now, "beat": now, "token": "t"},
              {"host": socket.gethostname(), "pid": os.getpid(), "started": now, "beat": now,
               "token": "t", "machine": "another-boot another-namespace"}]
    for other in others:
        path.write_text(json.dumps(other))

        def renew(other=other):
            time.sleep(0.3)
            path.write_text(json.dumps({**other, "beat": other["beat"] + 10}))

        threading.Thread(target=renew).start()
        said: list[str] = []
        with pytest.raises(LeaseError, match=f"in use by pid {other['pid']} on {other['host']}"):
            Lease(str(tmp_path), log=said.append).take()
        assert "watching up to 1 s for a renewal" in said[0]
        started = time.monotonic()
        taken = Lease(str(tmp_path), log=said.append).take()
        try:
            assert 1.0 <= time.monotonic() - started < 5
            assert json.loads(path.read_text())["token"] == taken.holder.token
        finally:
            taken.release()


def test_a_malformed_lease_is_taken_over_at_once_in_one_line(tmp_path):
    (tmp_path / LEASE).write_text(json.dumps({"host": "h", "pid": 3, "started": float("nan"),
                                              "beat": 1.0, "token": "t"}))
    said: list[str] = []
    Lease(str(tmp_path), log=said.append).take().release()
    (line,) = said
    assert "is not a lease raylm wrote (malformed)" in line


def test_a_lock_file_that_is_a_link_is_not_followed(tmp_path):
    outside = tmp_path / "outside"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / f"{LEASE}.lock").symlink_to(outside)
    with pytest.raises(OSError):
        Lease(str(tmp_path / "run")).take()
    assert not outside.exists()


def test_the_entry_paths_lease_covers_the_training_code_it_calls(tmp_path):
    with hold(str(tmp_path)) as outer:
        with hold(str(tmp_path)) as inner:  # launch.train inside api.train: not taken again
            assert inner is outer
        assert (tmp_path / LEASE).exists()
        assert LeaseRecord.from_json((tmp_path / LEASE).read_text()).token == outer.token
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


RACER = """
import os, sys, time
from raylm.run.lease import Lease, LeaseError
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.005)
time.sleep(max(0.0, float(open(sys.argv[2]).read()) - time.time()))
try:
    Lease(sys.argv[1]).take()
except LeaseError:
    print("refused", flush=True)
    sys.exit(0)
print("won", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("left_by", ["nobody", "a dead holder"])
def test_of_processes_racing_for_a_lease_exactly_one_wins(tmp_path, left_by):
    """Six drivers started at the same instant, on a run directory with no lease or with one
    whose holder is gone: one takes it, the others are refused; no taker deletes the winner's
    fresh lease as the expired one (each change is conditional on the lease it read)."""
    if left_by == "a dead holder":  # a process of this machine that has ended
        ended = subprocess.Popen([sys.executable, "-c", ""])
        ended.wait()
        (tmp_path / LEASE).write_text(json.dumps(
            {"host": socket.gethostname(), "pid": ended.pid, "started": 0.0,
             "beat": time.time(), "token": "gone", "machine": lease.this_machine()}))
    go = tmp_path.parent / f"{tmp_path.name}-go"
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), str(go)],
                               stdout=subprocess.PIPE, text=True) for _ in range(6)]
    try:
        assert [r.stdout.readline().strip() for r in racers] == ["ready"] * 6
        # Every interpreter has started: they all take the lease at one instant.
        go.with_suffix(".tmp").write_text(str(time.time() + 0.2))
        go.with_suffix(".tmp").rename(go)
        said = sorted(r.stdout.readline().strip() for r in racers)
        assert said == ["refused"] * 5 + ["won"], said
        winner = json.loads((tmp_path / LEASE).read_text())
        assert winner["pid"] in {r.pid for r in racers if r.poll() is None}
    finally:
        for r in racers:
            r.kill()
            r.wait()


class ConditionalStore:
    """An object store with S3's conditional writes, in memory: each write carries the version
    (ETag) it expects, and the store, under its own lock, refuses it if the object moved on."""

    exclusive = True

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.data: bytes | None = None
        self.version = 0
        self.gets = 0

    def read(self):
        with self.lock:
            self.gets += 1
            if self.data is None:
                return None, None
            return lease._parse(self.data), str(self.version)

    def put(self, text, *, expect):
        with self.lock:
            now = None if self.data is None else str(self.version)
            if now != expect:
                return None
            self.data, self.version = text.encode(), self.version + 1
            return str(self.version)

    def drop(self, *, expect):
        return self.put(json.dumps({"released": True}), expect=expect) is not None


def test_of_threads_racing_on_a_conditional_object_store_exactly_one_wins(monkeypatch):
    monkeypatch.setattr(lease, "EXPIRES_S", 0.3)  # the lost node's lease is watched that long
    store = ConditionalStore()
    store.data = json.dumps({"host": "lost-node", "pid": 7, "started": 0.0,
                             "beat": time.time() - 600, "token": "gone"}).encode()
    go = threading.Barrier(8)
    won: list[Lease] = []
    refused: list[str] = []

    def race() -> None:
        taker = Lease("s3://bucket/runs/r1", store=store, log=lambda _: None)
        go.wait()
        try:
            won.append(taker.take())
        except LeaseError as e:
            refused.append(str(e))

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(won) == 1 and len(refused) == 7, (won, refused)
        assert json.loads(store.data)["token"] == won[0].token
    finally:
        for w in won:
            w.release()
    # Given back: the next taker finds no holder and takes it.
    assert json.loads(store.data) == {"released": True}
    Lease("s3://bucket/runs/r1", store=store).take().release()


def test_a_lease_taken_over_is_lost_and_the_run_writes_nothing_more(tmp_path, capsys,
                                                                    monkeypatch):
    """A driver that stalled past the lease's expiry finds it taken: its next renewal fails
    (conditional on the lease it wrote), it says so, and gives nothing back; the workers'
    and the record's check refuse to write into the run directory."""
    from raylm.faults import LeaseLost, check_lease
    from raylm.run.record import RunRecord
    from raylm.run.tracking import Tracker

    monkeypatch.setattr(lease, "EXPIRES_S", 0.5)
    first = Lease(str(tmp_path)).take()
    first._stop.set()  # a stalled driver: no heartbeat
    check_lease(str(tmp_path), first.token)
    stale = json.loads((tmp_path / LEASE).read_text())
    (tmp_path / LEASE).write_text(json.dumps({**stale, "host": "elsewhere"}))
    second = Lease(str(tmp_path)).take()  # unrenewed for EXPIRES_S: taken over
    try:
        assert not first.renew() and first.lost.is_set()
        said = capsys.readouterr().out
        assert f"{LEASE} was taken over by pid {os.getpid()}" in said and "ends before" in said
        first.release()  # gives back nothing: the lease is the second driver's
        assert json.loads((tmp_path / LEASE).read_text())["token"] == second.token
        with pytest.raises(LeaseLost, match=f"held by pid {os.getpid()}"):
            check_lease(str(tmp_path), first.token)
        record = RunRecord(str(tmp_path), total_steps=4, tracker=Tracker(),
                           lease=first.token)
        record.flush()
        record.finish(failed=False)
        assert not (tmp_path / "summary.json").exists()
        assert "no longer holds the lease" in capsys.readouterr().out
    finally:
        second.release()
    assert not (tmp_path / LEASE).exists()


def test_an_s3_lease_uses_s3s_conditional_writes(monkeypatch):
    """Against a real S3 API on loopback (moto's server): a second taker is refused, a renewal
    after a takeover fails, and a given-back lease is taken again."""
    boto3 = pytest.importorskip("boto3")
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                     "AWS_DEFAULT_REGION": "us-east-1",
                     "AWS_ENDPOINT_URL": f"http://{host}:{port}"}.items():
            monkeypatch.setenv(k, v)
        boto3.client("s3").create_bucket(Bucket="runs")
        uri = "s3://runs/r1"
        assert isinstance(lease.store_for(f"{uri}/{LEASE}"), lease.S3Store)
        first = Lease(uri).take()
        first._stop.set()
        with pytest.raises(LeaseError, match="is in use by pid"):
            Lease(uri).take()
        assert first.renew()
        # Another driver's write (as a takeover after expiry would make) moves the ETag on.
        store = lease.store_for(f"{uri}/{LEASE}")
        _, etag = store.read()
        assert store.put(dataclasses.replace(first.holder, token="other").to_json(), expect=etag)
        assert store.put("{}", expect=None) is None  # If-None-Match: * on an existing lease
        assert not first.renew() and first.lost.is_set()
        assert store.drop(expect=store.read()[1])
        Lease(uri).take().release()
        assert store.read()[0] is None
    finally:
        server.stop()
