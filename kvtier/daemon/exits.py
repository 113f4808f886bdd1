"""Watching client processes exit: the only proof that a dropped client stopped writing.

When the daemon closes a client's connection itself (idle, not reading its replies, a
broken limit), the client may still be writing into the arena slots it leased: it maps
the arena, and nothing told it to stop. Those slots stay quarantined until its process
exits (``kvtier.leases``). ``ExitWatcher`` calls back once a pid has exited: through a
pidfd (Linux 5.3+, readable once the process is gone), else by polling ``kill(pid, 0)``.
A pid the daemon does not know (0 or less: the peer lives in another pid namespace) is
given ``unknown_pid_s`` instead, after which its slots go back (bounded memory over an
unprovable stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable

log = logging.getLogger("kvtier.control")

POLL_S = 1.0   # how often a pid without a pidfd is checked


def _gone(pid: int) -> bool:
    """Whether ``pid`` no longer exists (a zombie counts as gone: it cannot write)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:   # someone else's process: ours exited, the pid was reused
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


class ExitWatcher:
    """Calls each ``on_exit`` once its process has exited (on the event loop).

    One watch per pid, however many callbacks wait on it: a process whose connections the
    daemon drops again and again while they hold put slots added one pidfd per drop, until
    the daemon ran out of descriptors and refused every new client (found by review)."""

    def __init__(self, unknown_pid_s: float) -> None:
        self.unknown_pid_s = unknown_pid_s
        self._waiting: dict[int, list[Callable[[], None]]] = {}   # pid -> its callbacks
        self._stops: dict[int, Callable[[], None]] = {}           # pid -> stop watching it
        self._unknown: dict[int, asyncio.TimerHandle] = {}       # token -> grace timer
        self._tokens = 0

    def __len__(self) -> int:
        """Callbacks still waiting."""
        return sum(map(len, self._waiting.values())) + len(self._unknown)

    @property
    def watches(self) -> int:
        """Processes watched (descriptors or poll timers held)."""
        return len(self._stops)

    def watch(self, pid: int, on_exit: Callable[[], None]) -> None:
        """Call ``on_exit`` once ``pid`` has exited (at once when it already has)."""
        loop = asyncio.get_running_loop()
        if pid <= 0:
            self._tokens += 1
            token = self._tokens

            def grace_over() -> None:
                if self._unknown.pop(token, None) is not None:
                    on_exit()

            self._unknown[token] = loop.call_later(self.unknown_pid_s, grace_over)
            return
        waiting = self._waiting.get(pid)
        if waiting is not None:   # already watched: one more callback on the same watch
            waiting.append(on_exit)
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            on_exit()
            return
        except (OSError, AttributeError):   # no pidfd here: poll
            self._waiting[pid] = [on_exit]
            self._poll(loop, pid)
            return

        def close_fd() -> None:
            loop.remove_reader(fd)
            os.close(fd)

        self._waiting[pid] = [on_exit]
        self._stops[pid] = close_fd
        loop.add_reader(fd, self._fire, pid)

    def _fire(self, pid: int) -> None:
        stop = self._stops.pop(pid, None)
        if stop is None:
            return
        stop()
        for on_exit in self._waiting.pop(pid, []):
            on_exit()

    def _poll(self, loop: asyncio.AbstractEventLoop, pid: int) -> None:
        handle: asyncio.TimerHandle | None = None

        def check() -> None:
            nonlocal handle
            if _gone(pid):
                self._fire(pid)
            else:
                handle = loop.call_later(POLL_S, check)

        def cancel() -> None:
            if handle is not None:
                handle.cancel()

        self._stops[pid] = cancel
        check()

    def close(self) -> None:
        """Stop watching (daemon stop): nothing more is called."""
        stops, self._stops = self._stops, {}
        self._waiting.clear()
        for stop in stops.values():
            with contextlib.suppress(Exception):
                stop()
        timers, self._unknown = self._unknown, {}
        for timer in timers.values():
            timer.cancel()
