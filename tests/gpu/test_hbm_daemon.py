"""HBM end to end on a real GPU: a daemon process with ``hbm.enabled`` and a device client in
this process (another process than the daemon's) reading blocks through CUDA IPC views.

Skipped (by tests/gpu/conftest.py, with the reason) where no GPU is usable. Written without
a GPU: the CPU version of the same flow is tests/integration/test_hbm_daemon.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.gpu
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16",
                  tokens_per_block=64)
BLOCK = LAYOUT.block_bytes


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("hbm-gpu"), cpu_bytes="64MiB",
                      env={"KVTIER_HBM_ENABLED": "1", "KVTIER_HBM_BYTES": "16MiB"})
    d.start(timeout=60)
    yield d
    d.terminate()


def _store(client: Any, seed: int, n: int) -> tuple[Any, list[bytes], list[np.ndarray]]:
    ns = client.register_layout(LAYOUT, "test/hbm-gpu")
    rng = np.random.default_rng(seed)
    keys = block_keys(ns, list(range(seed * 10**6, seed * 10**6 + n * LAYOUT.tokens_per_block)))
    data = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]
    assert client.put(ns, keys, data) == n
    return ns, keys, data


def test_device_client_reads_blocks_device_to_device(daemon: DaemonProcess) -> None:
    import cupy

    with connect(daemon.socket, device=True) as c:
        assert c.hbm_info is not None and len(c.hbm_info["handle"]) == 64
        ns, keys, data = _store(c, 1, 4)
        for _ in range(2):                               # a promotion, then an hbm hit
            with c.prepare_get(ns, keys) as lease:
                assert lease.devices == ["hbm"] * 4
                out = cupy.empty((4, BLOCK), dtype=cupy.uint8)
                for i, view in enumerate(lease.views):
                    assert isinstance(view, cupy.ndarray) and view.nbytes == BLOCK
                    out[i] = view                        # device-to-device
                cupy.cuda.runtime.deviceSynchronize()
            assert cupy.asnumpy(out).tobytes() == b"".join(d.tobytes() for d in data)
        assert c.hbm_mapped
    stats = daemon.stats()["tiers"]["hbm"]
    assert stats["hit_blocks"] >= 4 and stats["miss_blocks"] >= 4
    assert 0 < stats["used_bytes"] <= stats["capacity_bytes"]


def test_cpu_client_on_a_gpu_daemon_gets_cpu_views(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as c:
        ns, keys, data = _store(c, 2, 2)
        with c.prepare_get(ns, keys) as lease:
            assert lease.devices == ["cpu", "cpu"]
            assert [bytes(v) for v in lease.views] == [d.tobytes() for d in data]
        assert not c.hbm_mapped


def test_pool_capacity_is_hard_with_device_reads(daemon: DaemonProcess) -> None:
    import cupy

    n = 16 * 2**20 // BLOCK + 3
    with connect(daemon.socket, device=True) as c:
        ns, keys, data = _store(c, 3, n)
        with c.prepare_get(ns, keys) as lease:
            assert "cpu" in lease.devices and "hbm" in lease.devices
            for view, dev, d in zip(lease.views, lease.devices, data, strict=True):
                got = cupy.asnumpy(view) if dev == "hbm" else np.asarray(view)
                assert got.tobytes() == d.tobytes()
    stats = daemon.stats()["tiers"]["hbm"]
    assert stats["used_bytes"] <= stats["capacity_bytes"]
