"""What the driver's console shows of the lines Ray forwards from other processes."""

from __future__ import annotations

import io

from raylm.console import HARMLESS, _TidyStream, tidy_line

HARMLESS_LINE = (
    "(TrainController pid=5648) [2026-11-25 06:01:02,345 E 5648 5701] core_worker.cc:2465: "
    "Actor 'PreemptionWatcher' has constructor arguments in the object store and "
    "max_restarts > 0. If the arguments in the object store go out of scope or are lost, "
    "the actor restart will fail. See https://github.com/ray-project/ray/issues/53727 for "
    "more details.")


def test_raylm_lines_lose_rays_prefix_and_known_harmless_lines_are_dropped():
    assert tidy_line("(TrainController pid=5648) step 10/200  loss 5.1234  lr 1.00e-03") == (
        "step 10/200  loss 5.1234  lr 1.00e-03")
    assert tidy_line("\x1b[36m(TrainController pid=5648, ip=10.0.0.5)\x1b[0m raylm: restart "
                     "2 -> 1 workers") == "raylm: restart 2 -> 1 workers"
    assert tidy_line(HARMLESS_LINE) is None
    # Every few seconds of a run on a head without the dashboard.
    assert tidy_line("(PlacementGroupCleaner pid=3135) Failed to query Ray Train Controller "
                     "actor state. State API may be temporarily unavailable. Continuing to "
                     "monitor.") is None
    # Everything else is shown as Ray wrote it: a worker's error, a user's print.
    error = "(RayTrainWorker pid=7) Traceback (most recent call last):"
    assert tidy_line(error) == error
    assert tidy_line("step 3 of my own loop") == "step 3 of my own loop"
    # The harmless list says why for each line it drops.
    assert all(len(why) > 40 for _, why in HARMLESS)


def test_the_stream_rewrites_whole_lines_and_passes_a_bars_updates_at_once():
    out = io.StringIO()
    stream = _TidyStream(out)
    # Ray's print: the message, then the newline, in two writes.
    stream.write("(TrainController pid=1) raylm: checkpoint saved")
    assert out.getvalue() == ""
    stream.write("\n")
    stream.write(HARMLESS_LINE)
    stream.write("\n")
    stream.write("\rtraining:  40%|####      | 4/10")
    assert out.getvalue() == "raylm: checkpoint saved\n\rtraining:  40%|####      | 4/10"


def test_the_token_notice_is_left_out_and_the_warning_that_auth_is_off_is_not(caplog):
    import logging

    from raylm.console import tidy_driver_console

    tidy_driver_console()
    tidy_driver_console()  # once is enough, twice does no harm
    notices = logging.getLogger("ray._private.authentication.authentication_token_setup")
    with caplog.at_level(logging.WARNING, logger=notices.name):
        notices.warning("Token authentication is enabled for this Ray cluster. Set ...")
        notices.warning("Token authentication is disabled for this Ray cluster. Anyone ...")
    assert [r.getMessage()[:40] for r in caplog.records] == [
        "Token authentication is disabled for thi"]
