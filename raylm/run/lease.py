"""One live run per name: the process that drives a run (``raylm train``, ``raylm tune``, a
sweep's trial) holds a lease in its run directory, taken before Ray starts and given back when
it ends. A second driver of the same run directory is refused, naming the holder (host, pid,
start time), instead of pruning the first one's checkpoints, rewriting its summary and
resuming from its checkpoints.

The lease is ``lease.json``, created exclusively (locally one ``O_EXCL`` create: of two
takers exactly one wins; in object storage a check and a write, then a read-back of whose
token is there, since pyarrow offers no conditional put) and renewed by a heartbeat thread
every :data:`BEAT_S` seconds. A lease not renewed for :data:`EXPIRES_S` seconds (its holder
died without giving it back: a killed driver, a lost node), or held by a process of this host
that no longer exists, is taken over. Ray Train's own restarts happen inside the holder and
need nothing from here.

A Tune trial is restarted by Tune in a new process, often on another node when its node was
lost: its lease names its owner (the trial), and a taker with the same owner finds its own
earlier attempt there, on a host whose processes it cannot see. It waits for that lease to
expire (at most :data:`EXPIRES_S` seconds, said in a line) instead of being refused; a lease
still renewed after that is a live process, and refused.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from raylm import storage
from raylm.names import LEASE

BEAT_S = 10.0
EXPIRES_S = 60.0
# Leases this process holds, by run directory: an entry path takes the lease before Ray
# starts, and the training code it calls finds it held here rather than taking it again.
_HELD: dict[str, Lease] = {}


class LeaseError(ValueError):
    """The run directory is being driven by another live process."""


def _alive_here(holder: dict[str, Any]) -> bool:
    if holder.get("host") != socket.gethostname():
        return True  # cannot tell: the heartbeat decides
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, ValueError):
        pass
    return True


def _expired(holder: dict[str, Any], now: float) -> bool:
    return now - float(holder.get("beat", 0)) > EXPIRES_S or not _alive_here(holder)


class Lease:
    """A lease on ``run_dir`` held by this process (see the module docstring)."""

    def __init__(self, run_dir: str, *, owner: str | None = None, log=print) -> None:
        self.run_dir = storage.normalize(run_dir)
        self.path = storage.join(self.run_dir, LEASE)
        self.log = log
        now = time.time()
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": now,
                       "beat": now, "token": uuid.uuid4().hex, "owner": owner}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(storage.read_text(self.path))
        except FileNotFoundError:
            return None
        except ValueError:  # being written this instant
            time.sleep(0.2)
            try:
                return json.loads(storage.read_text(self.path))
            except (FileNotFoundError, ValueError):
                return {"host": "?", "pid": "?", "started": time.time(), "beat": time.time()}

    def _ours(self) -> bool:
        held = self._read()
        return held is not None and held.get("token") == self.holder["token"]

    def take(self) -> Lease:
        for _ in range(3):
            self.holder["beat"] = time.time()
            if storage.create_text(self.path, json.dumps(self.holder)):
                if self._ours():
                    self._start_heartbeat()
                    return self
                continue
            held = self._read()
            if held is None:
                continue  # given back meanwhile
            if not _expired(held, time.time()) and self._earlier_attempt(held):
                held = self._wait_for_expiry(held)
            if not _expired(held, time.time()):
                raise LeaseError(self._refusal(held))
            storage.remove(self.path)  # its holder is gone
        raise LeaseError(f"could not take the lease {self.path}: other processes keep taking "
                         f"it; is the same run started several times at once?")

    def _earlier_attempt(self, held: dict[str, Any]) -> bool:
        """Whether ``held`` is an earlier attempt of this lease's owner (a restarted trial)."""
        owner = self.holder["owner"]
        return owner is not None and held.get("owner") == owner

    def _wait_for_expiry(self, held: dict[str, Any]) -> dict[str, Any]:
        """The lease as it is once ``held`` expired, was given back, or was renewed past its
        expiry (its holder lives)."""
        deadline = float(held["beat"]) + EXPIRES_S + 1.0
        self.log(f"raylm: the lease {self.path} is held by an earlier attempt of "
                 f"{self.holder['owner']} (pid {held['pid']} on {held['host']}); waiting up to "
                 f"{max(0.0, deadline - time.time()):.0f} s for it to expire")
        while time.time() < deadline:
            time.sleep(min(1.0, max(0.05, deadline - time.time())))
            now = self._read()
            if now is None:
                return {**held, "beat": 0}  # given back: take it
            if float(now["beat"]) > float(held["beat"]):  # renewed: its holder lives
                return now
        return self._read() or {**held, "beat": 0}

    def _refusal(self, held: dict[str, Any]) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(held["started"])))
        age = time.time() - float(held["beat"])
        return (f"run directory {self.run_dir} is in use by pid {held['pid']} on "
                f"{held['host']}, running since {started} (its lease was renewed {age:.0f} s "
                f"ago); wait for that run to end, or give this one another run.name. A lease "
                f"whose holder died expires {EXPIRES_S:.0f} s after its last renewal "
                f"({self.path}).")

    def _start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(BEAT_S):
                try:
                    if not self._ours():
                        print(f"warning: raylm lease {self.path} was taken over by another "
                              f"process", flush=True)
                        return
                    self.holder["beat"] = time.time()
                    storage.write_text(self.path, json.dumps(self.holder))
                except Exception as e:  # storage hiccup: the next beat tries again
                    print(f"warning: raylm lease {self.path}: {type(e).__name__}: {e}",
                          flush=True)

        self._thread = threading.Thread(target=beat, name="raylm-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            if self._ours():
                storage.remove(self.path)
        except OSError as e:
            print(f"warning: raylm lease {self.path} not given back ({e}); it expires in "
                  f"{EXPIRES_S:.0f} s", flush=True)


class hold:
    """``with hold(run_dir):`` the lease on ``run_dir`` for the block, taken here unless this
    process holds it already (then the outer holder gives it back). ``owner``: what holds it
    across processes (a Tune trial's id), whose earlier attempt is waited out."""

    def __init__(self, run_dir: str, *, owner: str | None = None, log=print) -> None:
        self.key = storage.normalize(run_dir)
        self.owner, self.log = owner, log
        self.lease: Lease | None = None

    def __enter__(self) -> hold:
        if self.key not in _HELD:
            self.lease = _HELD[self.key] = Lease(self.key, owner=self.owner,
                                                 log=self.log).take()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.lease is not None:
            del _HELD[self.key]
            self.lease.release()
