"""Redis connections per server (``NodePool``), shared by the tier's worker threads.

A connection is taken for one exchange and given back after it; one that failed in any way
is discarded (closed, never reused: kvtier.tiers.redis_wire says why), and so is one given
back with bytes still buffered past its replies (a server out of step, an extra reply,
would have its next exchange take those bytes for its own replies), one that read another
key's frame, and one left in the middle of a value it refused. ``limit`` bounds the
connections one server gets from the reads that fan out (kvtier.tiers.redis_mux asks with
``try_take`` for every pipeline after its first); one exchange per worker thread (``take``)
always gets a connection, as before, so a busy read never starves a write or a health PING.
At most ``limit`` idle connections are kept.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvtier.tiers.redis_resp import ConnOptions, NodeAddr
from kvtier.tiers.redis_wire import Conn


class NodePool:
    """Connections to one server: counted, at most ``limit`` idle kept; thread-safe."""

    __slots__ = ("_closed", "_idle", "_lock", "addr", "limit", "on_stray", "open", "opts")

    def __init__(self, addr: NodeAddr, opts: ConnOptions, limit: int,
                 on_stray: Callable[[NodeAddr, bool], None] | None = None) -> None:
        self.addr = addr
        self.opts = opts
        self.limit = max(1, limit)
        self.on_stray = on_stray      # told of each connection dropped out of step (give)
                                      # and whether it held bytes past its replies
        self.open = 0                 # connections made and not yet closed (idle or taken)
        self._idle: list[Conn] = []
        self._lock = threading.Lock()
        self._closed = False

    def run(self, fn: Callable[[Conn], Any]) -> Any:
        """Run ``fn`` on a pooled connection (blocking); a failed connection is discarded."""
        conn = self.take()
        try:
            result = fn(conn)
        except BaseException:
            self.discard(conn)
            raise
        self.give(conn)
        return result

    def take(self) -> Conn:
        """An idle connection, or a new one (blocking connect) whatever ``limit`` says: the
        caller's until ``give`` or ``discard``."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.open += 1
        return self._connect()

    def take_idle(self) -> Conn | None:
        """An idle connection, or None: never connects (for callers on the event loop)."""
        with self._lock:
            return self._idle.pop() if self._idle else None

    def try_take(self) -> Conn | None:
        """An idle connection, or a new one while fewer than ``limit`` are open; else None
        (the server's share of connections is in use: make do with those already held)."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
            if self.open >= self.limit:
                return None
            self.open += 1
        return self._connect()

    def _connect(self) -> Conn:
        try:
            return Conn(self.addr, self.opts)
        except BaseException:
            with self._lock:
                self.open -= 1
            raise

    def give(self, conn: Conn) -> None:
        """Take back a connection whose exchange ended cleanly. One that still holds
        received bytes (more than its replies, ``Conn.out_of_step``), or read another
        key's frame for a GET (``Conn.stray_frame``), is discarded and reported to
        ``on_stray`` instead: reused, its next exchange could read them as its own
        replies. ``on_stray`` is told whether bytes past the replies came (the server's
        fault) or not (found by review: a value copied under another key by another
        writer, on a sound server, was logged as the server sending too much). One left
        mid-reply (``Conn.mid_reply``: a planted value refused unread) is closed."""
        if conn.mid_reply:
            self.discard(conn)
            return
        extra = conn.out_of_step or conn.buffered() > 0
        if extra or conn.stray_frame:
            extra = extra or conn.stale()   # (a peek, on this rare path only)
            self.discard(conn)
            if self.on_stray is not None:
                self.on_stray(self.addr, extra)
            return
        with self._lock:
            if not self._closed and len(self._idle) < self.limit:
                self._idle.append(conn)
                return
            self.open -= 1
        conn.close()

    def discard(self, conn: Conn) -> None:
        """Close a connection that failed (or is mid-reply): it is never reused."""
        with self._lock:
            self.open -= 1
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self.open -= len(idle)
        for conn in idle:
            conn.close()
