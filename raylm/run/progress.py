"""Training progress on the driver: a progress bar in terminals and notebooks, plain lines
where output is a log (CI, ``ray job logs``, a file).

Every report reaches the Ray Train controller, not the driver (the notebook, the ``raylm``
command): the controller's record (:mod:`raylm.run.record`) prints a progress line per report, and
Ray forwards the controller's output to the driver. A bar has to be drawn by the driver itself,
so with a bar the record puts each report's figures on a Ray queue instead (an actor holding
no CPU), and a thread of the driver moves them into a tqdm bar (``tqdm.auto``: a widget in
Jupyter, text in a terminal) with step, loss, validation loss, tokens/s and the ETA.

``run.progress``: ``auto`` draws a bar when the driver runs in a Jupyter kernel or its stderr
is a terminal, lines otherwise; ``bar`` and ``lines`` force either.
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO

from raylm.contracts.report import Report


def use_bar(mode: str, stream: TextIO | None = None) -> bool:
    """Whether ``run.progress`` = ``mode`` draws a bar on this driver."""
    if mode != "auto":
        return mode == "bar"
    if in_notebook():
        return True
    stream = stream or sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (where tqdm.auto draws a widget). Having
    imported ipykernel is not enough: tools that run notebooks import it too."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


class Bar:
    """A tqdm bar over the run's steps, fed the record's progress figures."""

    def __init__(self, total: int, *, file: TextIO | None = None) -> None:
        from tqdm.auto import tqdm

        # Every report redraws (mininterval 0): reports come seconds apart, not per step.
        self.bar = tqdm(total=total, unit="step", file=file, dynamic_ncols=True,
                        desc="training", mininterval=0)
        self.val_loss: float | None = None

    def update(self, r: Report) -> None:
        if r.val_loss is not None:
            self.val_loss = r.val_loss
        if self.bar.n == 0 and r.resumed_from_step:
            # A resumed run: its ETA counts from here, not from step 0.
            self.bar.reset(total=self.bar.total)
            self.bar.update(r.resumed_from_step)
        figures = {"loss": f"{r.loss:.4f}"}
        if self.val_loss is not None:
            figures["val"] = f"{self.val_loss:.4f}"
        figures["tok/s"] = f"{r.tokens_per_s:,.0f}"
        self.bar.set_postfix(figures, refresh=False)
        # A restarted group reports steps again from its checkpoint: the bar moves back.
        self.bar.update(r.step - self.bar.n)

    def close(self) -> None:
        self.bar.close()


class Feed:
    """The driver's end of the progress queue: :attr:`queue` goes to the record, and a thread
    draws what arrives on a :class:`Bar` until :meth:`close`."""

    def __init__(self, total: int, *, file: TextIO | None = None) -> None:
        from ray.util.queue import Queue

        self.queue = Queue(actor_options={"num_cpus": 0})
        self.bar = Bar(total, file=file)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._drain, name="raylm-progress", daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        from ray.util.queue import Empty

        while True:
            try:
                self.bar.update(self.queue.get(timeout=0.5))
            except Empty:
                if self.done.is_set():
                    return
            except Exception:  # noqa: BLE001 (the queue's actor is gone: nothing more comes)
                return

    def close(self) -> None:
        """Draw what is left, close the bar and the queue."""
        import ray

        self.done.set()
        self.thread.join(timeout=10)
        self.bar.close()
        ray.kill(self.queue.actor)
