"""Idle Redis connections per server (``NodePool``), shared by the tier's worker threads.

A connection is taken for one exchange and given back after it; one that failed in any way
is closed, never reused (kvtier.tiers.redis_wire says why).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvtier.tiers.redis_resp import ConnOptions, NodeAddr
from kvtier.tiers.redis_wire import Conn


class NodePool:
    """Idle connections to one server, at most ``max_idle`` kept; thread-safe."""

    __slots__ = ("_closed", "_idle", "_lock", "addr", "max_idle", "opts")

    def __init__(self, addr: NodeAddr, opts: ConnOptions, max_idle: int) -> None:
        self.addr = addr
        self.opts = opts
        self.max_idle = max(1, max_idle)
        self._idle: list[Conn] = []
        self._lock = threading.Lock()
        self._closed = False

    def run(self, fn: Callable[[Conn], Any]) -> Any:
        """Run ``fn`` on a pooled connection (blocking); a failed connection is discarded."""
        conn = self.take()
        try:
            result = fn(conn)
        except BaseException:
            conn.close()
            raise
        self.give(conn)
        return result

    def take(self) -> Conn:
        """An idle connection, or a new one (blocking connect): the caller's until ``give``
        (or closed by the caller when anything failed on it)."""
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        return Conn(self.addr, self.opts) if conn is None else conn

    def give(self, conn: Conn) -> None:
        """Take back a connection whose exchange ended cleanly."""
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
