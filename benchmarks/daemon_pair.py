"""bench_redis's through-the-daemon path: two ``kvtier serve`` processes on one Redis, a
kv_producer's save on daemon A and a load on daemon B, which never saw the blocks."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import redis
from proc_cpu import Watch

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

MiB = 1 << 20
SYNC_S = 30.0   # a store's commit answers once its blocks are in Redis (or fails the run)
BYTES_PER_TOKEN = 2 * 4 * 8 * 128 * 2   # K+V, 4 layers, 8 kv heads, dim 128, fp16


def kv_bytes(n_bytes: int, seed: int) -> np.ndarray:
    """Normal-distributed fp16 KV of ``n_bytes`` (as the engine's blocks look)."""
    f = np.random.default_rng(seed).standard_normal(n_bytes // 2).astype(np.float16)
    return f.view(np.uint8)


class DaemonPair:
    """Daemon A stores (write-through to Redis), daemon B loads blocks it never saw."""

    def __init__(self, url: str, workdir: Path, size: int, k: int) -> None:
        self.size, self.k = size, k
        self.tokens = size // BYTES_PER_TOKEN
        layout = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16",
                          tokens_per_block=self.tokens)
        assert layout.block_bytes == size
        arena = f"{max(512, 4 * size * k // MiB)}MiB"
        # B waits for its Redis promotions as an engine that wants the KV would (the default
        # "timeout" policy allows 2 ms per block whatever its size: too short for 32 MiB)
        env = {"KVTIER_REDIS_WRITE_THROUGH": "true", "KVTIER_POLICY_PREFETCH_WAIT": "wait"}
        self.nodes = [DaemonProcess(workdir / f"d{size}-{name}", cpu_bytes=arena,
                                    nvme_bytes="0", extra_args=["--redis-url", url],
                                    env=env).start()
                      for name in ("a", "b")]
        self.ca, self.cb = connect(self.nodes[0].socket), connect(self.nodes[1].socket)
        self.pids = [node.proc.pid if node.proc is not None else None for node in self.nodes]
        self.ns_a = self.ca.register_layout(layout, "bench")
        self.ns_b = self.cb.register_layout(layout, "bench")
        self.admin = redis.Redis.from_url(url)
        self.data = [kv_bytes(size, seed=i) for i in range(k)]
        self.outs = [np.empty(size, np.uint8) for _ in range(k)]
        self.round = 0

    def run(self, rounds: int, times: dict[str, list[float]], watch: Watch) -> None:
        """Rounds alternate how B reads: ``get`` (copied into the engine's buffers) and
        ``prepare_get`` views released after reading (as the vLLM connector does before its
        scatter). The store's copy into the arena is timed separately: without it, a
        ``views`` store is what LMCache's and redis-py's timings hold (no engine copy)."""
        for r in range(2 * rounds + 2):
            self.round += 1
            first = self.round * self.k * self.tokens
            keys = block_keys(self.ns_a, np.arange(first, first + self.k * self.tokens))
            rkeys = [b"kvtier:" + bytes(key).hex().encode() for key in keys]
            s0 = watch.snap(self.pids[0])
            t0 = time.perf_counter()
            lease = self.ca.prepare_put(self.ns_a, keys)   # a kv_producer engine's save
            t_prep = time.perf_counter()
            for view, data in zip(lease.views, self.data, strict=True):
                assert view is not None
                view[:] = data
            t_copy = time.perf_counter()
            assert lease.commit(redis_sync_s=SYNC_S) == self.k
            t1 = time.perf_counter()
            s1 = watch.snap(self.pids[0])
            # checks, outside the timings
            assert lease.redis_synced and lease.redis_visible == self.k, lease.redis_visible
            assert self.admin.exists(*rkeys) == self.k   # Redis itself says they are there
            views = r % 2 == 1
            s2 = watch.snap(self.pids[1])
            t2 = time.perf_counter()
            assert self.cb.lookup(self.ns_b, keys).hits == self.k
            t_lookup = time.perf_counter()
            if views:
                got = self.cb.prepare_get(self.ns_b, keys)
                t3 = time.perf_counter()
                assert len(got.views) == self.k
                same = np.array_equal(got.views[-1], self.data[-1])   # the engine's read
                t4 = time.perf_counter()
                got.release()
                t5 = time.perf_counter()
                assert same
                load_s = (t3 - t2) + (t5 - t4)
                s3 = watch.snap(self.pids[1])
            else:
                assert self.cb.get(self.ns_b, keys, self.outs) == self.k
                load_s = time.perf_counter() - t2
                s3 = watch.snap(self.pids[1])
                assert np.array_equal(self.outs[-1], self.data[-1])
            if r > 1:  # rounds 0 and 1 warm up
                path = "views" if views else "daemon"
                store_s = (t_prep - t0) + (t1 - t_copy) if views else t1 - t0
                times.setdefault(path + "_store", []).append(store_s)
                times.setdefault(path + "_load", []).append(load_s)
                # the lookup alone (its part of both kinds of load): B's own share
                times.setdefault("lookup_load", []).append(t_lookup - t2)
                # (a views round's CPU holds the copy and the read it does not time)
                watch.record(path + "_store", s0, s1, cpu=not views)
                watch.record(path + "_load", s2, s3, cpu=not views)
            self.cb.delete(self.ns_b, keys)  # frees both arenas' copies and the Redis keys
            self.ca.delete(self.ns_a, keys)

    def close(self) -> None:
        self.ca.close()
        self.cb.close()
        self.admin.close()
        for node in self.nodes:
            node.kill()
