"""Numerical health: every step's loss and gradient norm checked on the device, and a step that
fails the check kept from the weights.

A step is a fault when its loss or gradient norm is not finite, or (``train.on_spike``) when its
loss exceeds ``train.spike_factor`` times the median loss of the last ``train.spike_window``
steps that were not faults (from the end of warmup, once the window is full; a median, not a
mean, so that one spike does not raise the bar for the next). Both figures are global (the loss
is all-reduced, the norm is over every shard), so every rank finds the same faults.

Nothing here waits for the device. :meth:`Health.check` computes the step's fault flag as a
device tensor; :func:`raylm.workers.step.apply_update` hands it to a fused AdamW as its
``found_inf`` (the kernel then leaves weights, moments and step counts as they were, as it does
for an overflowed fp16 step under a gradient scaler), and the flags and figures of each step
since the last report sit in a small device buffer that the report reads with the loss it reads
anyway (:meth:`Health.read`). Only an optimizer that cannot take the flag (the foreach AdamW raylm
uses on CPUs, where every kernel has finished when it returns, so reading a value waits for
nothing) reads it on the host at each step.

What a fault then does (skip, rewind, stop) is decided at the report, by every rank alike:
:mod:`raylm.workers.loop`. Written by hand: torch, Ray Train and the usual trainers have no
device-side fault check that leaves the host free (torchtitan and Megatron-LM read the loss or
the norm back every step to decide).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from raylm.data.packing import Skips, as_ranges
from raylm.faults import Mistake

NONFINITE, SPIKE = 1, 2
CAUSES = {NONFINITE: "nonfinite", SPIKE: "spike"}


@dataclass(frozen=True)
class Fault:
    """A step the check kept from the weights."""

    step: int
    """1-based: the optimizer step it was (steps done once it had run)."""
    cause: str
    loss: float
    grad_norm: float


class Health:
    """The check of one worker (all ranks run it alike, every step)."""

    def __init__(self, *, device: torch.device, start_step: int, report_every: int,
                 spikes: bool = False, factor: float = 2.0, window: int = 50,
                 spikes_from: int = 0) -> None:
        self.device = device
        self.spikes, self.factor, self.window = spikes, factor, window
        self.spikes_from = spikes_from
        self.step = start_step  # steps done
        self.since_start = 0  # steps checked since this worker started (the window's fill)
        self.recent = torch.full((window,), float("nan"), device=device)
        # Each step since the last report: its code (0 fine) and its loss and norm.
        self.codes = torch.zeros(report_every, dtype=torch.int32, device=device)
        self.figures = torch.zeros((report_every, 2), dtype=torch.float32, device=device)
        self.first = start_step  # the last report's step
        self.n = 0

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """The fault flag of the step whose global ``loss`` and ``grad_norm`` these are: a 0-d
        float32 device tensor, 1.0 for a fault (what a fused optimizer's ``found_inf`` takes)."""
        loss, grad_norm = loss.detach().float(), grad_norm.detach().float()
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        code = (~finite).to(torch.int32)
        if (self.spikes and self.step >= self.spikes_from
                and self.since_start >= self.window):
            spike = finite & (loss > self.factor * torch.nanmedian(self.recent))
            code = torch.where(spike, torch.full_like(code, SPIKE), code)
        fault = code > 0
        slot = self.since_start % self.window
        # A fault keeps its place in the window empty (NaN): nanmedian passes over it.
        self.recent[slot] = torch.where(fault, torch.full_like(loss, float("nan")), loss)
        if self.n == len(self.codes):
            raise RuntimeError(f"{self.n} steps without a report: Health.read must be called "
                               f"at least every report_every steps")
        self.codes[self.n] = code
        self.figures[self.n, 0], self.figures[self.n, 1] = loss, grad_norm
        self.n += 1
        self.step += 1
        self.since_start += 1
        return fault.float()

    def read(self) -> list[Fault]:
        """The faults among the steps since the last call (one device-to-host copy; call it
        where the report reads its figures)."""
        codes = self.codes[:self.n].cpu().tolist()
        figures = self.figures[:self.n].cpu().tolist() if any(codes) else []
        out = [Fault(step=self.first + i + 1, cause=CAUSES[c], loss=figures[i][0],
                     grad_norm=figures[i][1]) for i, c in enumerate(codes) if c]
        self.first, self.n = self.step, 0
        return out


# ---- What a fault does, decided at a report by every rank alike ----------------------------

SEVERITY = ("skip", "rewind", "stop")


class NumericalFault(Mistake):
    """A fault under ``stop``, or one that came back after ``train.max_rewinds`` rewinds at
    the same step: the run ends, not retried."""


def _number(x: float) -> float | str:
    """A figure for JSON files, which have no NaN or infinity: those as "nan", "inf"."""
    return x if math.isfinite(x) else str(x)


@dataclass
class Decision:
    """What the faults of a report window make the group do."""

    action: str
    """``skip`` (go on), ``rewind`` (write ``manifest``, then raise :class:`Rewind`) or
    ``stop`` (raise :class:`NumericalFault` with ``message``)."""
    records: list[dict[str, Any]]
    """One per fault: step, cause, loss, grad norm, action, its positions (ranges) and the
    stored rows they hold."""
    manifest: dict[str, Any] | None = None
    message: str = ""


def decide(faults: list[Fault], *, policy: dict[str, str],
           positions_of: Callable[[int], np.ndarray], rows_of: Callable[[np.ndarray], np.ndarray],
           manifest: dict[str, Any], max_rewinds: int, resumed: tuple[str, int] | None,
           culprits_of: Callable[[int], np.ndarray | None] = lambda step: None,
           documents_of: Callable[[np.ndarray], list[dict] | None] = lambda rows: None
           ) -> Decision:
    """What to do about ``faults`` (every rank computes the same). ``policy``: the action
    per cause; ``positions_of(step)``: the global positions 0-based ``step`` trained;
    ``rows_of``: their stored rows; ``manifest``: the run's so far; ``resumed``: the name and
    step of the checkpoint this group resumed from; ``culprits_of(step)``: the positions of
    that step whose loss alone is not finite (None: not known; every rank calls it, in the
    same order); ``documents_of(rows)``: the corpus records stored rows hold. Each record
    names the documents of the samples at fault (the culprits, else the step's), at most
    :data:`DOCUMENTS_LISTED` of them.

    A rewind leaves out the samples of every step of the window whose action is rewind: for
    a non-finite step, the samples that are not finite on their own when there are such (a
    bad record is one sample), else the whole step (a spike, or a fault no sample makes
    alone). A non-finite loss at the first step after a restore marks that checkpoint bad
    instead (the rewind then takes the one before it, leaving no data out): if the data was at
    fault after all, the fault comes back at a later step of the retrained stretch, which
    leaves it out.
    A fault at a step where ``max_rewinds`` rewinds already left samples out stops the run:
    leaving data out did not help."""
    records = []
    action = "skip"
    for f in faults:
        act = policy[f.cause]
        positions = positions_of(f.step - 1)
        records.append({"step": f.step, "cause": f.cause, "loss": _number(f.loss),
                        "grad_norm": _number(f.grad_norm), "action": act,
                        "positions": as_ranges(positions),
                        "rows": rows_of(positions).tolist()})
        action = max(action, act, key=SEVERITY.index)
    said = "; ".join(f"step {f.step}: {f.cause} (loss {f.loss:.4g}, grad norm "
                     f"{f.grad_norm:.4g})" for f in faults)
    for r in records:
        if action == "rewind" and r["action"] == "rewind" and r["cause"] == "nonfinite":
            culprits = culprits_of(r["step"])
            if culprits is not None and len(culprits):
                r["culprits"] = as_ranges(culprits)
        at_fault = (np.concatenate([np.arange(a, b) for a, b in r["culprits"]])
                    if "culprits" in r else None)
        documents = documents_of(rows_of(at_fault) if at_fault is not None
                                 else np.asarray(r["rows"]))
        if documents is not None:
            r["documents"] = documents[:DOCUMENTS_LISTED]
            r["documents_total"] = len(documents)
    return _decide(records, action, said, manifest=manifest, max_rewinds=max_rewinds,
                   resumed=resumed)


# The documents a fault record lists (a step of 512 blocks of 2,048 tokens holds thousands).
DOCUMENTS_LISTED = 32


def _decide(records: list[dict[str, Any]], action: str, said: str, *,
            manifest: dict[str, Any], max_rewinds: int, resumed: tuple[str, int] | None
            ) -> Decision:
    """:func:`decide` once the records are made."""
    if action == "stop":
        keys = " and ".join(f"train.on_{c}=stop" for c in sorted(
            {r["cause"] for r in records if r["action"] == "stop"}))
        return Decision("stop", records, message=(
            f"numerical fault ({keys}): {said}; no update of it reached the weights"))
    if action == "skip":
        return Decision("skip", records)
    rewound = [r for r in records if r["action"] == "rewind"]
    first = rewound[0]
    new = {**manifest, "faults": list(manifest["faults"]),
           "bad_checkpoints": list(manifest["bad_checkpoints"]),
           "ranges": [list(r) for r in manifest["ranges"]]}
    if (resumed is not None and first["step"] == resumed[1] + 1
            and first["cause"] == "nonfinite" and resumed[0] not in new["bad_checkpoints"]):
        last = manifest["faults"][-1] if manifest["faults"] else None
        if last is not None and last.get("bad_checkpoint"):
            # The checkpoint before the one marked bad fails at once too: the fault follows
            # the run, not a checkpoint. Marking on would mark every kept checkpoint bad and
            # send the run back to step 0, where its new checkpoints replace the good ones.
            return Decision("stop", records, message=(
                f"{said}: at the first step after restoring {resumed[0]}, as after "
                f"{last['bad_checkpoint']} before it: not a bad checkpoint but the run's "
                f"device or settings (a loss that is not finite at every step); stopped with "
                f"{resumed[0]} kept"))
        new["bad_checkpoints"].append(resumed[0])
        new["faults"].append({**first, "left_out": [], "bad_checkpoint": resumed[0]})
        return Decision("rewind", records, new, message=(
            f"{said}: at the first step after restoring {resumed[0]}, which is marked bad; "
            f"the run goes back to the checkpoint before it"))
    before = sum(1 for r in manifest["faults"] if r["step"] == first["step"] and r["left_out"])
    if before >= max_rewinds:
        return Decision("stop", records, message=(
            f"numerical fault at step {first['step']} again after {before} rewinds left its "
            f"samples out (train.max_rewinds={max_rewinds}): not in the data; {said}"))
    for r in rewound:
        left_out = r.get("culprits", r["positions"])
        new["faults"].append({**r, "left_out": left_out})
        new["ranges"].extend(left_out)
    new["ranges"] = Skips(new["ranges"]).ranges
    left = [f"{a}-{b - 1}" for r in new["faults"][len(manifest["faults"]):]
            for a, b in r["left_out"]]
    return Decision("rewind", records, new, message=(
        f"{said}: the run goes back to its latest checkpoint and leaves out sample positions "
        f"{', '.join(left)}"))


# Below this spread (the standard deviation of the logits over the vocabulary) a model
# predicts every token alike. A head of zeros gives exactly 0 and equal rows give 0 up to
# rounding; a randomly initialized tiny model gives about 0.16, a trained one several units.
UNIFORM_SPREAD = 1e-4


def first_prediction_check(spread: float, *, model_path: str) -> None:
    """A pretrained model whose logits do not vary over the vocabulary (``spread``, from
    :func:`raylm.model.assemble.logit_spread` on the run's first batch) predicts every token
    alike: its weights did not load. Decided from the logits, not from the loss: a randomly
    initialized model's first loss can land on ln(vocab) by chance when few targets are
    trained, though its predictions differ from token to token."""
    if spread <= UNIFORM_SPREAD:
        raise Mistake(
            f"model.path={model_path}: the model predicts every token alike (its logits vary "
            f"by {spread:.2g} over the vocabulary on the first batch): its weights did not "
            f"load (its output head, its final norm or its weights are all zero or unset). "
            f"Check that the directory's weight files are the model's own.")
