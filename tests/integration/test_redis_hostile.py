"""Hostile values in a real redis-server: frames whose headers are sound (their checksums
hold) but whose lengths or payloads were made to hurt the reader. Each is a counted miss
that costs about the block's own size: never an allocation of what a header or a zstd
frame claims, an exception out of the tier, thousands of DELs for one planted head, or
half-decoded bytes in the caller's buffer. (Misbehaving servers, scripted:
tests/unit/test_redis_hostile.py.)"""

from __future__ import annotations

import os
import struct

import pytest
import zstandard

from kvtier.frame import FLAG_STRIPED, STRIPE_BYTES, STRIPED_MIN_BYTES, Codec, FrameHeader
from kvtier.frame import payload_checksum as checksum
from kvtier.layout import KVLayout
from kvtier.tiers import redis_reads
from kvtier.tiers.redis import RedisTier
from tests.support.memory import peak_bytes
from tests.support.redis_servers import RedisServer
from tests.support.redis_tier import (
    LAYOUT_FP,
    NS,
    blocks,
    cfg_for,
    put_all,
    read_exact,
    running,
    stored_bytes,
)

BLOCK = 64 << 10
LARGE = STRIPED_MIN_BYTES            # read through a header first (ranges, stripes)
CLAIM = 32 << 20                     # what a planted header says its payload is


def rkey(key: bytes) -> bytes:
    return b"kvtier:" + key.hex().encode()


def header(key: bytes, payload_len: int, raw_len: int, csum: int, codec: Codec = Codec.NONE,
           flags: int = 0) -> bytes:
    return FrameHeader(NS, key, LAYOUT_FP, payload_len, raw_len, csum, codec,
                       flags=flags).pack()


def shuffled(planes: list[tuple[int, bytes]], tail: bytes = b"") -> bytes:
    """A shuffle payload of 2-byte elements from (mode, blob) planes."""
    table = b"".join(struct.pack("<BI", mode, len(blob)) for mode, blob in planes)
    return bytes([len(planes)]) + table + b"".join(blob for _, blob in planes) + tail


def buffer(size: int) -> memoryview:
    """A block buffer holding 0xAA bytes (so that what a read leaves in it shows)."""
    return memoryview(bytearray(b"\xaa" * size))


async def read(tier: RedisTier, key: bytes, out: memoryview) -> int:
    return await tier.get_into([key], [out], namespace=NS, layout_fp=LAYOUT_FP)


# --- finding 1: a zstd frame that declares more than its plane -----------------------------

async def test_a_zstd_bomb_is_a_counted_miss_without_its_allocation(
        redis_server: RedisServer) -> None:
    """A 1 KiB plane declaring 32 MiB, in a frame whose checksums hold."""
    count = BLOCK // 2
    bomb = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(bytes(CLAIM))
    payload = shuffled([(1, bomb), (0, bytes(count))])
    key = os.urandom(16)
    redis_server.client().set(rkey(key), header(key, len(payload), BLOCK, checksum(payload),
                                                Codec.SHUFFLE_ZSTD) + payload)
    async with running(cfg_for(redis_server.url)) as tier:
        out = buffer(BLOCK)
        with peak_bytes() as peak:
            got = await read(tier, key, out)
        assert peak[0] < 4 << 20
        assert got == 0 and tier.counters.checksum_failures == 1
        assert out == bytes(BLOCK)
    assert not redis_server.client().exists(rkey(key))


# --- finding 2: a payload_len no codec produces from raw_len ------------------------------

@pytest.mark.parametrize("codec", [Codec.NONE, Codec.LZ4], ids=["none", "lz4"])
async def test_a_payload_longer_than_its_codec_makes_is_corrupt_before_it_is_received(
        redis_server: RedisServer, codec: Codec) -> None:
    """A 64 KiB block whose frame holds 32 MiB: not received into a 32 MiB scratch."""
    key = os.urandom(16)
    redis_server.client().set(rkey(key), header(key, CLAIM, BLOCK, 0, codec) + bytes(CLAIM))
    async with running(cfg_for(redis_server.url)) as tier:
        out = buffer(BLOCK)
        with peak_bytes() as peak:
            got = await read(tier, key, out)
        assert peak[0] < 4 << 20
        assert got == 0 and tier.counters.checksum_failures == 1
        assert out == b"\xaa" * BLOCK   # nothing was placed in it
    assert not redis_server.client().exists(rkey(key))


async def test_a_striped_head_claiming_a_huge_payload_is_corrupt_before_any_stripe(
        redis_server: RedisServer) -> None:
    """A striped LZ4 head of an 8 MiB block that says its payload is 32 MiB (one 4 MiB
    stripe stored): no 32 MiB scratch, no stripe read."""
    key = os.urandom(16)
    redis_server.client().set(rkey(key), header(key, CLAIM, LARGE, 0, Codec.LZ4, FLAG_STRIPED)
                              + bytes(STRIPE_BYTES))
    async with running(cfg_for(redis_server.url)) as tier:
        out = buffer(LARGE)
        with peak_bytes() as peak:
            got = await read(tier, key, out)
        assert peak[0] < 4 << 20
        assert got == 0 and tier.counters.checksum_failures == 1
        assert tier.counters.errors == 0
    assert not redis_server.client().exists(rkey(key))


async def test_an_exception_inside_a_large_read_is_an_error_not_the_callers(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """What escaped get_into before (a MemoryError allocating a claimed payload) is now an
    error read: counted, a miss."""
    async def fail(*_args: object) -> object:
        raise MemoryError("no room for the payload")

    monkeypatch.setattr(redis_reads, "fetch_ranged", fail)
    async with running(cfg_for(redis_server.url)) as tier:
        assert await read(tier, os.urandom(16), buffer(LARGE)) == 0
        assert tier.counters.errors == 1
        assert "MemoryError" in tier.last_error and tier.up


# --- finding 5: a planted striped head names thousands of stripe keys ---------------------

def del_calls(server: RedisServer) -> int:
    stats = server.client().info("commandstats")
    return int(stats.get("cmdstat_del", {}).get("calls", 0))


@pytest.mark.parametrize("known", [True, False], ids=["layout-known", "layout-unknown"])
async def test_a_delete_takes_stripes_along_only_for_a_sound_head(
        redis_server: RedisServer, known: bool) -> None:
    """Heads planted (header checksums hold) that name 16383 stripes each: with the
    namespace's layout known, a raw_len that is not its block's; without it, a payload
    its codec cannot make from raw_len. Deleted alone, one DEL each; a block the tier
    wrote itself still goes with its stripes."""
    layout = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, dtype="float16",
                      tokens_per_block=128)   # 8 MiB blocks: striped
    assert layout.block_bytes == LARGE
    admin = redis_server.client()
    async with running(cfg_for(redis_server.url, op_timeout_s=10.0)) as tier:
        if known:
            tier.use_layouts(lambda ns: layout if ns == NS else None)
        planted = [os.urandom(16) for _ in range(2)]
        for key in planted:
            head = (header(key, 1 << 36, 1 << 36, 0, Codec.NONE, FLAG_STRIPED) if known
                    else header(key, 1 << 36, LARGE, 0, Codec.LZ4, FLAG_STRIPED))
            admin.set(rkey(key), head)
        keys, data = blocks(1, size=LARGE, seed=5)
        await put_all(tier, keys, data)
        seq = FrameHeader.unpack(stored_bytes(admin.getrange(rkey(keys[0]), 0, 95))).seq
        assert admin.exists(rkey(keys[0]) + b":%016x:1" % seq)
        admin.config_resetstat()
        assert await tier.delete(planted + keys, namespace=NS) == 3
        assert del_calls(redis_server) == 4   # three heads and the real block's one stripe
        assert not admin.keys(b"kvtier:*")


# --- finding 7: a payload that fails to decode leaves nothing of it behind ----------------

async def test_a_payload_that_fails_half_way_through_decoding_leaves_zeros(
        redis_server: RedisServer) -> None:
    """Plane 0 of a shuffled payload decodes (into the caller's buffer), plane 1 does not:
    the buffer holds zeros afterwards, not plane 0's bytes."""
    count = BLOCK // 2
    payload = shuffled([(0, os.urandom(count)), (1, b"\xff" * 10)])
    key = os.urandom(16)
    redis_server.client().set(rkey(key), header(key, len(payload), BLOCK, checksum(payload),
                                                Codec.SHUFFLE_LZ4) + payload)
    async with running(cfg_for(redis_server.url)) as tier:
        out = buffer(BLOCK)
        assert await read(tier, key, out) == 0
        assert tier.counters.checksum_failures == 1 and out == bytes(BLOCK)


async def test_a_striped_payload_that_fails_half_way_through_decoding_leaves_zeros(
        redis_server: RedisServer) -> None:
    """The same for a striped block: head (stripe 0, plane 0) and stripe 1 stored, their
    checksum sound, plane 1 malformed."""
    count = LARGE // 2
    payload = shuffled([(0, os.urandom(count)), (1, b"\xff" * 10)])
    key = os.urandom(16)
    admin = redis_server.client()
    admin.set(rkey(key) + b":1", payload[STRIPE_BYTES:])
    admin.set(rkey(key), header(key, len(payload), LARGE, checksum(payload), Codec.SHUFFLE_LZ4,
                                FLAG_STRIPED) + payload[:STRIPE_BYTES])
    async with running(cfg_for(redis_server.url, op_timeout_s=10.0)) as tier:
        out = buffer(LARGE)
        assert await read(tier, key, out) == 0
        assert tier.counters.checksum_failures == 1 and out == bytes(LARGE)
    assert not admin.keys(b"kvtier:*")


async def test_a_value_of_another_type_under_the_prefix_is_a_miss_not_a_down_tier(
        redis_server: RedisServer) -> None:
    """A list planted where a chain's first block would be: every probe of that chain met
    WRONGTYPE, which counted as a server failure, so three probes in a row took the tier
    down (and every other prompt's hits with it) again and again. It is a miss for that
    key, the key is deleted as corrupt, and the tier stays up."""
    admin = redis_server.client()
    keys, data = blocks(4, size=4096, seed=7)
    planted = blocks(1, size=4096, seed=8)[0][0]
    async with running(cfg_for(redis_server.url)) as tier:
        await put_all(tier, keys, data)
        admin.rpush(rkey(planted), b"x")
        for _ in range(5):
            assert await tier.exists_prefix([planted, *keys], namespace=NS) == 0
        assert tier.up and tier.counters.errors >= 1
        assert not admin.exists(rkey(planted))              # deleted as corrupt
        assert await tier.exists_prefix(keys, namespace=NS) == 4
        await read_exact(tier, keys, data, 4096)


# --- round 8: frames that can never be valid for their key (phantoms) ---------------------

SMALL_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16",
                        tokens_per_block=64)   # 64 KiB blocks: never striped


def planted(frame: bytes, **changes: object) -> bytes:
    """``frame`` with header fields changed (its header checksum made to hold again)."""
    head = FrameHeader.unpack(frame[:96])
    fields = {name: getattr(head, name) for name in FrameHeader.__slots__}
    fields.update(changes)
    return FrameHeader(**fields).pack() + frame[96:]


@pytest.mark.parametrize("change", ["striped", "raw_len"])
async def test_a_frame_that_can_never_be_valid_for_its_key_is_corrupt_and_deleted(
        redis_server: RedisServer, change: str) -> None:
    """A sound header (its checksum holds) of this namespace, key and layout that kvtier
    never writes: a striped flag on a 64 KiB block (only blocks of 8 MiB or more are
    striped), or a raw_len (1 GiB, LZ4) other than the namespace's block size. Before, the
    GET called the first MISSING and the second the caller's fault (NOFIT): neither was
    counted as corrupt nor deleted, so every lookup (which reads the namespace field)
    said hit and every get missed, for good. Now: corrupt, counted, deleted, one miss."""
    assert SMALL_LAYOUT.block_bytes == BLOCK
    admin = redis_server.client()
    keys, data = blocks(2, size=BLOCK, seed=11)
    async with running(cfg_for(redis_server.url)) as tier:
        tier.use_layouts(lambda ns: SMALL_LAYOUT if ns == NS else None)
        await put_all(tier, keys, data)
        frame = admin.get(rkey(keys[0]))
        assert isinstance(frame, bytes)
        head = FrameHeader.unpack(frame[:96])
        admin.set(rkey(keys[0]), planted(frame, flags=head.flags | FLAG_STRIPED)
                  if change == "striped" else
                  planted(frame, raw_len=1 << 30, codec=Codec.LZ4))
        assert await tier.exists_prefix(keys, namespace=NS) == 2   # the probe reads ns only
        assert await tier.whole_prefix(keys, namespace=NS) == 0    # a header read: not whole
        out = buffer(BLOCK)
        assert await read(tier, keys[0], out) == 0
        assert out == b"\xaa" * BLOCK   # nothing was placed in it
        assert tier.counters.checksum_failures == 1
        assert tier.counters.evictions["corrupt"] == 1
        assert not admin.exists(rkey(keys[0]))
        assert await tier.exists_prefix(keys, namespace=NS) == 0   # no phantom hit left
        await read_exact(tier, keys[1:], data[1:], BLOCK)


async def test_a_frame_of_another_size_with_an_unknown_layout_is_left_alone(
        redis_server: RedisServer) -> None:
    """Without the namespace's layout the tier cannot tell a wrong frame from a wrong
    buffer: a miss, counted as an error (the caller's buffer may be wrong), not deleted;
    nor is another namespace's frame, whatever its size."""
    admin = redis_server.client()
    keys, data = blocks(1, size=BLOCK, seed=12)
    async with running(cfg_for(redis_server.url)) as tier:
        await put_all(tier, keys, data)
        frame = admin.get(rkey(keys[0]))
        assert isinstance(frame, bytes)
        admin.set(rkey(keys[0]), planted(frame, raw_len=1 << 30, codec=Codec.LZ4))
        assert await read(tier, keys[0], buffer(BLOCK)) == 0
        assert tier.counters.checksum_failures == 0 and tier.counters.errors == 1
        assert admin.exists(rkey(keys[0]))
        tier.use_layouts(lambda ns: SMALL_LAYOUT if ns == NS else None)
        other = bytes(16)
        admin.set(rkey(keys[0]), planted(frame, namespace=other, raw_len=1 << 30,
                                         codec=Codec.LZ4))
        assert await read(tier, keys[0], buffer(BLOCK)) == 0
        assert tier.namespace_mismatches == 1 and tier.counters.checksum_failures == 0
        assert admin.exists(rkey(keys[0]))
