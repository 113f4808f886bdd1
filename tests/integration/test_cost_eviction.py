"""The daemon evicts by cost (its default) across the cpu and nvme tiers.

Same workload on two daemons, one with the default policy and one with ``--eviction lru``:
a shared prefix that many requests reuse, then a stream of one-off prompts larger than
the cpu tier. LRU lets the stream push the shared prefix out of the cpu tier; the cost
policy keeps it there, because it has shown reuse, and demotes chains from the leaf end.
"""

from __future__ import annotations

import numpy as np

from kvtier.client import KVTierClient, connect
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

LAYOUT = KVLayout(2, 2, 32, "float16", 64)  # 32 KiB blocks
CPU_BLOCKS = 16


def _workload(c: KVTierClient, ns: Namespace) -> tuple[list[bytes], list[list[bytes]]]:
    buf = np.zeros(LAYOUT.block_bytes, np.uint8)
    shared = np.arange(64 * 4)  # a 4-block system prompt
    hot = block_keys(ns, shared)
    for turn in range(6):  # six requests share it, each with its own question
        prompt = np.concatenate([shared, np.arange(64) + 10_000 + 64 * turn])
        keys = block_keys(ns, prompt)
        c.lookup(ns, keys)
        c.put(ns, keys, [buf] * len(keys), output_tokens=8)
    one_offs = []
    for i in range(12):  # 48 one-off blocks: three times the cpu tier
        keys = block_keys(ns, np.arange(64 * 4) + 1_000_000 * (i + 1))
        c.lookup(ns, keys)
        c.put(ns, keys, [buf] * len(keys), output_tokens=500)
        one_offs.append(keys)
    return hot, one_offs


def _run(daemon: DaemonProcess) -> tuple[list[str], list[list[str]], dict]:
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m")
    hot, one_offs = _workload(c, ns)
    hot_tiers = c.lookup(ns, hot, prefetch=False).tiers
    chains = [c.lookup(ns, keys, prefetch=False).tiers for keys in one_offs]
    return hot_tiers, chains, c.stats()


def test_cost_policy_is_default_and_keeps_reused_prefixes_in_cpu(daemon_factory) -> None:
    size = f"{CPU_BLOCKS * LAYOUT.block_bytes}"
    cost = daemon_factory("cost", cpu_bytes=size, nvme_bytes="64MiB",
                          extra_args=["--eviction", "cost"]).start()
    lru = daemon_factory("lru", cpu_bytes=size, nvme_bytes="64MiB",
                         extra_args=["--eviction", "lru"]).start()
    cost_hot, cost_chains, cost_stats = _run(cost)
    lru_hot, _lru_chains, lru_stats = _run(lru)

    assert cost_stats["policy"]["eviction"] == "cost"
    assert lru_stats["policy"]["eviction"] == "lru"
    # both tiers were used and the cpu tier stayed within its hard capacity
    for st in (cost_stats, lru_stats):
        cpu = st["tiers"]["cpu"]
        assert cpu["used_bytes"] <= cpu["capacity_bytes"]
        assert cpu["evictions"]["capacity"] > 0 and st["tiers"]["nvme"]["blocks"] > 0
    # LRU pushed the reused prefix out of the cpu tier; cost kept it there
    assert lru_hot != ["cpu"] * 4
    assert cost_hot == ["cpu"] * 4
    # prefix-aware: a chain is demoted from its leaf end, so what stays in cpu is a prefix
    for tiers in cost_chains:
        assert len(tiers) == 4  # nothing lost: demoted to nvme, not dropped
        in_cpu = [t == "cpu" for t in tiers]
        assert in_cpu == sorted(in_cpu, reverse=True), tiers
