"""The miss-explanation ring's cost on the lookup path, side by side in one run.

An in-process TieredStore (real shared-memory arena) holds 256 prompts of 16 blocks; each
round times 2,000 lookups (half full hits, half that miss after 12 blocks, so the ring's
removal probe runs) with the MissLog hooked in and without it, alternating, and prints the
median per-lookup time of each and their ratio. The issue asks for a ratio <= 1.05.

Usage: python benchmarks/bench_explain.py [--rounds 60] [--lookups 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.explain import MissLog
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from tests.support.arena import temp_arena

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16",
                  tokens_per_block=16)
PROMPTS, BLOCKS = 256, 16


async def main(rounds: int, lookups: int) -> None:
    nbytes = LAYOUT.block_bytes
    slot = max(nbytes, 4096)   # the slab allocator rounds slots up to pages
    with temp_arena(2 * PROMPTS * BLOCKS * slot, 2**20) as arena:
        store = TieredStore(arena, eviction="lru")
        ns = store.register_namespace(LAYOUT, "bench", 0, 1, None)
        assert ns == Namespace("bench", LAYOUT)
        d, fp = ns.digest, LAYOUT.fingerprint
        chains = []
        for p in range(PROMPTS):
            keys = block_keys(ns, range(p * 10_000, p * 10_000 + BLOCKS * 16))
            lease, _ = await store.prepare_put(1, d, fp, keys[:12] if p % 2 else keys)
            await store.commit_put(1, lease)
            chains.append(keys)
        log = MissLog(policies={"cpu": "lru"})
        for k in (block_keys(ns, range(p * 10_000, p * 10_000 + BLOCKS * 16))[12]
                  for p in range(1, PROMPTS, 4)):
            log.removed(k, "capacity", "cpu")     # some misses find a removal record

        async def timed(explain: MissLog | None) -> float:
            store.explain = explain
            t0 = time.perf_counter()
            for i in range(lookups):
                await store.lookup(d, fp, chains[i % PROMPTS])
            return (time.perf_counter() - t0) / lookups

        # short alternating chunks: drift in machine load hits both sides alike
        off, on = [], []
        await timed(None)
        await timed(log)   # warm up both paths
        for i in range(rounds):
            first, second = (None, log) if i % 2 == 0 else (log, None)
            t1, t2 = await timed(first), await timed(second)
            off.append(t1 if first is None else t2)
            on.append(t2 if first is None else t1)
        m_off, m_on = statistics.median(off), statistics.median(on)
        hook = min(timeit.repeat(lambda: log.lookup(d, chains[1], 12, 12, 12, store.index,
                                                    False), number=20_000, repeat=5)) / 20_000
        print(f"in-process TieredStore.lookup of {BLOCKS} blocks, {rounds} alternating rounds "
              f"x {lookups} lookups")
        print(f"  ring off: median {m_off * 1e6:7.2f} us   min {min(off) * 1e6:7.2f} us")
        print(f"  ring on:  median {m_on * 1e6:7.2f} us   min {min(on) * 1e6:7.2f} us   "
              f"({len(log)} rows kept)")
        print(f"  ratio on/off: median {m_on / m_off:.3f}, min {min(on) / min(off):.3f}  "
              "(target <= 1.05)")
        print(f"  the hook alone (MissLog.lookup, a miss with a removal probe): "
              f"{hook * 1e6:.2f} us")
    rt = client_round_trip(lookups)
    print(f"client lookup round trip through a real daemon (ring on): median {rt * 1e6:.1f} us;"
          f" the hook is {100 * hook / rt:.1f}% of it")


def client_round_trip(n: int) -> float:
    """Median time of a client lookup of a 16-block prompt, socket round trip included."""
    import tempfile

    from kvtier.client import connect
    from tests.support.daemon import DaemonProcess

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        d = DaemonProcess(Path(tmp), cpu_bytes="64MiB", nvme_bytes="0").start()
        try:
            c = connect(d.socket)
            ns = c.register_layout(LAYOUT, "bench")
            keys = block_keys(ns, range(BLOCKS * 16))
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                c.lookup(ns, keys)
                times.append(time.perf_counter() - t0)
            c.close()
            return statistics.median(times)
        finally:
            d.terminate()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--lookups", type=int, default=2_000)
    a = ap.parse_args()
    asyncio.run(main(a.rounds, a.lookups))
