"""HBM end to end on the CPU: a real daemon process whose device pool is a host-memory fake,
and real clients in this process whose HBM mapping is the matching fake.

Only the device is faked (tests/support/fake_hbm.py; the daemon gets it through its
``DaemonParts`` seam: tests/support/fake_hbm_daemon.py is ``kvtier serve`` with a fake HBM
factory): handshake, control protocol, store placement, client mapping selection, views and
stats are the production code. The same flow on a real GPU is
tests/gpu/test_hbm_daemon.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.client import connect, connect_async
from kvtier.client.ops import Ops
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from kvtier.tiers import hbm as hbm_mod
from tests.support.daemon import DaemonProcess
from tests.support.fake_hbm import (
    DAEMON_PROGRAM,
    FAKE_BUS_ID,
    FakeHbmMapping,
    daemon_env,
    install_client_fake,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16",
                  tokens_per_block=64)
BLOCK = LAYOUT.block_bytes
MiB = 1 << 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("hbm-daemon"), cpu_bytes="8MiB",
                      program=DAEMON_PROGRAM, env={**daemon_env(), "KVTIER_HBM_ENABLED": "1",
                           "KVTIER_HBM_BYTES": "1MiB"})
    d.start(timeout=30)
    yield d
    d.terminate()


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[FakeHbmMapping]:
    return install_client_fake(monkeypatch)


def blocks(start: int, n: int) -> tuple[Any, list[bytes], list[np.ndarray]]:
    """(namespace placeholder filled by the caller, keys, payloads) of ``n`` blocks."""
    rng = np.random.default_rng(start)
    tokens = list(range(start * 100_000, start * 100_000 + n * LAYOUT.tokens_per_block))
    return tokens, [], [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]


def store_blocks(client: Any, start: int, n: int) -> tuple[Any, list[bytes], list[np.ndarray]]:
    ns = client.register_layout(LAYOUT, "test/hbm")
    tokens, _, data = blocks(start, n)
    keys = block_keys(ns, tokens)
    assert client.put(ns, keys, data) == n
    return ns, keys, data


def test_handshake_carries_the_pool(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as c:
        info = c.hbm_info
        assert info is not None
        assert isinstance(info["handle"], bytes) and len(info["handle"]) == 64
        assert info["size"] == 1 * MiB and info["device"] == 0
        assert info["pci_bus_id"] == FAKE_BUS_ID
        assert not c.hbm_mapped
    log = daemon.log()
    assert "hbm tier:" in log
    stats = daemon.stats()
    assert list(stats["tiers"])[:2] == ["hbm", "cpu"]
    assert stats["tiers"]["hbm"]["placement"].startswith("store:")


def test_a_cpu_client_never_maps_the_pool(daemon: DaemonProcess,
                                          opened: list[FakeHbmMapping]) -> None:
    with connect(daemon.socket) as c:
        ns, keys, data = store_blocks(c, 1, 3)
        with c.prepare_get(ns, keys) as lease:
            assert lease.devices == ["cpu"] * 3
            assert all(isinstance(v, np.ndarray) for v in lease.views)
            assert [bytes(v) for v in lease.views] == [d.tobytes() for d in data]
        out = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert c.get(ns, keys, out) == 3
        assert not c.hbm_mapped
    assert opened == []


def test_a_device_client_reads_from_hbm(daemon: DaemonProcess,
                                        opened: list[FakeHbmMapping]) -> None:
    before = daemon.stats()["tiers"]["hbm"]
    with connect(daemon.socket, device=True) as c:
        ns, keys, data = store_blocks(c, 2, 3)
        assert opened == []                          # lazily: puts do not map the pool
        with c.prepare_get(ns, keys) as lease:
            assert lease.devices == ["hbm"] * 3
            assert [bytes(v) for v in lease.views] == [d.tobytes() for d in data]
            assert all(not v.flags.writeable for v in lease.views)
        with c.prepare_get(ns, keys) as lease:      # a hit, through the same mapping
            assert lease.devices == ["hbm"] * 3
            assert [bytes(v) for v in lease.views] == [d.tobytes() for d in data]
        with c.prepare_get(ns, keys, prefer_device=False) as lease:
            assert lease.devices == ["cpu"] * 3
        out = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert c.get(ns, keys, out) == 3             # the copying get reads cpu views
        assert [o.tobytes() for o in out] == [d.tobytes() for d in data]
        assert c.hbm_mapped and len(opened) == 1
    assert opened[0].closed                          # close() drops the mapping
    after = daemon.stats()
    hbm = after["tiers"]["hbm"]
    assert hbm["miss_blocks"] - before["miss_blocks"] == 3
    assert hbm["hit_blocks"] - before["hit_blocks"] == 3
    assert 0 < hbm["used_bytes"] <= hbm["capacity_bytes"]
    assert any(m["src"] == "cpu" and m["dst"] == "hbm" and m["bytes"] >= 3 * BLOCK
               for m in after["bytes_moved"])
    assert after["leases"]["active"] == 0


def test_prefer_device_per_call_and_pool_capacity(daemon: DaemonProcess,
                                                  opened: list[FakeHbmMapping]) -> None:
    n = MiB // BLOCK + 4                              # more blocks than the pool holds
    with connect(daemon.socket) as c:
        ns, keys, data = store_blocks(c, 3, n)
        with c.prepare_get(ns, keys, prefer_device=True) as lease:
            fit = lease.devices.count("hbm")
            assert 0 < fit < n and lease.devices == ["hbm"] * fit + ["cpu"] * (n - fit)
            assert [bytes(v) for v in lease.views] == [d.tobytes() for d in data]
        stats = daemon.stats()["tiers"]["hbm"]
        assert stats["used_bytes"] <= stats["capacity_bytes"]
        assert stats["allocation_failures"] >= 1
        other, more, more_data = store_blocks(c, 7, 4)   # room is made by evicting (by the
        with c.prepare_get(other, more, prefer_device=True) as lease:   # daemon's policy)
            assert lease.devices == ["hbm"] * 4
            assert [bytes(v) for v in lease.views] == [d.tobytes() for d in more_data]
        stats = daemon.stats()["tiers"]["hbm"]
        assert stats["evictions"]["capacity"] >= 4
        assert stats["used_bytes"] <= stats["capacity_bytes"]
    assert len(opened) == 1


def device_client_reads_cpu_views(daemon: DaemonProcess, start: int) -> None:
    """A device client's gets of two blocks, twice: cpu views with the stored bytes, and
    the pool never mapped."""
    with connect(daemon.socket, device=True) as c:
        ns, keys, data = store_blocks(c, start, 2)
        for _ in range(2):
            with c.prepare_get(ns, keys) as lease:
                assert lease.devices == ["cpu", "cpu"]
                assert [bytes(v) for v in lease.views] == [d.tobytes() for d in data]
        assert not c.hbm_mapped


def test_a_pool_that_cannot_be_mapped_falls_back_to_cpu(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def refuse(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(hbm_mod.HbmMapping, "open", refuse)
    monkeypatch.setattr(hbm_mod.HbmMapping, "on_current_device", lambda *a, **kw: True)
    with caplog.at_level(logging.WARNING, "kvtier.client"):
        device_client_reads_cpu_views(daemon, 4)
    assert calls == [1]                               # tried once, then cpu for good
    assert "cannot map the daemon's HBM pool" in caplog.text


def test_a_client_on_another_gpu_reads_cpu_views_and_never_maps_the_pool(
        daemon: DaemonProcess, opened: list[FakeHbmMapping],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A tensor-parallel worker whose GPU is not the pool's: mapping it would make a CUDA
    context on the pool's GPU in that worker and a peer copy of every load (found by a
    review of the GPU path); its cpu views copy straight to its own GPU."""
    monkeypatch.setattr(FakeHbmMapping, "current_device", 1)
    with caplog.at_level(logging.INFO, "kvtier.client"):
        device_client_reads_cpu_views(daemon, 8)
    assert opened == []
    assert caplog.text.count("HBM pool is on GPU 0000:") == 1    # said once


async def test_async_device_client(daemon: DaemonProcess,
                                   opened: list[FakeHbmMapping]) -> None:
    c = await connect_async(daemon.socket, device=True)
    try:
        ns = await c.register_layout(LAYOUT, "test/hbm")
        tokens, _, data = blocks(5, 2)
        keys = block_keys(ns, tokens)
        assert await c.put(ns, keys, data) == 2
        lease = await c.prepare_get(ns, keys)
        assert lease.devices == ["hbm", "hbm"]
        assert [bytes(v) for v in lease.views] == [d.tobytes() for d in data]
        await lease.release()
        assert c.hbm_info is not None and c.hbm_mapped
    finally:
        await c.close()
    assert len(opened) == 1 and opened[0].closed


def test_a_daemon_without_hbm_serves_device_clients_from_cpu(
        tmp_path: Path, opened: list[FakeHbmMapping]) -> None:
    d = DaemonProcess(tmp_path, cpu_bytes="8MiB").start(timeout=30)
    try:
        with connect(d.socket, device=True) as c:
            assert c.hbm_info is None
            ns, keys, _ = store_blocks(c, 6, 2)
            with c.prepare_get(ns, keys) as lease:
                assert lease.devices == ["cpu", "cpu"]
            assert not c.hbm_mapped
        assert "hbm" not in d.stats()["tiers"]
    finally:
        d.terminate()
    assert opened == []


@pytest.mark.parametrize("device", ["cuda:0", None, [0]])
def test_a_malformed_pool_device_in_the_hello_is_one_cpu_fallback(
        device: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A hello whose hbm.device is not an int (a buggy or hostile daemon): one logged
    fallback to cpu views, not an error on every device get (found by review)."""
    ops = Ops(device=True)
    ops.hbm_info = {"handle": b"h" * 64, "size": MiB, "device": device}
    with caplog.at_level(logging.WARNING, "kvtier.client"):
        assert ops._device_mapping(True) is None
        assert ops._device_mapping(True) is None
    assert ops.hbm_error is not None
    assert caplog.text.count("cannot map the daemon's HBM pool") == 1
