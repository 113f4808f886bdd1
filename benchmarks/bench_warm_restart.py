"""Warm restart, side by side in one run on this machine.

1. Put and get throughput of a daemon that journals its arena (cpu.warm_restart = true, the
   default) vs one that does not (ratio; the journal's cost on the request path);
2. after kill -9 with the arena full: blocks served again and time from restart to the first
   served get, warm (arena adopted) vs cold (arena removed, nvme only).

Usage: python benchmarks/bench_warm_restart.py [--block-kib 256] [--cpu-mib 256] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess


def layout_for(block_bytes: int) -> KVLayout:
    return KVLayout(8, 8, 128, "float16", tokens_per_block=block_bytes // (32 * 1024))


def one_round(d: DaemonProcess, layout: KVLayout, n: int, r: int) -> tuple[float, float]:
    """(puts/s, gets/s) in blocks for ``n`` fresh blocks (deleted afterwards)."""
    c = connect(d.socket)
    ns = c.register_layout(layout, "bench")
    src = [np.full(layout.block_bytes, i % 251, np.uint8) for i in range(n)]
    dst = [np.ones(layout.block_bytes, np.uint8) for _ in range(n)]
    keys = block_keys(ns, np.arange(n * layout.tokens_per_block) + r * 10**7)
    t = time.perf_counter()
    assert c.put(ns, keys, src) == n
    put = n / (time.perf_counter() - t)
    t = time.perf_counter()
    assert c.get(ns, keys, dst) == n
    get = n / (time.perf_counter() - t)
    c.delete(ns, keys)
    c.close()
    return put, get


def restart(d: DaemonProcess, layout: KVLayout, n: int, *, warm: bool) -> tuple[int, float]:
    """Fill, kill -9, restart: (blocks served again, seconds from restart to first get)."""
    c = connect(d.socket)
    ns = c.register_layout(layout, "bench")
    base = (7 if warm else 9) * 10**8 + 10**9
    keys = block_keys(ns, np.arange(n * layout.tokens_per_block) + base)
    assert c.put(ns, keys, [np.full(layout.block_bytes, 3, np.uint8)] * n) == n
    c.close()
    time.sleep(0.5)   # let the journal's checksums land
    (d.crash if warm else d.kill)()
    t = time.perf_counter()
    d.start()
    c = connect(d.socket)
    ns = c.register_layout(layout, "bench")
    out = [np.zeros(layout.block_bytes, np.uint8)]
    c.get(ns, keys[:1], out)
    first = time.perf_counter() - t
    served = c.lookup(ns, keys, prefetch=False).hits
    c.close()
    return served, first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--cpu-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    layout = layout_for(args.block_kib * 1024)
    n = args.cpu_mib * 1024 // args.block_kib // 2   # half the arena per round
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        root = Path(tmp)
        on = DaemonProcess(root / "on", cpu_bytes=f"{args.cpu_mib}MiB", nvme_bytes="4GiB").start()
        off = DaemonProcess(root / "off", cpu_bytes=f"{args.cpu_mib}MiB", nvme_bytes="4GiB",
                            env={"KVTIER_CPU_WARM_RESTART": "false"}).start()
        try:
            runs: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
            for r in range(args.rounds):   # interleaved, so drift hits both alike
                runs["on"].append(one_round(on, layout, n, 2 * r))
                runs["off"].append(one_round(off, layout, n, 2 * r + 1))
            put_on, get_on = (statistics.median(x) for x in zip(*runs["on"], strict=True))
            put_off, get_off = (statistics.median(x) for x in zip(*runs["off"], strict=True))
            print(f"{n} blocks of {args.block_kib} KiB per round, median of {args.rounds}")
            print(f"{'':24}{'journal':>12}{'no journal':>12}{'ratio':>8}")
            print(f"{'put blocks/s':24}{put_on:12.0f}{put_off:12.0f}{put_on / put_off:8.2f}")
            print(f"{'get blocks/s':24}{get_on:12.0f}{get_off:12.0f}{get_on / get_off:8.2f}")
            fill = n * 2 - 2
            warm = restart(on, layout, fill, warm=True)
            cold = restart(on, layout, fill, warm=False)
            print(f"\nkill -9 with {fill} blocks in the arena (cpu only, never written to nvme)")
            print(f"{'':24}{'warm':>12}{'cold':>12}")
            print(f"{'blocks served again':24}{warm[0]:12d}{cold[0]:12d}")
            print(f"{'restart -> first get ms':24}{warm[1] * 1000:12.0f}{cold[1] * 1000:12.0f}")
        finally:
            on.kill()
            off.kill()


if __name__ == "__main__":
    main()
