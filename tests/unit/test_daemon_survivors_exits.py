"""``ExitWatcher`` without child processes: a pid that cannot exist, this process (alive),
pids the daemon cannot know, and ``_gone``'s reading of a process's state (found by a
mutation review: only integration tests, which start processes, covered it)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kvtier.daemon import exits
from kvtier.daemon.exits import ExitWatcher, _gone

NO_SUCH_PID = 2**22 + 5   # above any pid_max Linux allows (2**22)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_this_process_is_not_gone_and_a_pid_beyond_pid_max_is() -> None:
    """A live process (state R or S) reads as running; a zombie check that misread the
    state would let a dropped client's quarantined slots go while it still writes."""
    assert _gone(os.getpid()) is False
    assert _gone(NO_SUCH_PID) is True


def test_a_pid_of_someone_else_is_gone_and_an_unreadable_state_is_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """EPERM: the pid was reused by another user's process (ours exited); a state that
    cannot be read proves nothing, so the process is taken as still there."""
    def eperm(pid: int, sig: int) -> None:
        raise PermissionError(1, "not yours")

    with monkeypatch.context() as m:
        m.setattr(os, "kill", eperm)
        assert _gone(os.getpid()) is True

    def unreadable(path: str, mode: str = "r") -> None:
        raise OSError(13, "no /proc here")

    monkeypatch.setattr(exits, "open", unreadable, raising=False)
    assert _gone(os.getpid()) is False


async def test_a_pid_already_gone_fires_at_once_and_holds_nothing() -> None:
    w = ExitWatcher(3600)
    fired: list[int] = []
    w.watch(NO_SUCH_PID, lambda: fired.append(1))
    assert fired == [1] and len(w) == 0 and w.watches == 0


async def test_one_descriptor_per_pid_however_many_callbacks_and_close_releases_it() -> None:
    """A second callback for a watched pid joins its watch (one pidfd per drop ran the
    daemon out of descriptors); ``close`` gives the descriptor back and calls nothing."""
    w = ExitWatcher(3600)
    fired: list[str] = []
    before = _open_fds()
    w.watch(os.getpid(), lambda: fired.append("a"))
    w.watch(os.getpid(), lambda: fired.append("b"))
    assert (len(w), w.watches) == (2, 1)
    assert _open_fds() == before + 1
    w.close()
    assert (len(w), w.watches) == (0, 0) and _open_fds() == before
    await asyncio.sleep(0.01)
    assert fired == []


async def test_an_exit_calls_every_callback_once_and_closes_the_descriptor() -> None:
    """What the pidfd's readiness runs: the descriptor closed, each waiting callback once,
    a second readiness ignored."""
    w = ExitWatcher(3600)
    fired: list[str] = []
    before = _open_fds()
    w.watch(os.getpid(), lambda: fired.append("a"))
    w.watch(os.getpid(), lambda: fired.append("b"))
    w._fire(os.getpid())
    assert fired == ["a", "b"] and _open_fds() == before
    assert (len(w), w.watches) == (0, 0)
    w._fire(os.getpid())
    assert fired == ["a", "b"]


async def test_an_unknown_pid_waits_out_its_grace_counted_and_close_cancels_it() -> None:
    """Pid 0 (a peer in another pid namespace) gets ``unknown_pid_s``: it counts as a
    waiting callback, fires after the grace, and a stopped watcher fires nothing."""
    w = ExitWatcher(0.02)
    fired: list[str] = []
    w.watch(0, lambda: fired.append("zero"))
    w.watch(-1, lambda: fired.append("minus"))
    assert len(w) == 2 and w.watches == 0 and fired == []
    await asyncio.sleep(0.1)
    assert sorted(fired) == ["minus", "zero"] and len(w) == 0
    w.watch(0, lambda: fired.append("late"))
    w.close()
    assert len(w) == 0
    await asyncio.sleep(0.1)
    assert "late" not in fired


async def test_without_pidfd_polling_stops_at_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """The poll path: checked every ``POLL_S`` until gone; ``close`` cancels its timer."""
    def no_pidfd(pid: int) -> int:
        raise OSError("no pidfd")

    checks: list[int] = []

    def alive(pid: int) -> bool:
        checks.append(pid)
        return False

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    monkeypatch.setattr(exits, "POLL_S", 0.01)
    monkeypatch.setattr(exits, "_gone", alive)
    w = ExitWatcher(3600)
    fired: list[int] = []
    w.watch(os.getpid(), lambda: fired.append(1))
    await asyncio.sleep(0.05)
    assert len(checks) >= 2 and w.watches == 1 and len(w) == 1
    w.close()
    n = len(checks)
    await asyncio.sleep(0.05)
    assert len(checks) == n and fired == []


def test_the_state_field_is_read_after_the_command_name(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A command name with ``) Z`` in it must not make a live process look a zombie."""
    stat = tmp_path / "stat"
    stat.write_bytes(b"123 (evil) Z x) S 1 2 3")
    real_open = open
    monkeypatch.setattr(exits, "open", lambda p, m="r": real_open(stat, m), raising=False)
    assert _gone(os.getpid()) is False
    stat.write_bytes(b"123 (python) Z 1 2 3")
    assert _gone(os.getpid()) is True
