"""Warnings a peer can trigger at will, logged at most once per interval for each kind.

Another local user connecting in a loop, a Redis writer planting corrupt frames, a client
that breaks the protocol on every connection, or a dying disk can each cause one event per
request. Logged one line each, they fill the log (journald drops, files grow) and cost the
event loop a formatted line per event. Each kind here logs its first event, then at most
one line per ``every_s`` that also says how many were left out since; the counters that
the metrics export still count every event.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["LogRate"]


@dataclass(slots=True)
class _Kind:
    last: float          # when this kind was last logged (the clock's time)
    left_out: int = 0    # events of this kind since then, not logged


class LogRate:
    """``warning(kind, msg, *args)``: ``logger.warning`` unless ``kind`` was logged less than
    ``every_s`` ago. Thread-safe (the Redis tier reports from its I/O threads). Kinds are
    the caller's fixed names, never a peer's value, so their number is bounded."""

    __slots__ = ("_clock", "_kinds", "_lock", "every_s", "logger")

    def __init__(self, logger: logging.Logger, every_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.every_s = every_s
        self._clock = clock
        self._kinds: dict[str, _Kind] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` as a warning if ``kind`` may log now; True when it was."""
        now = self._clock()
        with self._lock:
            seen = self._kinds.get(kind)
            if seen is not None and now - seen.last < self.every_s:
                seen.left_out += 1
                return False
            left_out, since = (seen.left_out, now - seen.last) if seen is not None else (0, 0.0)
            self._kinds[kind] = _Kind(now)
        if left_out:
            msg += " (and %d more like it in the last %.0f s, not logged)"
            args = (*args, left_out, since)
        self.logger.warning(msg, *args)
        return True
