"""A greedy reader against a real daemon: one client process pins at most its share of the
arena in open get leases (``daemon.client_get_share``), so it cannot hold the cpu tier
against another process's puts by leasing every block and never releasing (a lease lives
up to its TTL, and such a client renews it). Beyond the share a get is granted its leading
blocks, the rest a miss the engine recomputes; nothing returned is wrong."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import numpy as np

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess
from tests.support.victim import victim

LAYOUT = KVLayout(2, 2, 32, "float16", 64)
BB = LAYOUT.block_bytes
ARENA_BLOCKS = 16

def test_one_process_pins_at_most_its_share_of_the_arena(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d", cpu_bytes=str(ARENA_BLOCKS * BB), nvme_bytes="0",
                      env={"KVTIER_DAEMON_CLIENT_GET_SHARE": "0.5",
                           "KVTIER_DAEMON_CLIENT_PUT_SHARE": "1"}).start()
    try:
        with connect(d.socket) as hog:
            ns = hog.register_layout(LAYOUT, "m", cache_salt="hog")
            keys = block_keys(ns, np.arange(12 * 64))
            data = [np.full(BB, i + 1, np.uint8) for i in range(12)]
            assert hog.put(ns, keys, data) == 12
            first = hog.prepare_get(ns, keys)          # asks to pin all 12, never releases
            assert len(first.views) == ARENA_BLOCKS // 2
            assert all(np.array_equal(v, w) for v, w in zip(first.views, data, strict=False))
            assert len(hog.prepare_get(ns, keys).views) == 0   # its share is spent
            assert d.stats()["daemon"]["capped_gets"] == 2
            with urllib.request.urlopen(d.http_url + "/metrics") as r:
                assert 'kvtier_limited_total{event="capped_gets"} 2.0' in r.read().decode()
            # the other process still finds room: the 4 unpinned blocks of the hog and the
            # 4 free slots (without the share, the hog pinned 12 and left it 4)
            assert victim(d.socket, 8) == (8, 8, 8)
            first.release()
            assert len(hog.prepare_get(ns, keys[:4]).views) == 4   # released: room again
    finally:
        d.kill()
