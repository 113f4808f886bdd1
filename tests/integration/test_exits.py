"""ExitWatcher: a callback once a process has exited, by pidfd, by polling, or after a
grace period for a pid the daemon cannot know."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from functools import partial

import pytest

from kvtier.daemon import exits
from kvtier.daemon.exits import ExitWatcher


def _child() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)


async def _exits_fire_after_the_process(watcher: ExitWatcher) -> None:
    child = _child()
    fired = asyncio.Event()
    watcher.watch(child.pid, fired.set)
    await asyncio.sleep(0.2)
    assert not fired.is_set() and len(watcher) == 1   # alive: nothing yet
    assert child.stdin is not None
    child.stdin.close()
    await asyncio.wait_for(fired.wait(), 10)   # exited (a zombie until reaped: gone too)
    assert len(watcher) == 0
    child.wait()


def test_a_pidfd_says_when_the_process_exits() -> None:
    asyncio.run(_exits_fire_after_the_process(ExitWatcher(3600)))


def test_without_pidfd_the_pid_is_polled(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pidfd(pid: int) -> int:
        raise OSError("no pidfd here")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    monkeypatch.setattr(exits, "POLL_S", 0.05)
    asyncio.run(_exits_fire_after_the_process(ExitWatcher(3600)))


def test_a_gone_pid_fires_at_once_and_an_unknown_one_after_the_grace() -> None:
    async def run() -> None:
        child = _child()
        assert child.stdin is not None
        child.stdin.close()
        child.wait()   # reaped: the pid is gone
        loop = asyncio.get_running_loop()
        fired: list[str] = []
        fired_at: list[float] = []
        watcher = ExitWatcher(0.1)
        watcher.watch(child.pid, lambda: fired.append("gone"))
        assert fired == ["gone"]

        def unknown_over() -> None:
            fired.append("unknown")
            fired_at.append(loop.time())

        watched_at = loop.time()
        watcher.watch(0, unknown_over)
        # not at once, and not before the grace: measured on the loop's clock, not by a
        # short sleep (a process stalled past the 0.1 s grace during asyncio.sleep(0.02)
        # woke with the grace timer due in the same loop pass, run before the sleeper)
        assert fired == ["gone"]
        await asyncio.sleep(0.2)
        assert fired == ["gone", "unknown"]
        assert fired_at[0] - watched_at >= 0.1 - 0.005, fired_at[0] - watched_at
        watcher.watch(0, lambda: fired.append("never"))
        watcher.close()   # the daemon stops: nothing more is called
        await asyncio.sleep(0.2)
        assert fired == ["gone", "unknown"]

    asyncio.run(run())


def test_many_callbacks_on_one_process_share_one_watch() -> None:
    """A process dropped again and again while it held put slots: one pidfd, not one per
    drop, which ran the daemon out of descriptors (found by review)."""
    async def run() -> None:
        child = _child()
        fds = len(os.listdir("/proc/self/fd"))
        watcher = ExitWatcher(3600)
        fired: list[int] = []
        for i in range(200):
            watcher.watch(child.pid, partial(fired.append, i))
        assert watcher.watches == 1 and len(watcher) == 200
        assert len(os.listdir("/proc/self/fd")) <= fds + 1
        assert child.stdin is not None
        child.stdin.close()
        for _ in range(200):
            if fired:
                break
            await asyncio.sleep(0.05)
        assert fired == list(range(200))   # each once, in the order they came
        assert watcher.watches == 0 and len(watcher) == 0
        child.wait()
        watcher.watch(child.pid, lambda: fired.append(-1))   # reaped: at once
        assert fired[-1] == -1 and watcher.watches == 0

    asyncio.run(run())
