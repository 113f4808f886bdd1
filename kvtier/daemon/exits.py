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
    """Calls ``on_exit`` once each watched process has exited (on the event loop)."""

    def __init__(self, unknown_pid_s: float) -> None:
        self.unknown_pid_s = unknown_pid_s
        self._closers: dict[int, Callable[[], None]] = {}   # token -> how to stop watching
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._closers)

    def watch(self, pid: int, on_exit: Callable[[], None]) -> None:
        """Call ``on_exit`` once ``pid`` has exited (at once when it already has)."""
        loop = asyncio.get_running_loop()
        self._tokens += 1
        token = self._tokens

        def fire() -> None:
            stop = self._closers.pop(token, None)
            if stop is None:
                return
            stop()
            on_exit()

        if pid <= 0:
            handle = loop.call_later(self.unknown_pid_s, fire)
            self._closers[token] = handle.cancel
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            on_exit()
            return
        except (OSError, AttributeError):   # no pidfd here: poll
            self._poll(loop, token, pid, fire)
            return

        def close_fd() -> None:
            loop.remove_reader(fd)
            os.close(fd)

        self._closers[token] = close_fd
        loop.add_reader(fd, fire)

    def _poll(self, loop: asyncio.AbstractEventLoop, token: int, pid: int,
              fire: Callable[[], None]) -> None:
        handle: asyncio.TimerHandle | None = None

        def check() -> None:
            nonlocal handle
            if _gone(pid):
                fire()
            else:
                handle = loop.call_later(POLL_S, check)

        def cancel() -> None:
            if handle is not None:
                handle.cancel()

        self._closers[token] = cancel
        check()

    def close(self) -> None:
        """Stop watching (daemon stop): nothing more is called."""
        closers, self._closers = self._closers, {}
        for stop in closers.values():
            with contextlib.suppress(Exception):
                stop()
