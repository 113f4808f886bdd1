"""The nvme write budget as an operator sees it, on a real daemon: the bytes it refuses are
counted (what KVTierNvmeWriteBudgetExhausted reads), and the gauge of what it can admit
refills while the daemon is idle instead of showing the level of its last refusal."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=64, dtype="float16",
                  tokens_per_block=64)                      # 256 KiB blocks
RATE = 1_000_000                                            # 1 MB/s; burst 64 MiB


def scrape(daemon: DaemonProcess) -> dict[str, float]:
    with urllib.request.urlopen(daemon.http_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if "budget" in s.name}


def test_refused_bytes_are_counted_and_the_budget_gauge_refills_when_idle(
        tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path / "kvd", cpu_bytes="8MiB", nvme_bytes="256MiB",
                           env={"KVTIER_NVME_WRITE_BUDGET_BYTES_PER_S": str(RATE)}).start()
    try:
        with connect(daemon.socket) as c:
            ns = c.register_layout(LAYOUT, "budget-model")
            buf = np.full(LAYOUT.block_bytes, 1, np.uint8)
            for i in range(100):                            # 100 MiB through an 8 MiB arena
                keys = block_keys(ns, np.arange(i * 10**6, i * 10**6 + 4 * 64))
                c.put(ns, keys, [buf] * len(keys))
        after_storm = scrape(daemon)
        refused = after_storm["kvtier_nvme_write_budget_refused_bytes_total"]
        assert refused > 0 and refused % LAYOUT.block_bytes == 0
        stats = daemon.stats()["admission"]
        assert stats["nvme_write_budget"]["refused_bytes"] == refused
        assert stats["rejected"]["nvme"] == refused // LAYOUT.block_bytes
        time.sleep(2.0)
        idle = scrape(daemon)
        gained = (idle["kvtier_nvme_write_budget_available_bytes"]
                  - after_storm["kvtier_nvme_write_budget_available_bytes"])
        assert gained >= 1.5 * RATE        # 2 s at 1 MB/s (it read the same before the fix)
        assert idle["kvtier_nvme_write_budget_refused_bytes_total"] == refused
    finally:
        daemon.terminate()
