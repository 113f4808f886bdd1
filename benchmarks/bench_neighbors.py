"""What one client's long requests cost another client of the same daemon, in one run.

A real ``kvtier serve`` daemon (subprocess). A second process pings it over its own
connection every 0.5 ms, first while the daemon is idle, then while a greedy client runs
rounds of put, lookup, get and delete of one long chain (``--blocks`` blocks of
``--tokens-per-block`` tokens: at 8192 x 16 tokens, the most one request may name at the
defaults). Printed: the ping's median, p99 and worst round trip in both phases and the
busy / idle ratios. The daemon takes turns inside long requests (``kvtier.store.slices``);
what is left is the work still done in one piece (docs/architecture.md, "Long requests
take turns") and the two cores the processes share.

Usage: python benchmarks/bench_neighbors.py [--blocks 8192] [--tokens-per-block 16]
       [--rounds 4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

PING_GAP_S = 0.0005


Pings = list[tuple[float, float]]


def pinger(socket_path: Path, stop: Event, out: Queue[Pings]) -> None:
    """Ping until ``stop``; the (sent at, round trip) of each, through ``out``."""
    with connect(socket_path) as c:
        pings: Pings = []
        while not stop.is_set():
            t = time.perf_counter()
            c.ping()
            pings.append((t, time.perf_counter() - t))
            time.sleep(PING_GAP_S)
    out.put(pings)


def _row(name: str, rtts: list[float]) -> tuple[float, float, float]:
    rtts = sorted(rtts)
    p50, p99, worst = (statistics.median(rtts), rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))],
                       rtts[-1])
    print(f"{name:>24} {p50 * 1e3:8.3f} {p99 * 1e3:8.3f} {worst * 1e3:8.3f} {len(rtts):>7}")
    return p50, p99, worst


def run(blocks: int, tokens_per_block: int, rounds: int) -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16",
                      tokens_per_block=tokens_per_block)
    arena = max(256 << 20, 2 * blocks * layout.block_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        d = DaemonProcess(Path(tmp) / "d", cpu_bytes=str(arena), nvme_bytes="0").start()
        try:
            c = connect(d.socket)
            ns = c.register_layout(layout, "bench")
            data = np.random.default_rng(0).integers(0, 255, layout.block_bytes, np.uint8)
            outs = [np.empty(layout.block_bytes, np.uint8) for _ in range(blocks)]
            stop = mp.Event()
            q: Queue[Pings] = mp.Queue()
            ping = mp.Process(target=pinger, args=(d.socket, stop, q))
            ping.start()
            time.sleep(1.0)
            busy_from = time.perf_counter()
            ops: dict[str, list[float]] = {"put": [], "lookup": [], "get": [], "delete": []}
            for r in range(rounds):
                tokens = np.arange(r * blocks * tokens_per_block,
                                   (r + 1) * blocks * tokens_per_block)
                keys = block_keys(ns, tokens)
                t0 = time.perf_counter()
                lease = c.prepare_put(ns, keys)
                for view in lease.views:
                    assert view is not None
                    view[:] = data
                assert lease.commit() == blocks
                t1 = time.perf_counter()
                assert c.lookup(ns, keys).hits == blocks
                t2 = time.perf_counter()
                assert c.get(ns, keys, outs) == blocks
                t3 = time.perf_counter()
                c.delete(ns, keys)
                t4 = time.perf_counter()
                for name, s in zip(ops, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    ops[name].append(s)
            busy_to = time.perf_counter()
            stop.set()
            pings = q.get(timeout=30)
            ping.join(10)
            c.close()
        finally:
            d.kill()
    print(f"{blocks} blocks of {tokens_per_block} tokens ({layout.block_bytes >> 10} KiB) per "
          f"request, {rounds} rounds; greedy client's medians: "
          + ", ".join(f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in ops.items()))
    print(f"{'another client pings':>24} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'pings':>7}")
    idle = _row("daemon idle", [r for t, r in pings if t < busy_from])
    busy = _row("during the long requests",
                [r for t, r in pings if busy_from <= t < busy_to])
    print(f"{'busy / idle':>24} {busy[0] / idle[0]:8.1f} {busy[1] / idle[1]:8.1f} "
          f"{busy[2] / idle[2]:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=8192)
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    run(args.blocks, args.tokens_per_block, args.rounds)


if __name__ == "__main__":
    main()
