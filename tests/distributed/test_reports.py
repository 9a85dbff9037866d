"""The step vote that keeps reports off the training thread (raylm.workers.preemption.Vote):
one rank whose last report waits for the controller makes every rank hold its report back,
at the same step, so all ranks keep reporting in step (Ray Train joins the ranks' reports by
their order). No Ray."""

from __future__ import annotations

import os

import torch

from tests.ranks import free_port, run_ranks

# Per call: which rank's queue is busy.
BUSY = [set(), {1}, {0}, {0, 1}, set()]


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from raylm.workers.preemption import Vote

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    vote = Vote(torch.device("cpu"))
    seen = []
    for i, busy in enumerate(BUSY):
        verdict = vote(busy=rank in busy)
        seen.append((verdict.cause, verdict.busy))
        if i == 0:
            vote.reported()  # a report after the first vote: its flags were taken before it
    torch.save(seen, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


def test_one_busy_rank_holds_every_ranks_report(tmp_path):
    run_ranks(_rank, args=(free_port(), str(tmp_path)), world=2)
    seen = [torch.load(tmp_path / f"{r}.pt") for r in (0, 1)]
    assert seen[0] == seen[1]
    assert seen[0] == [(None, False), (None, True), (None, True), (None, True), (None, False)]


def test_flags_taken_before_the_last_report_count_as_busy():
    """A GPU reads a step's flags one step late: flags taken before the last report cannot
    say that report was taken."""
    from raylm.workers.preemption import Vote

    vote = Vote(torch.device("cpu"))
    assert vote(busy=False).busy is False
    vote.reported()
    assert vote._verdict([0, 0, 0], taken_at=vote.calls).busy is True
    assert vote._verdict([0, 0, 0], taken_at=vote.calls + 1).busy is False
    assert vote._verdict([1, 0, 1], taken_at=vote.calls + 1).cause == "SIGTERM"
