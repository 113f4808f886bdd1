"""Several clients at once against a small arena that spills to nvme (a real daemon): puts
evict victims in batches (kvtier.store.alloc) while other clients read, re-put and delete
the same blocks. Every block read back has exactly the bytes that were put, and nothing is
left stuck: afterwards a put can take over the whole arena."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import numpy as np

from kvtier.client import connect
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16",
                  tokens_per_block=64)     # 64 KiB blocks
ARENA_BLOCKS = 48
CHAINS = 40                                 # 8 blocks each: several arenas' worth
CHAIN_BLOCKS = 8
CLIENTS = 4
ROUNDS = 200


def chain_keys(ns: Namespace, c: int) -> list[bytes]:
    return block_keys(ns, np.arange(CHAIN_BLOCKS * 64) + 1_000_000 * (c + 1))


def block(c: int, i: int) -> np.ndarray:
    return np.full(LAYOUT.block_bytes, (c * CHAIN_BLOCKS + i) % 251 + 1, np.uint8)


def test_concurrent_puts_reads_and_deletes_over_a_spilling_arena(tmp_path: Path) -> None:
    # (the last put, and the reads, take the whole arena from one process: no per-process
    # shares here)
    no_shares = {"KVTIER_DAEMON_CLIENT_PUT_SHARE": "1", "KVTIER_DAEMON_CLIENT_GET_SHARE": "1"}
    d = DaemonProcess(tmp_path / "d", cpu_bytes=f"{ARENA_BLOCKS * LAYOUT.block_bytes}",
                      nvme_bytes="64MiB", env=no_shares).start()
    errors: list[BaseException] = []
    wrong: list[tuple[int, int]] = []
    reads = [0]

    def client(seed: int) -> None:
        rng = random.Random(seed)
        c = connect(d.socket, timeout=60)
        try:
            ns = c.register_layout(LAYOUT, "spill")
            outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in range(CHAIN_BLOCKS)]
            for _ in range(ROUNDS):
                ch = rng.randrange(CHAINS)
                keys = chain_keys(ns, ch)
                op = rng.random()
                if op < 0.45:
                    c.put(ns, keys, [block(ch, i) for i in range(CHAIN_BLOCKS)])
                elif op < 0.9:
                    c.lookup(ns, keys)
                    got = c.get(ns, keys, outs)
                    reads[0] += got
                    wrong.extend((ch, i) for i in range(got)
                                 if not np.array_equal(outs[i], block(ch, i)))
                else:
                    c.delete(ns, keys[rng.randrange(CHAIN_BLOCKS):])
        except BaseException as exc:   # reported by the test thread
            errors.append(exc)
        finally:
            c.close()

    try:
        threads = [threading.Thread(target=client, args=(s,)) for s in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert not wrong, wrong[:5]
        assert reads[0] > 0
        stats = d.stats()
        cpu, nvme = stats["tiers"]["cpu"], stats["tiers"]["nvme"]
        assert cpu["evictions"]["capacity"] > 0 and nvme["blocks"] > 0   # it did spill
        assert cpu["used_bytes"] <= cpu["capacity_bytes"]
        assert cpu["checksum_failures"] == 0 and nvme["checksum_failures"] == 0
        # nothing stuck pinned or lost to the policy: a new put takes every slot
        c = connect(d.socket)
        try:
            ns = c.register_layout(LAYOUT, "fresh")
            keys = block_keys(ns, np.arange(ARENA_BLOCKS * 64))
            data = [np.full(LAYOUT.block_bytes, i % 251, np.uint8) for i in range(ARENA_BLOCKS)]
            assert c.put(ns, keys, data) == ARENA_BLOCKS
            outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in range(ARENA_BLOCKS)]
            assert c.get(ns, keys, outs) == ARENA_BLOCKS
            assert all(np.array_equal(o, x) for o, x in zip(outs, data, strict=True))
        finally:
            c.close()
    finally:
        d.kill()
