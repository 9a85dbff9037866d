"""Which Ray cluster a raylm command runs on: chosen explicitly, said in one line, and never
waited on in silence.

``ray.init()`` without an address joins the head that ``ray start`` last recorded on this
machine (``ray_current_cluster`` in Ray's temp directory). When that head died without a clean
``ray stop`` (killed, machine restarted), the record stays and ``ray.init()`` retries "Failed
to connect to GCS" for minutes, saying nothing a user can act on. So raylm looks first:

1. ``run.ray_address``, then ``RAY_ADDRESS`` (which jobs on a cluster have): joined if they
   answer within ``run.connect_timeout_s`` (:data:`CONNECT_TIMEOUT_S` by default), else a
   one-line error naming the address and where it came from. ``auto`` means the recorded
   head, which must answer; ``local`` starts a new local cluster.
2. Otherwise the head ``ray start`` recorded on this machine, if it answers.
3. Otherwise a new local cluster, stopped when the command ends (a recorded head that did not
   answer is named in the same line).

Answering means accepting a TCP connection on the address's port, which a killed head does not.

MLflow's credentials (:data:`FORWARDED`) set where raylm runs go with the run: a local cluster
raylm starts inherits them. A cluster it joins should have them in its nodes' environment
(the cluster files set it): the Train controller and the workers then log with those, and
nothing is forwarded. Where the nodes lack them (or hold others), they go as this job's
environment, with a warning: Ray keeps a job's environment in its job record (``ray list jobs
--detail`` shows it) and each node's runtime-env agent logs it. A job that ``ray job submit``
started has the environment the submission and the cluster's nodes gave it, which raylm
leaves alone.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from raylm.console import tidy_driver_console

CONNECT_TIMEOUT_S = 10.0
"""How long an address may take to accept a connection before it counts as not answering."""
RECORDED_TIMEOUT_S = 2.0
"""The same for the head recorded on this machine, which answers at once when it is up."""


FORWARDED = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def forwarded_env(env: dict[str, str] | os._Environ) -> dict[str, str]:
    """The variables a joined cluster's processes may need from this one (see the module
    doc)."""
    if env.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):  # a submitted job's driver
        return {}
    return {k: env[k] for k in FORWARDED if env.get(k)}


def _digest(value: str | None) -> str | None:
    return None if value is None else hashlib.blake2b(value.encode(), digest_size=16).hexdigest()


def missing_on_nodes(wanted: dict[str, str], on_node: dict[str, str | None]) -> dict[str, str]:
    """Of ``wanted``, the variables a node of the cluster does not have with the same value
    (``on_node``: each one's digest there, None where unset): what must be forwarded."""
    return {k: v for k, v in wanted.items() if on_node.get(k) != _digest(v)}


def _node_env(names: tuple[str, ...]) -> dict[str, str | None]:
    """Digests of the variables ``names`` in a cluster process's environment (one task, no
    CPU: the values never leave the node)."""
    import ray

    @ray.remote(num_cpus=0)
    def read() -> dict[str, str | None]:
        return {k: _digest(os.environ.get(k)) for k in names}

    return ray.get(read.remote(), timeout=60)


@dataclass(frozen=True)
class Choice:
    address: str | None
    """What ``ray.init`` is given; ``None`` starts a new local cluster."""
    origin: str
    """Where the address came from, as the user would name it."""
    note: str = ""
    """Anything passed over on the way (a recorded head that did not answer)."""
    recorded: bool = False
    """The head ``ray start`` recorded here: joined as ``auto``, which alone makes Ray send the
    token of a head with token authentication on (``ray start``'s default) unasked."""


def recorded_head() -> str | None:
    """The GCS address the last ``ray start --head`` on this machine recorded, if any."""
    from raylm.compat import find_bootstrap_address

    return find_bootstrap_address(None)


def answers(address: str, *, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether something accepts connections at ``address`` (``host:port`` or
    ``ray://host:port``) within ``timeout_s``."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"Ray address {address!r} is not HOST:PORT or ray://HOST:PORT")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=timeout_s):
                return True
        except OSError:
            # A head that is starting may refuse for a moment; one that is gone refuses until
            # the deadline.
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)


def choose(address: str | None, *, env: dict[str, str] | None = None,
           timeout_s: float = CONNECT_TIMEOUT_S) -> Choice:
    """The cluster to run on (see the module docstring for the order)."""
    env = os.environ if env is None else env
    origin = "run.ray_address" if address else "RAY_ADDRESS"
    address = address or env.get("RAY_ADDRESS") or None
    if address == "local":
        return Choice(None, origin)
    if address is not None:
        if address == "auto":
            recorded = recorded_head()
            if recorded is None:
                raise ValueError(f"{origin}=auto, but no `ray start` head is recorded on this "
                                 f"machine; start one (ray start --head) or give its address.")
            address, origin = recorded, f"{origin}=auto, the head `ray start` recorded"
        if not answers(address, timeout_s=timeout_s):
            raise ValueError(f"the Ray cluster at {address} ({origin}) does not answer: "
                             f"nothing accepted a connection in {timeout_s:g} s; start it, "
                             f"fix {origin.split('=')[0]}, or unset it to start a local "
                             f"cluster.")
        return Choice(address, origin, recorded="=auto" in origin)
    recorded = recorded_head()
    if recorded is None:
        return Choice(None, "no cluster given")
    # A head on this machine that is up answers at once; a record is often stale.
    if answers(recorded, timeout_s=min(timeout_s, RECORDED_TIMEOUT_S)):
        return Choice(recorded, "the head `ray start` runs on this machine", recorded=True)
    return Choice(None, "no cluster given",
                  note=f"not joined: the head `ray start` recorded at {recorded} does not "
                       f"answer, stopped without `ray stop`?")


def join(choice: Choice, **init) -> None:
    """``ray.init`` on the choice; a cluster that answers but refuses us is a mistake here."""
    import logging

    import ray

    refused_token(choice)
    try:
        # Warnings and up from Ray itself; raylm prints its own progress.
        ray.init(address="auto" if choice.recorded else choice.address or "local",
                 logging_level=logging.WARNING, log_to_driver=True, **init)
    except ConnectionError as e:
        raise ValueError(
            f"could not join the Ray cluster at {choice.address} ({choice.origin}), which "
            f"answers: {e}; if its head has token authentication on (`ray start`'s default), "
            f"export RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN, or ~/.ray/auth_token "
            f"as on the machine that made it)") from None


def refused_token(choice: Choice) -> None:
    """Refuse a head that refuses this process's token (or its lack of one) at once: one
    client asks it, where ``ray.init`` would ask again for 20 s, printing a warning each time,
    and then say only that it could not connect. (A head found through ``ray start``'s record
    is left to ``ray.init``, which turns token authentication on for it where a token exists.)"""
    if choice.address is None or choice.recorded or "://" in choice.address:
        return
    from ray.exceptions import AuthenticationError

    from raylm import compat

    try:
        compat.GcsClient(address=choice.address)
    except AuthenticationError:
        token = os.environ.get("RAY_AUTH_MODE") == "token"
        whose = "this process's token" if token else "a process without a token"
        raise ValueError(
            f"the Ray cluster at {choice.address} ({choice.origin}) refuses {whose}: its head "
            f"has token authentication on (`ray start`'s default); "
            f"{'' if token else 'export RAY_AUTH_MODE=token and '}give its token as "
            f"RAY_AUTH_TOKEN or in ~/.ray/auth_token (`ray get-auth-token` prints it on the "
            f"head node)") from None
    except Exception:  # noqa: BLE001 - anything else is ray.init's to report
        return


def connect(address: str | None, *, log: Callable[[str], None],
            timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """``ray.init`` on the chosen cluster, unless this process already joined one."""
    import ray

    tidy_driver_console()
    if ray.is_initialized():
        return
    choice = choose(address, timeout_s=timeout_s)
    join(choice)
    if choice.address is None:
        cpus = ray.cluster_resources().get("CPU", 0)
        note = f"; {choice.note}" if choice.note else ""
        log(f"raylm: started a local Ray cluster with {cpus:g} CPUs, which stops when this "
            f"command ends{note}")
        return
    wanted = forwarded_env(os.environ)
    missing = missing_on_nodes(wanted, _node_env(tuple(wanted))) if wanted else {}
    if missing:
        # A job's environment is fixed when it joins: join again with them.
        ray.shutdown()
        join(choice, runtime_env={"env_vars": missing})
        log(f"raylm: warning: the cluster's nodes lack {', '.join(sorted(missing))} as set "
            f"here, so they go with this job, where Ray's job record (ray list jobs --detail) "
            f"and each node's runtime-env log show them; set them in the nodes' environment "
            f"instead (the cluster files do)")
    log(f"raylm: joined the Ray cluster at {choice.address} ({choice.origin})")
