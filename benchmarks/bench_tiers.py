"""Issue 2's side-by-side numbers, measured in one run on this machine.

1. client -> daemon put and get of 1 MiB and 4 MiB blocks from another process (this one;
   the daemon runs as a subprocess) vs numpy copyto of the same bytes between the same kind
   of buffers (ratio; target >= 0.7);
2. the median time to look up a 32,768-token prompt (hashing + one lookup round trip +
   index walk; target < 1 ms);
3. the nvme tier's write/read vs plain os.pwrite/os.pread of the same bytes with the same
   flags (ratio; target >= 0.7), from benchmarks/bench_nvme.py.

Usage: python benchmarks/bench_tiers.py [--mib 256] [--rounds 5] [--nvme-root DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess


def _layout_for(block_bytes: int) -> KVLayout:
    # 8 layers x K/V x 8 heads x 128 dim x fp16 = 32 KiB per token
    return KVLayout(8, 8, 128, "float16", tokens_per_block=block_bytes // (32 * 1024))


def bench_client(sock: Path, block_bytes: int, total: int, rounds: int) -> dict[str, float]:
    layout = _layout_for(block_bytes)
    assert layout.block_bytes == block_bytes
    n = max(4, total // block_bytes)
    c = connect(sock)
    ns = c.register_layout(layout, "bench")
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(n)]
    dst = [np.ones(block_bytes, np.uint8) for _ in range(n)]  # touched
    put_t, get_t, cpy_t = [], [], []
    for r in range(rounds):
        keys = block_keys(ns, np.arange(n * layout.tokens_per_block) + r * 10**7)
        t = time.perf_counter()
        for a, b in zip(dst, src, strict=True):
            np.copyto(a, b)
        cpy_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        stored = c.put(ns, keys, src)
        put_t.append(time.perf_counter() - t)
        assert stored == n, f"stored {stored} of {n}: enlarge the arena"
        t = time.perf_counter()
        got = c.get(ns, keys, dst)
        get_t.append(time.perf_counter() - t)
        assert got == n and np.array_equal(dst[-1], src[-1])
        c.delete(ns, keys)
    c.close()
    gb = n * block_bytes / 1e9
    return {"block": block_bytes, "n": n, "memcpy": gb / statistics.median(cpy_t),
            "put": gb / statistics.median(put_t), "get": gb / statistics.median(get_t)}


def bench_lookup(sock: Path, reps: int = 300) -> dict[str, float]:
    layout = KVLayout(32, 8, 128, "bfloat16", 256)  # Llama-3-8B geometry, 256-token blocks
    c = connect(sock)
    ns = c.register_layout(layout, "bench-lookup")
    prompt = np.random.default_rng(1).integers(0, 128_000, 32_768)
    keys = block_keys(ns, prompt)
    c.lookup(ns, keys)
    hash_t, total_t = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        keys = block_keys(ns, prompt)
        t1 = time.perf_counter()
        c.lookup(ns, keys, prefetch=False)
        t2 = time.perf_counter()
        hash_t.append(t1 - t0)
        total_t.append(t2 - t0)
    c.close()
    return {"blocks": len(keys), "hash_ms": statistics.median(hash_t) * 1e3,
            "lookup_ms": statistics.median(total_t) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=256, help="bytes moved per round (MiB)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nvme-root", default="/var/tmp", help="a directory on the real disk")
    a = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-"))
    d = DaemonProcess(root, cpu_bytes=f"{a.mib + 128}MiB", nvme_bytes="0").start()
    try:
        print(f"client <-> daemon through shared memory ({a.mib} MiB per round, median of "
              f"{a.rounds}; daemon pid {d.proc.pid if d.proc else '?'})")
        print(f"{'block':>7} {'memcpy GB/s':>12} {'put GB/s':>9} {'put/memcpy':>11} "
              f"{'get GB/s':>9} {'get/memcpy':>11}")
        for size in (1 << 20, 4 << 20):
            r = bench_client(d.socket, size, a.mib << 20, a.rounds)
            print(f"{size >> 20:>5}Mi {r['memcpy']:>12.2f} {r['put']:>9.2f} "
                  f"{r['put'] / r['memcpy']:>11.2f} {r['get']:>9.2f} "
                  f"{r['get'] / r['memcpy']:>11.2f}")
        lk = bench_lookup(d.socket)
        print(f"\nlookup of a 32,768-token prompt ({lk['blocks']} blocks of 256 tokens): "
              f"median {lk['lookup_ms']:.3f} ms (hashing {lk['hash_ms']:.3f} ms); "
              "target < 1 ms")
    finally:
        d.kill()
        shutil.rmtree(root, ignore_errors=True)
    try:
        from bench_nvme import format_table, run_nvme_bench
    except ImportError as exc:  # pragma: no cover
        print(f"\nnvme benchmark unavailable: {exc}")
        return 0
    nroot = Path(tempfile.mkdtemp(prefix="kvtier-bench-nvme-", dir=a.nvme_root))
    try:
        print("\nnvme tier vs plain os.pwrite/os.pread (same bytes, flags, buffers)")
        print(format_table(run_nvme_bench(nroot)))
    finally:
        shutil.rmtree(nroot, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
