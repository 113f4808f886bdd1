"""The daemon keeps its blocks out of Python's garbage collections (kvtier.daemon.gc_guard):
a real daemon filled with blocks has them frozen, and says so in /v1/stats; its full
collection waits for a moment without requests."""

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

LAYOUT = KVLayout(1, 1, 64, "float16", 16)    # 4 KiB blocks: many blocks, little memory
BLOCKS = 20_000


def _fill(d: DaemonProcess) -> None:
    c = connect(d.socket, timeout=30)
    try:
        ns = c.register_layout(LAYOUT, "gc")
        tokens = LAYOUT.tokens_per_block
        buf = [np.zeros(LAYOUT.block_bytes, np.uint8)] * 1000
        for i in range(0, BLOCKS, 1000):
            keys = block_keys(ns, np.arange(i * tokens, (i + 1000) * tokens))
            assert c.put(ns, keys, buf) == 1000
    finally:
        c.close()


def test_stored_blocks_are_frozen_out_of_collections(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d", cpu_bytes="256MiB", nvme_bytes="0").start()
    try:
        _fill(d)
        gc_stats = d.stats()["daemon"]["gc"]
        # counted at start; the blocks' objects were frozen after it (each at least one)
        assert gc_stats["frozen"] > 0 and gc_stats["frozen_since"] >= BLOCKS
        assert gc_stats["freezes"] > 0 and gc_stats["full_collections"] == 0
        with urllib.request.urlopen(d.http_url + "/metrics", timeout=5) as r:
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        assert families["kvtier_gc_frozen_objects"].samples[0].value == gc_stats["frozen"]
        assert families["kvtier_gc_frozen_since_full_objects"].samples[0].value >= BLOCKS
        assert families["kvtier_gc_full_collections"].samples[0].value == 0
    finally:
        d.kill()


def test_gc_freeze_off_leaves_the_interpreter_collector(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d", cpu_bytes="256MiB", nvme_bytes="0",
                      env={"KVTIER_DAEMON_GC_FREEZE": "false"}).start()
    try:
        _fill(d)
        assert "gc" not in d.stats()["daemon"]
    finally:
        d.kill()


def test_the_full_collection_waits_until_clients_are_quiet(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d", cpu_bytes="64MiB", nvme_bytes="0",
                      env={"KVTIER_DAEMON_GC_FULL_S": "2", "KVTIER_DAEMON_GC_QUIET_S": "0.3"})
    d.start()
    c = connect(d.socket)
    try:
        ns = c.register_layout(LAYOUT, "gc")
        keys = block_keys(ns, np.arange(4 * LAYOUT.tokens_per_block))
        busy_until = time.monotonic() + 3.0       # due at 2 s, gives up at 4 s
        while time.monotonic() < busy_until:      # an engine asking all the time
            c.lookup(ns, keys)
            time.sleep(0.01)
        assert d.stats()["daemon"]["gc"]["full_collections"] == 0   # (/v1/stats: HTTP)
        give_up = time.monotonic() + 5.0
        while (gcs := d.stats()["daemon"]["gc"])["full_collections"] == 0:
            assert time.monotonic() < give_up, gcs
            time.sleep(0.05)
        assert gcs["full_not_quiet"] == 0 and gcs["last_full_waited_s"] >= 0.9, gcs
    finally:
        c.close()
        d.kill()


def test_a_warm_restart_indexes_the_adopted_blocks_with_the_guard_on(tmp_path: Path) -> None:
    """The guard starts before recovery: the adopted blocks' objects are frozen as they
    are indexed (counted in frozen_since), not walked by the interpreter's collections
    (which took a third of a 400k-block recovery)."""
    d = DaemonProcess(tmp_path / "d", cpu_bytes="256MiB", nvme_bytes="0").start()
    try:
        _fill(d)
        d.wait_journal_commits(BLOCKS)
        d.crash()
        d.start()
        stats = d.stats()
        assert stats["recovery"]["adopted_blocks"] == BLOCKS
        gcs = stats["daemon"]["gc"]
        # counted at start, before recovery: the interpreter's own objects only; what
        # recovery built (several objects per block) was frozen after that count
        assert gcs["frozen_since"] >= 4 * BLOCKS and gcs["frozen_since"] > gcs["frozen"], gcs
    finally:
        d.kill()
