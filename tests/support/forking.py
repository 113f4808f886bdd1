"""Run a check in a forked child of the test process."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable


def run_in_child(body: Callable[[], bool], seconds: float | None = None) -> int | None:
    """``body()`` in a forked child: its exit status (0: it returned True, 3: False, 1: it
    raised), or None when it was still running after ``seconds`` (it is killed then)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if body() else 3
        finally:
            os._exit(code)
    deadline = None if seconds is None else time.monotonic() + seconds
    while deadline is None or time.monotonic() < deadline:
        done, status = os.waitpid(pid, 0 if deadline is None else os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None
