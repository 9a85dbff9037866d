"""Faults are retried, mistakes are not: the errors that the workers raise and the driver and
the Ray Train controller read (torch-free, so that every process can import it).

Ray Train restarts a worker group after any worker error, up to ``train.max_failures`` times,
as it should for lost machines, preempted nodes and broken connections. A mistake in what the
run was given (weights that do not fit the model, a checkpoint of another model, weights that
did not load) fails the same way on every attempt, so each retry only repeats it, and the user
reads "failed after 4 failures" with the cause buried in the workers' logs.

A worker raises :class:`Mistake` for those: during setup, for the error types that cannot come
from a machine (below), and before the first step of a pretrained model that predicts every
token alike. :class:`raylm.run.record.EndOnMistake`, a callback on the Ray Train controller,
sees the worker's error when it polls the group and, when the failure policy would retry, raises it
instead: the controller treats an error raised by a callback as its own, which is never
retried, and the run ends after one attempt with the worker's message. Ray Train's failure
policy has no public hook for this (its factory always builds the default policy), so this
uses the controller-callback interface Ray keeps for its own callbacks, which run_config
callbacks may implement.
"""

from __future__ import annotations

from raylm import storage
from raylm.contracts import LEASE, LeaseRecord, Malformed

# Errors in setup that no machine fault raises: the same input raises them again. Connection,
# storage and collective errors (OSError, RuntimeError and their kin) stay faults.
MISTAKES = (ValueError, TypeError, KeyError, AttributeError, ImportError, NotImplementedError,
            FileNotFoundError, PermissionError)


class Mistake(ValueError):
    """An error in the run's input: the run ends at once, with this message (one line from the
    command, as other bad input)."""


class LeaseLost(Mistake):
    """The run's driver no longer holds the run directory's lease: another driver took it
    over (this one stalled or lost its storage for longer than the lease lasts)."""


def check_lease(run_dir: str, token: str | None) -> None:
    """Raise :class:`LeaseLost` unless the run directory's lease (see
    :mod:`raylm.run.lease`) still holds ``token``, the run's driver's; None: no lease to
    keep (a trainer built without one). One small read."""
    if token is None:
        return
    path = storage.join(run_dir, LEASE)
    try:
        holder = LeaseRecord.from_json(storage.read_bytes(path))
    except (FileNotFoundError, Malformed):
        holder = None
    if holder is not None and holder.token == token:
        return
    by = f"pid {holder.pid} on {holder.host}" if holder is not None else "no one"
    raise LeaseLost(
        f"this run's driver no longer holds the lease {storage.redact(path)} (it is held by "
        f"{by}): the driver stalled or lost its storage for longer than the lease lasts, and "
        f"another driver may have taken the run over; stopped before writing anything more "
        f"to the run directory. See which process drives the run now before starting it "
        f"again.")


def cause(error: BaseException, kind: type[BaseException] = Mistake) -> BaseException | None:
    """The error of type ``kind`` (a :class:`Mistake` unless said) behind ``error``, as Ray
    Train wraps a worker's or a callback's error; None if there is none."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, kind):
            return error
        error = (getattr(error, "_base_exc", None) or getattr(error, "controller_failure", None)
                 or error.__cause__)
    return None


def last_line(error: BaseException) -> str:
    """The last line of ``error``'s message: for an actor that failed as it started, the
    error its constructor raised (Ray puts the traceback before it)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


class Rewind(RuntimeError):
    """Raised on every rank once the samples of faulty steps are recorded to be left out (or
    the checkpoint a group resumed from is marked bad): Ray Train restarts the group, which
    resumes from the latest good checkpoint without them (:mod:`raylm.workers.health`)."""


class Preempted(RuntimeError):
    """Raised on every rank after the checkpoint a SIGTERM asked for is saved
    (:mod:`raylm.workers.preemption`)."""
