"""The driver's progress bar, fed as the controller's record feeds it."""

from __future__ import annotations

import io

from raylm.contracts.report import Report
from raylm.run.progress import Bar, use_bar


def report(step, loss, *, val=None, resumed=None) -> Report:
    return Report(step=step, group_started=1.0, workers=1, loss=loss, tokens_per_s=12345.6,
                  resumed_from_step=resumed, figures={} if val is None else {"val_loss": val})


def test_the_bar_follows_reports_and_moves_back_after_a_restart():
    out = io.StringIO()
    bar = Bar(30, file=out)
    bar.update(report(5, 5.5))
    bar.update(report(10, 5.1, val=5.2))
    bar.update(report(15, 4.9))
    assert bar.bar.n == 15
    text = out.getvalue()
    assert "15/30" in text and "loss=4.9000" in text and "val=5.2000" in text
    assert "12,346" in text
    bar.update(report(10, 5.0))  # a restarted group resumes from its step-10 checkpoint
    assert bar.bar.n == 10
    bar.update(report(30, 4.1, val=4.3))
    bar.close()
    assert "30/30" in out.getvalue()


def test_a_resumed_run_starts_its_bar_at_the_resumed_step():
    out = io.StringIO()
    bar = Bar(30, file=out)
    bar.update(report(25, 4.2, resumed=20))
    assert bar.bar.n == 25
    bar.close()


def test_bars_in_terminals_and_notebooks_lines_in_logs():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert use_bar("auto", Tty()) is True
    assert use_bar("auto", io.StringIO()) is False  # CI, ray job logs, a file
    assert use_bar("bar", io.StringIO()) is True
    assert use_bar("lines", Tty()) is False
