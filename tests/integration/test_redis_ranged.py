"""Large blocks stored whole (as kvtier wrote them before striping) read from a real
redis-server in parallel ranges (kvtier.tiers.redis_ranged): exact bytes, the verified
checksum handed on, and every way a ranged read can go wrong ending as a plain GET would
(corrupt frames deleted and zeroed, foreign ones left alone, compressed ones read whole).
Striped blocks, what kvtier writes now: tests/integration/test_redis_stripes.py."""

from __future__ import annotations

import dataclasses

from kvtier import codec as codecs
from kvtier.frame import HEADER_SIZE, Codec, FrameHeader, encode_frame, make_header
from kvtier.tiers.redis_ranged import RANGE_PART_BYTES, RANGED_MIN_BYTES, ranged
from tests.support.redis_servers import RedisServer
from tests.support.redis_tier import (
    LAYOUT_FP,
    NS,
    blocks,
    buffers,
    cfg_for,
    read_exact,
    running,
    stored_bytes,
)

SIZE = RANGED_MIN_BYTES + 3 * RANGE_PART_BYTES // 2 + 4096   # ranges of unequal sizes


def rkey(key: bytes) -> bytes:
    return b"kvtier:" + key.hex().encode()


def put_whole(server: RedisServer, keys: list[bytes], data: list[bytes],
              codec: Codec = Codec.NONE) -> None:
    """Store each block as one frame under its key, as kvtier did before striping."""
    admin = server.client()
    for key, raw in zip(keys, data, strict=True):
        body = raw if codec is Codec.NONE else codecs.encode(codec, memoryview(raw), 2)
        header = make_header(NS, key, LAYOUT_FP, body, raw_len=len(raw), codec=codec)
        admin.set(rkey(key), encode_frame(header, body))


async def test_large_blocks_round_trip_in_ranges(redis_server: RedisServer) -> None:
    assert ranged(SIZE) and not ranged(RANGED_MIN_BYTES - 1)
    keys, data = blocks(3, size=SIZE, seed=7)
    admin = redis_server.client()
    async with running(cfg_for(redis_server.url, op_timeout_s=10.0)) as tier:
        put_whole(redis_server, keys, data)
        admin.config_resetstat()
        await read_exact(tier, keys, data, SIZE)
        calls = admin.info("commandstats")
        parts = -(-SIZE // RANGE_PART_BYTES)
        assert calls["cmdstat_getrange"]["calls"] == 3 * (1 + parts)   # header + ranges
        assert "cmdstat_get" not in calls                  # no whole-value GET
        assert tier.counters.checksum_failures == 0
        # a missing block ends the run there, with nothing written into its buffer
        missing = buffers(1, SIZE)
        assert await tier.get_into([b"\x01" * 16], missing, namespace=NS,
                                   layout_fp=LAYOUT_FP) == 0
        assert bytes(missing[0]) == bytes(SIZE)


async def test_a_corrupt_large_frame_is_zeroed_counted_and_deleted(
        redis_server: RedisServer) -> None:
    keys, data = blocks(1, size=SIZE, seed=8)
    admin = redis_server.client()
    async with running(cfg_for(redis_server.url, op_timeout_s=10.0)) as tier:
        put_whole(redis_server, keys, data)
        admin.setrange(rkey(keys[0]), HEADER_SIZE + SIZE - 10, b"\xff\x00\xff")  # the tail
        out = buffers(1, SIZE)
        assert await tier.get_into(keys, out, namespace=NS, layout_fp=LAYOUT_FP) == 0
        assert bytes(out[0]) == bytes(SIZE)                 # nothing unverified left behind
        assert not admin.exists(rkey(keys[0]))
        assert tier.counters.checksum_failures == 1


async def test_a_frame_of_another_namespace_is_left_alone(redis_server: RedisServer) -> None:
    keys, data = blocks(1, size=SIZE, seed=9)
    admin = redis_server.client()
    async with running(cfg_for(redis_server.url, op_timeout_s=10.0)) as tier:
        put_whole(redis_server, keys, data)
        frame = stored_bytes(admin.get(rkey(keys[0])))
        header = FrameHeader.unpack(frame[:HEADER_SIZE])
        other = dataclasses.replace(header, namespace=bytes(16))
        admin.set(rkey(keys[0]), FrameHeader.pack(other) + frame[HEADER_SIZE:])
        out = buffers(1, SIZE)
        assert await tier.get_into(keys, out, namespace=NS, layout_fp=LAYOUT_FP) == 0
        assert admin.exists(rkey(keys[0]))                  # another tenant's: kept
        assert tier.namespace_mismatches == 1 and tier.counters.checksum_failures == 0


async def test_a_compressed_large_frame_is_read_whole(redis_server: RedisServer) -> None:
    keys, data = blocks(2, size=SIZE, seed=10)
    async with running(cfg_for(redis_server.url, op_timeout_s=10.0)) as tier:
        put_whole(redis_server, keys, data, Codec.SHUFFLE_LZ4)
        outs = buffers(2, SIZE)
        assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 2
        assert [bytes(o) for o in outs] == data
