"""The daemon's assembly in-process (``Daemon`` with small tiers, no subprocess): what a
start sets up is released by the stop, and the teardown steps keep their rules (found by
a mutation review)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.config import Config, load_config
from kvtier.daemon import service
from kvtier.daemon.service import Daemon, Deadline


def small_config(tmp_path: Path, **extra: object) -> Config:
    return load_config(env={}, overrides={
        "daemon.data_dir": tmp_path / "data", "daemon.socket": tmp_path / "kvtier.sock",
        "http.port": 0, "cpu.bytes": "16MiB", "cpu.prefault": False, "nvme.bytes": "16MiB",
        "cpu.warm_restart": False, **extra})


def _sweeps() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks()
            if getattr(t.get_coro(), "__qualname__", "") == "Daemon._sweep"]


async def test_the_stop_releases_the_guards_timers_sweeper_and_presence_filter(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each part a start makes is undone by the stop: the GC guard unfreezes and leaves
    the collector, the loop-lag timer and the lease sweeper stop, the presence filter's
    file goes. The control server gets the connections the open-file limit fits, and
    without a Redis tier the filter's "no" is final (``exact``)."""
    monkeypatch.setattr(service, "connections_that_fit", lambda cfg: 9)
    d = Daemon(small_config(tmp_path, **{"nvme.enabled": False}))
    try:
        await d.start()
        assert d.gc is not None and d.gc._after in gc.callbacks and gc.get_freeze_count() > 0
        assert d.loop_lag is not None and d.loop_lag._handle is not None
        assert len(_sweeps()) == 1
        assert d.arena is not None and d.control is not None
        presence = Path(f"{d.arena.path}.presence")
        assert presence.exists()
        assert d.control.greeter.presence is not None
        assert d.control.greeter.presence[0]["exact"] is True
        assert d.control.limits.max_connections == 9
        assert d.http is not None and d.http.prefix is d.control.prefix   # POST /v1/prefix
        assert d.control.stats_provider()["daemon"]["pid"] == os.getpid()  # the whole stats
        assert d.metrics is not None
        await asyncio.sleep(0.12)   # a few loop-lag ticks reach the histogram
        count = d.metrics.registry.get_sample_value("kvtier_event_loop_lag_seconds_count")
        assert count is not None and count >= 1
        guard, lag = d.gc, d.loop_lag
    finally:
        await d.stop()
    await asyncio.sleep(0)
    assert guard._after not in gc.callbacks and gc.get_freeze_count() == 0
    assert lag._handle is None
    assert _sweeps() == []
    assert not presence.exists()


async def test_quiet_for_counts_from_the_latest_request_of_either_server(
        tmp_path: Path) -> None:
    """A request on the control socket or on POST /v1/prefix ends the quiet: the full
    collection waited for the older one and stopped the loop under the newer one."""
    d = Daemon(small_config(tmp_path, **{"nvme.enabled": False}))
    try:
        await d.start()
        assert d.control is not None and d.http is not None
        now = time.monotonic()
        d.control.last_request, d.http.last_request = now - 100.0, now
        assert d._quiet_for() < 50.0
        d.control.last_request, d.http.last_request = now, now - 100.0
        assert d._quiet_for() < 50.0
    finally:
        await d.stop()


async def test_no_nvme_directory_is_made_when_nvme_holds_nothing(
        tmp_path: Path) -> None:
    """``nvme.enabled = true`` with ``nvme.bytes = 0`` is no nvme tier: its directory is
    neither checked nor made (a path there the daemon cannot write refused the start)."""
    cfg = small_config(tmp_path, **{"nvme.enabled": True, "nvme.bytes": "0",
                                    "nvme.path": tmp_path / "nvme"})
    assert cfg.nvme.enabled
    d = Daemon(cfg)
    try:
        await d.start()
        assert d.nvme is None
    finally:
        await d.stop()
    assert not (tmp_path / "nvme").exists()


class _Store:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def expire_leases(self) -> int:
        self.calls.append("expire")
        return 1

    def retry_orphans(self) -> None:
        self.calls.append("orphans")

    async def drain(self, deadline: float) -> int:
        self.calls.append("drain")
        return 0


async def test_each_sweep_expires_leases_and_retries_orphans(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every ``daemon.lease_sweep_s``: expired leases are taken back (and one is logged:
    a client hung or crashed) and the orphans' erases retried."""
    d = Daemon(small_config(tmp_path, **{"daemon.lease_sweep_s": "0.01"}))
    store = _Store()
    with caplog.at_level(logging.WARNING, logger="kvtier.daemon"):
        task = asyncio.ensure_future(d._sweep(store))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        task.cancel()
    assert store.calls[:2] == ["expire", "orphans"]
    assert "expired 1 leases" in caplog.text


async def test_a_daemon_that_never_recovered_has_no_drain(tmp_path: Path) -> None:
    """A start refused before the store recovered (the nvme lock, say) drains nothing:
    the store holds nothing, and its drain would run over half-made tiers."""
    d = Daemon(small_config(tmp_path))
    store = _Store()
    await d._drain_store(store)  # type: ignore[arg-type]
    assert store.calls == []
    d._recovered = True
    await d._drain_store(store)  # type: ignore[arg-type]
    assert store.calls == ["drain"]


class _Arena:
    def __init__(self, adopted: bool) -> None:
        self.adopted = adopted
        self.unlinked: list[bool] = []

    def close(self, unlink: bool) -> None:
        self.unlinked.append(unlink)


@pytest.mark.parametrize(("adopted", "recovered", "unlink"), [
    (True, False, False), (True, True, True), (False, False, True)])
def test_an_adopted_arena_survives_a_start_refused_before_its_recovery(
        tmp_path: Path, adopted: bool, recovered: bool, unlink: bool) -> None:
    """The arena a crashed daemon left is kept for the next start unless this one
    recovered it (a cold start erased the nvme frames behind its cpu heads)."""
    d = Daemon(small_config(tmp_path))
    arena = _Arena(adopted)
    d.arena = arena  # type: ignore[assignment]
    d._recovered = recovered
    d._close_arena()
    assert arena.unlinked == [unlink]


class _Redis:
    def __init__(self, takes: float, fails: bool = False) -> None:
        self.takes, self.fails = takes, fails
        self.flushed: list[float] = []

    async def close(self, timeout: float) -> None:
        await asyncio.sleep(self.takes)
        if self.fails:
            raise ConnectionError("redis went away")
        self.flushed.append(timeout)


async def test_the_redis_flush_gets_what_is_left_of_the_deadline(tmp_path: Path) -> None:
    """The flush of queued writes may take what is left of the drain's deadline (plus a
    moment), and a dead Redis never fails the stop."""
    d = Daemon(small_config(tmp_path))
    d._deadline = Deadline(time.monotonic() + 1.0)
    slow = _Redis(takes=0.6)
    await d._close_redis(slow)
    assert len(slow.flushed) == 1 and 0.5 < slow.flushed[0] <= 1.0
    await d._close_redis(_Redis(takes=0.0, fails=True))   # logged, not raised


class _Control:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    async def stop_accepting(self) -> None:
        self.calls.append(("stop_accepting", 0.0))

    async def close_connections(self, timeout: float) -> None:
        self.calls.append(("close_connections", timeout))


async def test_the_control_socket_gets_half_the_deadline_for_its_requests(
        tmp_path: Path) -> None:
    """In-flight requests and clients holding leases get half of what is left of the
    drain's deadline (the store's drain the rest) before their connections go."""
    d = Daemon(small_config(tmp_path))
    d._deadline = Deadline(time.monotonic() + 10.0)
    control = _Control()
    await d._close_control(control)  # type: ignore[arg-type]
    assert [c for c, _ in control.calls] == ["stop_accepting", "close_connections"]
    assert 4.5 < control.calls[1][1] <= 5.0


async def test_stop_signals_ask_for_the_stop_and_are_handed_back_after(
        tmp_path: Path) -> None:
    """SIGTERM, SIGINT and SIGHUP request the one graceful stop while the daemon lives;
    afterwards the loop's handlers are gone (a later daemon in the process installs its
    own)."""
    loop = asyncio.get_running_loop()
    d = Daemon(small_config(tmp_path))
    with service.catch_stop_signals(d):
        signal.raise_signal(signal.SIGHUP)
        await asyncio.wait_for(d.serve_until_signal(), 5)
    for sig in service.STOP_SIGNALS:
        assert loop.remove_signal_handler(sig) is False


class _Refused(Exception):
    """Ends a start at the arena: what it was asked is all the test needs."""


@pytest.mark.parametrize(("journal_run", "adopt"), [
    (b"last", True), (b"older", False), (None, False)])
async def test_only_an_arena_of_the_last_run_is_adopted(
        tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch,
        journal_run: bytes | None, adopt: bool) -> None:
    """An arena whose journal names an earlier run (a start in between went on without
    it) is made anew, never attached: its stale bytes and the clients still mapping it
    go with it."""
    asked: list[bool] = []

    def arena(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs["adopt"])
        raise _Refused

    journal = None if journal_run is None else SimpleNamespace(run=journal_run)
    monkeypatch.setattr(service, "read_journal", lambda path: journal)
    monkeypatch.setattr(service, "last_run", lambda data_dir: b"last")
    monkeypatch.setattr(service, "Arena", arena)
    d = Daemon(small_config(tmp_path, **{"cpu.warm_restart": True, "cpu.shm_dir": shm_dir,
                                          "nvme.enabled": False}))
    try:
        with pytest.raises(_Refused):
            await d.start()
    finally:
        await d.stop()
    assert asked == [adopt]
