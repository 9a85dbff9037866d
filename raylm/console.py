"""What reaches the console: raylm's own lines, warnings and errors; the libraries' detail only
with ``run.verbose``.

Left alone, a 2-worker run prints, for every report of every worker, Ray Train's "Reporting
training result N: TrainingReport(...all metrics...)" line, plus Ray Data's plan and progress
lines and MLflow's INFO lines: raylm's progress line was one line in five. Each library keeps
its own switch, set here in every process that runs raylm code (driver, Train controller,
workers): Ray Train's ``LoggingConfig`` (its console and app log; its system log keeps every
line), Ray Data's console handler (``ray-data.log`` keeps every line), Tune's verbosity, and
MLflow's ``MLFLOW_LOGGING_LEVEL``. Their warnings and errors (Ray Data's "may hang forever", a
failed MLflow call) still print.

On the driver, :func:`tidy_driver_console` goes further with what Ray forwards there from the
other processes: raylm's own lines lose Ray's ``(TrainController pid=N)`` prefix (the line
says what it is), colour codes are left out where the console is not a terminal, and the
lines in :data:`HARMLESS`, which healthy runs print and which read as errors, are
dropped (Ray's own log files keep them), as is ``ray.init``'s notice that token
authentication is on (it is, and it asks nothing of the user; its warning when it is off
stays). Not reached: what Ray's C++ core writes straight to the driver's own stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from typing import Any, TextIO


def quiet_libraries(verbose: bool) -> None:
    """In this process: the libraries' INFO lines on the console only when ``verbose``. Call it
    before the process first talks to MLflow; a level the user set in ``MLFLOW_LOGGING_LEVEL``
    is kept."""
    import ray.data  # noqa: F401 (it installs its handlers when first imported)

    level = logging.INFO if verbose else logging.WARNING
    quiet_torchao()
    # Ray Data: its console handler only; its file handler keeps writing ray-data.log.
    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setLevel(level)
    if not verbose:
        # The worker's one "Progress bars disabled" warning answers raylm's own choice (one
        # stream per worker, each with bars, would bury the log; see raylm.data.streams).
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    # Ray Train 2.60 logs "Reporting training result N: TrainingReport(...)" for every
    # report of every worker through a logger named after its file, outside ``ray.train``,
    # where its LoggingConfig does not reach.
    from raylm.compat import get_train_context

    logging.getLogger(sys.modules[get_train_context.__module__].__file__).setLevel(level)
    # mlflow sets its logger's level from this variable when first imported.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", logging.getLevelName(level))
    logging.getLogger("mlflow").setLevel(os.environ["MLFLOW_LOGGING_LEVEL"])


def one_copy_of_worker_prints() -> None:
    """In the process that starts a run (Ray Train passes the setting on to the controller and
    the workers): a worker's lines once. Ray Train 2.60 sends a worker's ``print`` to Train's
    logger, whose console handler writes it to stderr, and also, when ``sys.stdout`` is not
    the interpreter's own, to stdout, for a library that wraps the stream to see it. Ray's
    worker process always replaces ``sys.stdout``, so every line a worker printed reached the
    console twice. A value the user set is kept."""
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")


def quiet_torchao() -> None:
    """Call before importing peft or torchao. Installed, torchao is imported by peft and by
    transformers (whenever it builds a model), and warns on import that its CUDA extensions
    built for other Python versions and Triton do not load and that torch deprecates a
    registration it makes: five lines about the installation in every process that builds a
    model, none about the run. Its errors still print."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


@contextlib.contextmanager
def quiet_model_io() -> Iterator[None]:
    """Around raylm's own loads and saves of a whole model on one process (export, sampling,
    the model logged to MLflow): transformers' progress bars for each shard read and written,
    torch's notice that a checkpoint is read without a process group (the point of it here),
    and a deprecation between peft and transformers are left out; the user's settings are
    restored after."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            # peft asks transformers through a name transformers deprecates.
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprec")
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def train_log_level(verbose: bool) -> str:
    """The level of Ray Train's own ``ray.train`` console lines (controller and workers)."""
    return "INFO" if verbose else "WARNING"


def tune_verbosity(verbose: bool) -> int:
    """Ray Tune's console output: its trial tables only when ``verbose`` (each trial prints
    raylm's own progress lines either way)."""
    return 2 if verbose else 0


#: Lines Ray forwards to the driver that every healthy run prints and that read as errors,
#: each with why it is left out of the console (Ray's logs under its session directory keep
#: them). Matched against the message after Ray's process prefix.
HARMLESS: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"core_worker\.cc:\d+.*has constructor arguments in the object store and "
                r"max_restarts > 0"),
     "Ray's core logs this at error level whenever an actor that may be restarted is made "
     "with arguments in the object store: Ray Train's preemption watcher and Ray Data's map "
     "workers, in every run. Their restart would fail only if those arguments were lost with "
     "a node, and then the worker group is restarted whole, with new ones."),
    (re.compile(r"Failed to query Ray Train Controller actor state\. State API may be "
                r"temporarily unavailable"),
     "Ray Train's placement-group cleaner asks Ray's State API, which the dashboard serves, "
     "whether the Train controller still lives, every second or two for the whole run. A "
     "head started with --include-dashboard=false never answers, so it warns at every check "
     "(about 90 lines in a 40-step run) and nothing else changes: the run trains, and the "
     "controller removes its placement group when it ends. Only its backstop for a "
     "controller that dies without ending is lost there; `ray stop` frees that group."),
)

# "(Name pid=N[, ip=A]) " and its colour codes, as Ray prefixes another process's line.
_RAY_PREFIX = re.compile(r"^(?:\x1b\[[0-9;]*m)*\((?:[\w.:-]+ )?pid=\w+(?:, ip=[^)]*)?\)"
                         r"(?:\x1b\[[0-9;]*m)* ")
# raylm's own lines: progress, its notices and warnings.
_RAYLM_LINE = re.compile(r"^(?:raylm[: ]|step \d+/\d+  |warning: raylm|tokenizer: )")


def tidy_line(line: str) -> str | None:
    """``line`` as the driver's console shows it (see the module doc), None to drop it."""
    prefix = _RAY_PREFIX.match(line)
    message = line[prefix.end():] if prefix else line
    if prefix and any(pattern.search(message) for pattern, _ in HARMLESS):
        return None
    if prefix and _RAYLM_LINE.match(message):
        return message
    return line


class _TidyStream:
    """A text stream that passes every write through, except the lines Ray forwards (which
    start with its prefix), which :func:`tidy_line` rewrites or drops. A write that starts
    no such line (a progress bar's carriage return) goes through at once."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._line = ""

    def write(self, text: str) -> int:
        if not self._line and not text.startswith(("(", "\x1b")):
            return self._stream.write(text)
        self._line += text
        while "\n" in self._line:
            line, self._line = self._line.split("\n", 1)
            shown = tidy_line(line)
            if shown is not None:
                self._stream.write(shown + "\n")
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _NotTheTokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


def tidy_driver_console() -> None:
    """On the driver, once, before Ray forwards anything (see the module doc)."""
    notices = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _NotTheTokenNotice) for f in notices.filters):
        notices.addFilter(_NotTheTokenNotice())
    if not getattr(sys.stdout, "isatty", lambda: False)():
        # Ray colours the prefixes it writes unless told not to; a log file gets none.
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, _TidyStream):
            setattr(sys, name, _TidyStream(stream))
