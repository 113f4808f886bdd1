"""A real daemon whose nvme directory is on a full 4 MiB tmpfs (issue 14): the tier shows
up = 0 in stats and metrics, durable puts are acknowledged short instead of hammering the
disk, blocks already on nvme are served exactly, and freeing space brings the tier back
(probe backoff shortened through the daemon's env)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess
from tests.support.small_fs import fill, small_tmpfs

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=64)            # 32 KiB blocks
FS_BYTES = 4 * 2**20
BATCH = 8


def content(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, LAYOUT.block_bytes, dtype=np.uint8)


def nvme_up_metric(d: DaemonProcess) -> str:
    with urllib.request.urlopen(d.http_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return next(line for line in text.splitlines()
                if line.startswith('kvtier_tier_up{tier="nvme"}'))


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "fs", FS_BYTES) as root:
        yield root


def test_full_disk_degrades_the_nvme_tier_and_space_brings_it_back(daemon_factory,
                                                                   fs: Path) -> None:
    fill(fs / "ballast", FS_BYTES // 2)
    env = {"KVTIER_NVME_PATH": str(fs / "nvme"), "KVTIER_NVME_BACKOFF_MIN_S": "0.01",
           "KVTIER_NVME_BACKOFF_MAX_S": "0.05"}
    d: DaemonProcess = daemon_factory(cpu_bytes="1MiB", nvme_bytes="64MiB", env=env).start()
    assert nvme_up_metric(d).endswith(" 1.0")
    c = connect(d.socket)
    try:
        ns = c.register_layout(LAYOUT, "m")
        durable: list[bytes] = []
        short = None
        for b in range(200):   # 6.4 MiB of durable blocks: far more than the 2 MiB left
            keys = block_keys(ns, np.arange(b * BATCH * 64, (b + 1) * BATCH * 64))
            acked = c.put(ns, keys, [content(k) for k in keys], durable=True)
            if acked < len(keys):
                short = b
                break
            durable.extend(keys)
        assert short is not None and len(durable) >= 16
        nvme = d.stats()["tiers"]["nvme"]
        assert nvme["up"] is False and nvme["health"] == "degraded"
        assert nvme["degraded_reason"].startswith(("ENOSPC", "EIO"))
        assert nvme["degradations"] == 1
        assert nvme_up_metric(d).endswith(" 0.0")

        # more puts go on (cpu only) and are refused by nvme without errors piling up
        errors = nvme["errors"]
        for b in range(1000, 1005):
            keys = block_keys(ns, np.arange(b * BATCH * 64, (b + 1) * BATCH * 64))
            assert c.put(ns, keys, [content(k) for k in keys], durable=True) == 0
        nvme = d.stats()["tiers"]["nvme"]
        assert nvme["errors"] == errors and nvme["refused_writes"] >= 5 * BATCH

        # every acknowledged durable block (most only on nvme now) comes back exactly
        for i in range(0, len(durable), BATCH):
            chunk = durable[i: i + BATCH]
            outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in chunk]
            assert c.get(ns, chunk, outs) == len(chunk)
            for k, out in zip(chunk, outs, strict=True):
                assert np.array_equal(out, content(k)), f"wrong bytes for {k.hex()}"

        (fs / "ballast").unlink()
        deadline = time.monotonic() + 20
        while not d.stats()["tiers"]["nvme"]["up"]:
            assert time.monotonic() < deadline, "nvme stayed degraded after space came back"
            time.sleep(0.02)
        assert nvme_up_metric(d).endswith(" 1.0")
        keys = block_keys(ns, np.arange(10**7, 10**7 + BATCH * 64))
        assert c.put(ns, keys, [content(k) for k in keys], durable=True) == len(keys)
        nvme = d.stats()["tiers"]["nvme"]
        assert nvme["health"] == "up" and nvme["restorations"] == 1
    finally:
        c.close()
    health = [line for line in d.log().splitlines() if "logger=kvtier.tiers.nvme.health" in line]
    assert len(health) == 2, health               # logged once per transition, not per write
    assert "degraded (" in health[0] and "restored after" in health[1]
