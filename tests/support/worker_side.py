"""Helpers for tests that drive the connector's worker side directly."""

from __future__ import annotations

import time
from typing import Any

WAIT_S = 30.0


def finished(w: Any, req: str, wait_s: float = WAIT_S) -> None:
    """Report ``req`` finished to ``w`` (a ``WorkerSide``) and wait until the worker lets
    vLLM free its pages."""
    sending, _ = w.get_finished({req})
    deadline = time.monotonic() + wait_s
    while req not in sending:
        assert time.monotonic() < deadline, f"{req} never reported in finished_sending"
        time.sleep(0.005)
        sending, _ = w.get_finished(set())
