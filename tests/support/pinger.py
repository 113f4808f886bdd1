"""A control-socket client in another process that pings in a loop: the victim whose
latency the bounded-work tests measure while a big or slow client works the daemon."""

from __future__ import annotations

import time
from typing import Any

from kvtier.client import connect


def ping_forever(path: str, stop: Any, out: Any) -> None:
    """Ping the daemon at ``path`` until ``stop`` is set, then send ``out`` the samples:
    (sent at, latency), on CLOCK_MONOTONIC (``time.perf_counter``): comparable across
    processes. Run it in a spawned process (no GIL shared with the test's sender)."""
    samples = []
    with connect(path) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.ping()
            samples.append((t0, time.perf_counter() - t0))
            time.sleep(0.002)
    out.send(samples)
