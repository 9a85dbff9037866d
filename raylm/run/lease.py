"""One live run per name: the process that drives a run (``raylm train``, ``raylm tune``, a
sweep's trial) holds ``lease.json`` in its run directory (:class:`raylm.contracts.LeaseRecord`),
taken before Ray starts, renewed every :data:`BEAT_S` seconds and given back when it ends;
docs/fault-tolerance.md ("One live run per name") says what a second driver, a dead holder, a
taken-over one and a restarted Tune trial meet. Every change is conditional on what its writer
read last, so of two processes racing for it exactly one wins: under an exclusive ``flock`` of
``lease.json.lock`` on a file system; with S3's conditional writes (``If-None-Match: *``,
``If-Match`` on the ETag read) through boto3, since pyarrow, which raylm's storage uses, offers
no conditional write; elsewhere a check, a write and a read-back, which the taker says. Ray
Train's own restarts happen inside the holder and need nothing from here; the run's workers
and record check the lease (:func:`raylm.faults.check_lease`) before each checkpoint and each
summary.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import socket
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from raylm import storage
from raylm.contracts import LEASE, LeaseRecord, Malformed
from raylm.outputs import alive

BEAT_S = 10.0
EXPIRES_S = 60.0
# Leases this process holds, by run directory: an entry path takes the lease before Ray
# starts, and the training code it calls finds it held here rather than taking it again.
_HELD: dict[str, Lease] = {}
# What an unreadable lease names (content not written by raylm): no live holder, so it expires
# at once and is replaced conditionally.
_NOBODY = LeaseRecord(host="?", pid=1, started=0.0, beat=0.0, token="")


class LeaseError(ValueError):
    """The run directory is being driven by another live process."""


def _parse(data: bytes) -> LeaseRecord | None:
    """The holder a lease names; None for a lease given back."""
    try:
        return LeaseRecord.from_json(data)
    except Malformed:
        return _NOBODY


class PlainStore:
    """``lease.json`` in an object store raylm has no conditional write for: a check, then a
    whole-object write. Two takers within the same moment may both write; the taker reads
    the lease back to see whose it is, which catches all but writes landing together."""

    exclusive = False

    def __init__(self, uri: str) -> None:
        self.path = uri

    def _raw(self) -> bytes | None:
        try:
            return storage.read_bytes(self.path)
        except FileNotFoundError:
            return None

    def read(self) -> tuple[LeaseRecord | None, Any]:
        """The holder (None if there is none) and the version a change is conditional on
        (here the bytes read)."""
        raw = self._raw()
        return (None, None) if raw is None else (_parse(raw), raw)

    def put(self, text: str, *, expect: Any) -> Any:
        if self._raw() != expect:
            return None
        storage.write_text(self.path, text)
        return text.encode()

    def drop(self, *, expect: Any) -> bool:
        if self._raw() != expect:
            return False
        storage.remove(self.path)
        return True


class LocalStore(PlainStore):
    """``lease.json`` on a file system: each change made under an exclusive ``flock`` of a
    lock file beside it (kept: removing a lock file races its next taker), against the bytes
    read. ``flock`` excludes across hosts on NFSv4 too, where Linux maps it to a byte-range
    lock."""

    exclusive = True

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.file = Path(path)
        self.lock = self.file.with_name(self.file.name + ".lock")

    @contextmanager
    def _locked(self):
        self.file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # and with it the lock

    def put(self, text: str, *, expect: Any) -> Any:
        """Write ``text`` if the lease is still at version ``expect`` (None: absent); its new
        version, or None if the lease changed meanwhile."""
        data = text.encode()
        with self._locked():
            if self._raw() != expect:
                return None
            fd, tmp = tempfile.mkstemp(dir=self.file.parent, prefix=f".{self.file.name}.")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.file)
        return data

    def drop(self, *, expect: Any) -> bool:
        """Remove the lease if it is still at version ``expect``."""
        with self._locked():
            if self._raw() != expect:
                return False
            self.file.unlink()
        return True


class S3Store:
    """``lease.json`` in S3, changed with S3's conditional writes (boto3, its default
    credential chain and ``AWS_ENDPOINT_URL``, as pyarrow's S3 filesystem reads them). A
    lease is given back by a conditional write of a released lease, since deleting on a
    condition is not offered by every S3 service."""

    exclusive = True

    def __init__(self, uri: str, client=None) -> None:
        import boto3

        parsed = urlparse(uri)
        self.bucket, self.key = parsed.netloc, parsed.path.lstrip("/")
        self.client = client or boto3.client("s3")

    def _failed(self, e: Exception) -> bool:
        """Whether ``e`` is S3 refusing a write whose condition no longer holds."""
        code = getattr(e, "response", {}).get("Error", {}).get("Code")
        return code in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey",
                        "412", "409", "404")

    def read(self) -> tuple[LeaseRecord | None, Any]:
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except self.client.exceptions.NoSuchKey:
            return None, None
        return _parse(got["Body"].read()), got["ETag"]

    def put(self, text: str, *, expect: Any) -> Any:
        condition = {"IfNoneMatch": "*"} if expect is None else {"IfMatch": expect}
        try:
            done = self.client.put_object(Bucket=self.bucket, Key=self.key,
                                          Body=text.encode(), **condition)
        except Exception as e:
            if self._failed(e):
                return None
            raise
        return done["ETag"]

    def drop(self, *, expect: Any) -> bool:
        return self.put(LeaseRecord.RELEASED, expect=expect) is not None


def store_for(path: str):
    """The store for a lease at ``path`` (see the module docstring)."""
    if not storage.is_uri(path):
        return LocalStore(path)
    if path.startswith("s3://"):
        try:
            return S3Store(path)
        except ImportError:
            pass
    return PlainStore(path)


def this_machine() -> str | None:
    """This boot of this host and this process's PID namespace: a pid names the same process
    only where both match (a container of the same host name has another namespace)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _here(holder: LeaseRecord) -> bool:
    """Whether the holder's pid can be checked here (a lease of before 0.3 by its host)."""
    return holder.host == socket.gethostname() and holder.machine in (None, this_machine())


class Lease:
    """A lease on ``run_dir`` held by this process (see the module docstring)."""

    def __init__(self, run_dir: str, *, owner: str | None = None, log=print,
                 store=None) -> None:
        self.run_dir = storage.normalize(run_dir)
        self.path = storage.join(self.run_dir, LEASE)
        self.store = store or store_for(self.path)
        self.log = log
        now = time.time()
        self.holder = LeaseRecord(host=socket.gethostname(), pid=os.getpid(), started=now,
                                  beat=now, token=uuid.uuid4().hex, owner=owner,
                                  machine=this_machine())
        self.version: Any = None  # of the lease as this process last wrote it
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def token(self) -> str:
        return self.holder.token

    def _write(self, holder: LeaseRecord, expect: Any) -> bool:
        """Write ``holder`` over the lease at version ``expect``: True if it is ours now."""
        version = self.store.put(holder.to_json(), expect=expect)
        if version is not None and not self.store.exclusive:  # read back: is it ours?
            held, version = self.store.read()
            version = version if held is not None and held.token == self.token else None
        if version is None:
            return False
        self.holder, self.version = holder, version
        return True

    def take(self) -> Lease:
        if not self.store.exclusive:
            self.log(f"raylm: warning: {urlparse(self.path).scheme} storage offers raylm no "
                     f"conditional write, so the run's lease {storage.redact(self.path)} is a "
                     f"check and a write: two drivers of this run started within the same "
                     f"moment could both run (S3 with boto3 installed, and local or network "
                     f"file systems, exclude them)")
        for _ in range(5):
            self.holder = dataclasses.replace(self.holder, beat=time.time())
            held, version = self.store.read()
            if held is _NOBODY:
                self.log(f"raylm: warning: {storage.redact(self.path)} is not a lease raylm "
                         f"wrote (malformed): taken over as one whose holder is gone")
            elif held is not None and not (_here(held) and not alive(held.pid)):
                if not _here(held):  # alive or not, only its renewals can tell
                    held, version = self._watch(held, version)
                if held is not None:
                    raise LeaseError(self._refusal(held))
            self.holder = dataclasses.replace(self.holder, beat=time.time())
            # Absent, given back or expired: replace exactly the lease read, if it is still
            # there; another taker who got there first makes this write fail.
            if self._write(self.holder, version):
                self._start_heartbeat()
                return self
        raise LeaseError(f"could not take the lease {storage.redact(self.path)}: other "
                         f"processes keep taking it; is the same run started several times at "
                         f"once?")

    def _watch(self, held: LeaseRecord, version: Any) -> tuple[LeaseRecord | None, Any]:
        """A holder elsewhere, watched by this process's clock (its own may differ): (None,
        the version) once unchanged for EXPIRES_S or given back; the holder once renewed."""
        of = f" (owner {held.owner})" if held.owner else ""
        self.log(f"raylm: the lease {storage.redact(self.path)} is held by pid {held.pid} on "
                 f"{held.host}{of}; watching up to {EXPIRES_S:.0f} s for a renewal")
        deadline = time.monotonic() + EXPIRES_S
        while time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.01, deadline - time.monotonic())))
            now, seen = self.store.read()
            if now is None or seen != version:
                return now, seen  # given back: take it; renewed: its holder lives
        return None, version

    def _refusal(self, held: LeaseRecord) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held.started))
        age = time.time() - held.beat
        return (f"run directory {storage.redact(self.run_dir)} is in use by pid {held.pid} "
                f"on {held.host}, running since {started} (its lease was renewed {age:.0f} "
                f"s ago); wait for that run to end, or give this one another run.name. A lease "
                f"whose holder died expires {EXPIRES_S:.0f} s after its last renewal "
                f"({storage.redact(self.path)}).")

    def renew(self) -> bool:
        """One heartbeat: renew the lease if it is still ours; False once it is not (taken
        over). Storage errors propagate, and the next beat tries again: while storage is out
        of reach no one else can take the lease either, and once it is back a taker that got
        in first makes this conditional write fail."""
        if self.lost.is_set():
            return False
        if not self._write(dataclasses.replace(self.holder, beat=time.time()), self.version):
            self._lose()
            return False
        return True

    def _lose(self) -> None:
        self.lost.set()
        held, _ = self.store.read()
        by = f" by pid {held.pid} on {held.host}" if held else ""
        print(f"raylm: error: the lease {storage.redact(self.path)} was taken over{by} (this "
              f"driver did not renew it for over {EXPIRES_S:.0f} s): this run ends before its "
              f"next checkpoint or summary, and leaves the run directory to the new holder",
              flush=True)

    def _start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(BEAT_S):
                try:
                    if not self.renew():
                        return
                except Exception as e:  # storage hiccup: the next beat tries again
                    print(f"warning: raylm lease {storage.redact(self.path)}: "
                          f"{type(e).__name__}: {e}", flush=True)

        self._thread = threading.Thread(target=beat, name="raylm-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.lost.is_set():
            return  # another holder's now
        try:
            self.store.drop(expect=self.version)
        except OSError as e:
            print(f"warning: raylm lease {storage.redact(self.path)} not given back ({e}); it "
                  f"expires in {EXPIRES_S:.0f} s", flush=True)


class hold:
    """``with hold(run_dir) as lease:`` the lease on ``run_dir`` for the block, taken here unless
    this process holds it already (then the outer holder gives it back). ``owner``: what holds
    it across processes (a Tune trial's id), named when another attempt's lease is watched."""

    def __init__(self, run_dir: str, *, owner: str | None = None, log=print) -> None:
        self.key = storage.normalize(run_dir)
        self.owner, self.log = owner, log
        self.lease: Lease | None = None

    def __enter__(self) -> Lease:
        if self.key not in _HELD:
            self.lease = _HELD[self.key] = Lease(self.key, owner=self.owner,
                                                 log=self.log).take()
        return _HELD[self.key]

    def __exit__(self, *exc: Any) -> None:
        if self.lease is not None:
            del _HELD[self.key]
            self.lease.release()
