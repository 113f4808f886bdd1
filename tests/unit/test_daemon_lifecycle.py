"""The daemon as components: tiers built by injected factories (``DaemonParts``), every
resource undone in reverse order by one exit stack, signal handlers removed at stop."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from pathlib import Path

import pytest

from kvtier.config import Config, load_config
from kvtier.daemon.parts import DaemonParts, make_nvme
from kvtier.daemon.service import Daemon, Deadline
from kvtier.errors import ConfigError
from kvtier.tiers.hbm_pool import DevicePool
from tests.support.fake_hbm import ShmDevicePool, fake_hbm_tier, fake_parts

MiB = 2**20


def small_config(tmp_path: Path, **extra: object) -> Config:
    return load_config(env={}, overrides={
        "daemon.data_dir": tmp_path / "data", "daemon.socket": tmp_path / "kvtier.sock",
        "http.port": 0, "cpu.bytes": "16MiB", "cpu.prefault": False, "nvme.bytes": "16MiB",
        "cpu.warm_restart": False, **extra})


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def test_the_fake_hbm_pool_is_injected_not_patched(tmp_path: Path) -> None:
    pools: list[DevicePool | None] = []

    def hbm(cfg: Config):  # the test factory, wrapped to see the pool it made
        tier = fake_hbm_tier(cfg)
        pools.append(tier._pool)
        return tier

    d = Daemon(small_config(tmp_path, **{"hbm.enabled": True, "hbm.bytes": "1MiB"}),
               parts=DaemonParts(hbm=hbm))
    try:
        await d.start()
        stats = d.stats()
        assert next(iter(stats["tiers"])) == "hbm"
        assert stats["tiers"]["hbm"]["capacity_bytes"] == 1 * MiB
        assert d.control is not None and d.control.hbm is not None   # the handshake offers it
    finally:
        await d.stop()
    assert len(pools) == 1 and isinstance(pools[0], ShmDevicePool) and pools[0].closed


def test_default_parts_still_refuse_hbm_without_a_device(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.tiers import hbm as hbm_mod

    assert fake_parts().nvme is make_nvme            # only the hbm factory is replaced
    monkeypatch.setattr(hbm_mod, "hbm_available", lambda device=0: (False, "no GPU here"))
    with pytest.raises(ConfigError, match=r"hbm\.enabled needs a CUDA device: no GPU here"):
        DaemonParts().hbm(small_config(tmp_path, **{"hbm.enabled": True, "hbm.bytes": "1MiB"}))


async def test_a_failed_start_undoes_what_it_made_in_reverse_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[str] = []

    def nvme(cfg: Config):
        tier = make_nvme(cfg)
        inner = tier.close

        def close() -> None:
            closed.append("nvme")
            inner()
        monkeypatch.setattr(tier, "close", close)
        return tier

    def broken_redis(cfg: Config):
        closed.append("redis factory ran")
        raise ConfigError("redis: test factory refuses")

    d = Daemon(small_config(tmp_path, **{"redis.enabled": True}),
               parts=DaemonParts(nvme=nvme, redis=broken_redis))
    with pytest.raises(ConfigError, match="test factory refuses"):
        await d.start()
    assert d.http is not None and d.arena is not None
    port = d.http._sockets[0].getsockname()[1]
    arena = d.arena.path
    assert arena.exists() and not port_is_free(port)   # bound and mapped until the stop
    await d.stop()
    assert closed == ["redis factory ran", "nvme"]
    assert not arena.exists() and port_is_free(port)
    assert not (tmp_path / "kvtier.sock").exists()


async def test_signal_handlers_are_removed_at_stop(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    d = Daemon(small_config(tmp_path, **{"nvme.enabled": False}))
    await d.start()
    try:
        serving = asyncio.ensure_future(d.serve_until_signal())
        await asyncio.sleep(0)
        d.request_stop()
        await asyncio.wait_for(serving, 5)
    finally:
        await d.stop()
    # remove_signal_handler says whether one was still installed: none is
    assert loop.remove_signal_handler(signal.SIGTERM) is False
    assert loop.remove_signal_handler(signal.SIGINT) is False


async def test_one_deadline_bounds_the_whole_stop(tmp_path: Path) -> None:
    d = Daemon(small_config(tmp_path, **{"daemon.drain_timeout_s": "0.3",
                                          "nvme.enabled": False}))
    await d.start()
    assert d.store is not None

    async def slow_drain(deadline: float) -> int:
        await asyncio.sleep(30)   # a drain that would outlive the deadline
        return 0

    d.store.drain = slow_drain  # type: ignore[method-assign]
    begun = time.monotonic()
    await d.stop()
    assert time.monotonic() - begun < 5.0     # 0.3 s deadline (+ floors), far below 30 s


def test_deadline_left_has_a_floor() -> None:
    assert Deadline(time.monotonic() - 5).left() == 0.1
    assert 0.9 < Deadline(time.monotonic() + 1).left(floor=0) <= 1.0
