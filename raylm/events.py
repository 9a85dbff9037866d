"""Restarts and resizes, as the Ray Train controller sees them.

Ray Train's public controller callback tells of reports and of worker exceptions, not of
worker groups. Each worker group therefore makes one report when it is ready to train (how
many workers, the step it resumed from), and that report closes the interruption before it:

- ``restart``: the group before failed (a lost worker or node, a preempted worker) and this
  one resumed from the latest checkpoint;
- ``resize``: Ray Train replaced a healthy group by one of another size (an elastic run that
  found room to grow).

Each record says from how many workers to how many, the last step reported before
(``at_step``), the step resumed from, the steps to train again, and the time lost: wall time
from the last report before the interruption until the new group is ready, plus the time the
steps to train again took at the speed before.
"""

from __future__ import annotations

from typing import Any


class RunEvents:
    """The interruption records of one ``raylm train`` invocation (pure bookkeeping)."""

    def __init__(self, invocation: str) -> None:
        self.invocation = invocation
        self.group: dict[str, Any] | None = None
        self.last_step: int | None = None
        self.last_time: float | None = None
        self.step_time = 0.0
        self.failures: list[dict[str, Any]] = []
        self.records: list[dict[str, Any]] = []

    def _record(self, event: dict[str, Any]) -> dict[str, Any]:
        event = {"invocation": self.invocation, **event}
        self.records.append(event)
        return event

    def failure(self, *, ranks: list[int], error: str, now: float) -> dict[str, Any]:
        event = self._record({"event": "failure", "time": now, "ranks": ranks,
                              "error": error, "last_step": self.last_step})
        self.failures.append(event)
        return event

    def group_started(self, group: dict[str, Any], *, now: float) -> dict[str, Any]:
        """A worker group is ready to train (every group reports this once, first)."""
        if self.group is None and self.last_step is None:
            event = {"event": "start", "time": now, "workers": group["workers"],
                     "from_step": group["from_step"], "failures_before": len(self.failures)}
        else:
            at = self.last_step if self.last_step is not None else group["from_step"]
            redone = max(0, at - group["from_step"])
            idle = now - self.last_time if self.last_time is not None else 0.0
            event = {
                "event": "restart" if self.failures else "resize",
                "time": now,
                "from_workers": self.group["workers"] if self.group else None,
                "to_workers": group["workers"],
                "at_step": at,
                "resumed_from_step": group["from_step"],
                "steps_redone": redone,
                "time_lost_s": round(idle + redone * self.step_time, 2),
                "failures": len(self.failures),
                "cause": self.failures[-1]["error"] if self.failures else "resize",
            }
        self.group, self.failures = group, []
        self.last_step, self.last_time = group["from_step"], now
        return self._record(event)

    def report(self, metrics: dict[str, Any], *, now: float) -> None:
        """Account for rank 0's report of a training step."""
        step = int(metrics["step"])
        done = step - self.group["from_step"] if self.group else 0
        if done > 0:
            self.step_time = metrics["elapsed_s"] / done
        self.last_step, self.last_time = step, now

    def interruptions(self) -> list[dict[str, Any]]:
        return [e for e in self.records if e["event"] in ("restart", "resize")]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary.json fields for one invocation's records."""
    inter = [e for e in records if e["event"] in ("restart", "resize")]
    return {
        "restarts": sum(e["event"] == "restart" for e in inter),
        "resizes": sum(e["from_workers"] != e["to_workers"] for e in inter),
        "failures": sum(e["event"] == "failure" for e in records),
        "interruptions": [{k: v for k, v in e.items() if k not in ("invocation", "time")}
                          for e in inter],
    }
