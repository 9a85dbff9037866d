"""A Ray head of a test's own, started with `ray start --head` (the job and tour tests), and
stopped without touching any other."""

from __future__ import annotations

import os
import subprocess
import time


def wait_for_job_server(address: str, started: subprocess.Popen, timeout_s: float = 90) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"{address}/api/version", timeout=2).close()
            return
        except urllib.error.HTTPError:  # it answers (refusing an unauthenticated request)
            return
        except OSError as e:
            if started.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the test's Ray head did not answer at {address} "
                                   f"(ray start exited {started.poll()}): {e}") from None
            time.sleep(0.5)


def stop_own_head(started: subprocess.Popen, temp: str) -> None:
    """This head's processes only: its process group, then whatever still runs from its
    session directory (workers Ray started in groups of their own)."""
    import shutil
    import signal

    import psutil

    # Killed at once: the head is the test's own and nothing of it is kept. (`ray start
    # --block` answers SIGTERM by stopping its processes one by one, which took the whole
    # 30 s it was given here.)
    os.killpg(started.pid, signal.SIGKILL)
    started.wait(timeout=30)
    for p in psutil.process_iter(["cmdline"]):
        if any(temp in part for part in p.info["cmdline"] or ()):
            p.kill()
    shutil.rmtree(temp, ignore_errors=True)
