"""Restarts and resizes: a log of what happened to a run's worker groups, and what it cost.

Ray Train's public hooks tell of reports and of worker exceptions, not of worker groups. So
``RUN_DIR/events.jsonl`` collects three kinds of record, each appended by the process that
sees it happen:

- ``group_start`` (workers, step it resumes from): raylm's ``DataConfig`` runs once per worker
  group, on the head node, when the group asks for its data;
- ``failure`` (ranks, error): the controller callback's ``after_exception``;
- ``progress`` (step, seconds per step): the controller callback, at every report.

:func:`interruptions` derives from them, as a pure function, one record per change of worker
group after the first: ``restart`` when the group before failed (a lost worker or node, a
preempted worker), ``resize`` when Ray Train replaced a healthy group by one of another size.
Each says from how many workers to how many, the last step reported before (``at_step``), the
step resumed from, the steps trained again (``at_step - resumed_from_step``), and the time
lost: wall time from the last report before the interruption to the first report after it,
less the time the steps beyond ``at_step`` took at the speed before (None if the group never
reported).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from raylm import storage

EVENTS = "events.jsonl"


def append(run_dir: str | os.PathLike, invocation: str, event: str, **fields: Any
           ) -> dict[str, Any]:
    """Append one record to ``RUN_DIR/events.jsonl`` (a path or URI)."""
    record = {"invocation": invocation, "event": event, "time": time.time(), **fields}
    storage.append_text(storage.join(str(run_dir), EVENTS), json.dumps(record) + "\n")
    return record


def read(run_dir: str | os.PathLike, invocation: str | None = None) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/events.jsonl`` (of one invocation, if given), in order."""
    path = storage.join(str(run_dir), EVENTS)
    if not storage.is_file(path):
        return []
    records = [json.loads(line) for line in storage.read_text(path).splitlines()
               if line.strip()]
    return [r for r in records if invocation is None or r["invocation"] == invocation]


def interruptions(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The restart and resize records of one invocation's events (see the module doc)."""
    out: list[dict[str, Any]] = []
    group = None  # the current group's start record
    last = None  # the last progress record of the current group
    step_time = 0.0
    failures: list[dict[str, Any]] = []
    pending = None  # an interruption waiting for the new group's first report
    for r in records:
        kind = r["event"]
        if kind == "failure":
            failures.append(r)
        elif kind == "group_start":
            if pending is not None:
                out.append(pending)
            pending = None
            if group is not None:
                at, since = ((last["step"], last["time"]) if last is not None
                             else (group["from_step"], group["time"]))
                pending = {
                    "event": "restart" if failures else "resize",
                    "from_workers": group["workers"],
                    "to_workers": r["workers"],
                    "at_step": at,
                    "resumed_from_step": r["from_step"],
                    "steps_redone": max(0, at - r["from_step"]),
                    "time_lost_s": None,
                    "failures": len(failures),
                    "cause": failures[-1]["error"] if failures else "resize",
                    "_since": since,
                    "_step_time": step_time,
                }
            group, last, failures = r, None, []
        elif kind == "progress":
            if pending is not None:
                beyond = max(0, r["step"] - pending["at_step"])
                lost = r["time"] - pending["_since"] - beyond * pending["_step_time"]
                pending["time_lost_s"] = round(max(0.0, lost), 2)
                out.append(pending)
                pending = None
            last, step_time = r, r["step_time"]
    if pending is not None:
        out.append(pending)
    return [{k: v for k, v in e.items() if not k.startswith("_")} for e in out]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary.json fields for one invocation's records."""
    inter = interruptions(records)
    return {
        "restarts": sum(e["event"] == "restart" for e in inter),
        "resizes": sum(e["from_workers"] != e["to_workers"] for e in inter),
        "failures": sum(r["event"] == "failure" for r in records),
        "interruptions": inter,
    }
