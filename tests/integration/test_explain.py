"""Per-request miss explanations from a real daemon: /v1/lookups/recent, `kvtier explain`
(table and --json) and kvtier_first_miss_total, after evictions, a lost lease, a never-seen
prompt and a lookup under an unknown layout."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import connect
from kvtier.errors import KVTierError
from kvtier.explain import salt_id
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=64)   # 32 KiB blocks


def recent(url: str, query: str = "") -> list[dict]:
    with urllib.request.urlopen(f"{url}/v1/lookups/recent{query}", timeout=5) as r:
        return json.loads(r.read())["lookups"]


def test_explain_says_why_each_lookup_missed(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "kvd", cpu_bytes="1MiB", nvme_bytes="0",
                      env={"KVTIER_CPU_SLAB_BYTES": "1MiB", "KVTIER_POLICY_EVICTION": "lru"})
    d.start()
    try:
        c = connect(d.socket)
        ns = c.register_layout(LAYOUT, "ops/model", cache_salt="tenant-a")
        buf = np.zeros(LAYOUT.block_bytes, np.uint8)
        first = block_keys(ns, np.arange(0, 64 * 4))
        c.put(ns, first, [buf] * 4)
        assert c.lookup(ns, first).hits == 4                                  # full hit
        for i in range(1, 12):                      # 1 MiB = 32 blocks: first is evicted
            more = block_keys(ns, np.arange(i * 10_000, i * 10_000 + 64 * 4))
            c.put(ns, more, [buf] * 4)
        assert c.lookup(ns, first).hits == 0                                  # evicted
        lost = block_keys(ns, np.arange(10**6, 10**6 + 128))
        c.prepare_put(ns, lost).abort()
        c.lookup(ns, lost)                                                    # lease lost
        c.lookup(ns, block_keys(ns, np.arange(10**7, 10**7 + 64)))           # never stored
        with pytest.raises(KVTierError):
            c._call({"op": "lookup", "ns": ns.digest, "layout_fp": LAYOUT.fingerprint + 1,
                     "keys": first[0]})                                       # bad layout
        rows = recent(d.http_url, "?limit=5")
        assert [r["reason"] for r in rows] == ["namespace_mismatch", "never_stored",
                                               "lease_lost", "evicted", "none"]
        evicted = rows[3]
        # the daemon's own keyed id: 8 hex digits, not the unkeyed hash one could guess from
        assert evicted["model_id"] == "ops/model" and len(evicted["salt_id"]) == 8
        assert evicted["salt_id"] != salt_id("tenant-a")   # (this process has another key)
        assert "tenant-a" not in json.dumps(rows)   # the salt itself is never served
        assert evicted["removed"]["tier"] == "cpu" and evicted["removed"]["policy"] == "lru"
        assert (evicted["blocks"], evicted["first_miss"]) == (4, 0)
        assert rows[4]["hits"] == {"cpu": 4, "nvme": 0, "redis": 0}
        assert all(r["reason"] != "none" for r in recent(d.http_url, "?misses=1&limit=100"))
        with pytest.raises(urllib.error.HTTPError):
            recent(d.http_url, "?limit=abc")

        out = subprocess.run([sys.executable, "-m", "kvtier.cli", "explain", "--url",
                              d.http_url, "--json", "--limit", "3"], capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 0
        assert [r["reason"] for r in json.loads(out.stdout)["lookups"]] == \
            ["namespace_mismatch", "never_stored", "lease_lost"]
        table = subprocess.run([sys.executable, "-m", "kvtier.cli", "explain", "--url",
                                d.http_url, "--misses"], capture_output=True, text=True,
                               timeout=30)
        assert table.returncode == 0
        assert "evicted" in table.stdout and "left cpu (lru)" in table.stdout
        print(table.stdout)

        with urllib.request.urlopen(d.http_url + "/metrics", timeout=5) as r:
            metrics = r.read().decode()
        assert 'kvtier_first_miss_total{reason="evicted"} 1.0' in metrics
        assert 'kvtier_first_miss_total{reason="lease_lost"} 1.0' in metrics
        c.close()
    finally:
        d.terminate()


def test_explain_without_a_daemon_says_so() -> None:
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "explain", "--url",
                          "http://127.0.0.1:1"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "no daemon answered" in out.stderr
