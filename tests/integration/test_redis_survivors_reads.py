"""Reads of the Redis tier against a real redis-server, at edges the mutation review found
unpinned: what a read hands on besides the bytes (a verified checksum only where it is
the block's own), and what a lost stripe or a corrupt frame leaves behind."""

from __future__ import annotations

import pytest

from kvtier.frame import STRIPE_BYTES, STRIPED_MIN_BYTES, encode_frame, make_header
from kvtier.tiers.base import EvictionReason
from kvtier.tiers.redis_stripes import part_keys
from tests.support.redis_servers import RedisServer
from tests.support.redis_tier import (
    LAYOUT_FP,
    NS,
    blocks,
    buffers,
    cfg_for,
    head_at,
    put_all,
    rkey,
    running,
)

LARGE = STRIPED_MIN_BYTES + STRIPE_BYTES   # a head and two stripes


@pytest.mark.parametrize("size", [64 << 10, LARGE], ids=["whole", "striped"])
async def test_a_compressed_block_hands_on_no_checksum(redis_server: RedisServer,
                                                       size: int) -> None:
    """A compressed frame's checksum is the encoded payload's, not the block's: handed on,
    the arena journal would record a number no read of the block can ever match (its
    entry judged corrupt at the next restart). The bytes are exact; the checksum None."""
    keys, data = blocks(2, size, seed=3)
    async with running(cfg_for(redis_server.url, codec="lz4", op_timeout_s=5.0)) as tier:
        await put_all(tier, keys, data)
        outs = buffers(2, size)
        sums: list[int | None] = [1, 1]
        got = await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP,
                                  checksums=sums)
        assert got == 2 and [bytes(o) for o in outs] == data
        assert sums == [None, None]


async def test_a_lost_stripe_takes_the_head_and_its_other_stripes(
        redis_server: RedisServer) -> None:
    """A stripe evicted under its head: the read misses, zeroes nothing it did not verify,
    and deletes the head and the remaining stripes (a head left would be a lookup hit
    that every get misses; stripes left hold memory for good); counted as an eviction."""
    keys, data = blocks(1, LARGE, seed=4)
    admin = redis_server.client()
    async with running(cfg_for(redis_server.url, op_timeout_s=5.0)) as tier:
        await put_all(tier, keys, data)
        parts = part_keys(rkey(keys[0]), head_at(admin, keys[0]))
        assert len(parts) == 2
        admin.delete(parts[1])
        out = buffers(1, LARGE)
        assert await tier.get_into(keys, out, namespace=NS, layout_fp=LAYOUT_FP) == 0
        assert bytes(out[0][:4096]) == bytes(4096)
        assert admin.exists(rkey(keys[0]), *parts) == 0
        assert tier.counters.checksum_failures == 0
        assert tier.counters.evictions == {EvictionReason.EXPIRED.value: 1}


async def test_a_whole_large_frame_cut_short_leaves_no_ranged_bytes(
        redis_server: RedisServer) -> None:
    """A large block stored whole (an earlier kvtier) whose value lost its last byte: the
    ranges read all but the tail, the GET that decides then finds the value shorter than
    its header says (corrupt, judged before any payload is placed). What the ranges
    wrote was never verified: the buffer must be zeroed, not left holding it."""
    keys, data = blocks(1, LARGE, seed=14)
    header = make_header(NS, keys[0], LAYOUT_FP, data[0])
    admin = redis_server.client()
    admin.set(rkey(keys[0]), encode_frame(header, data[0])[:-1])
    async with running(cfg_for(redis_server.url, op_timeout_s=5.0)) as tier:
        out = buffers(1, LARGE)
        assert await tier.get_into(keys, out, namespace=NS, layout_fp=LAYOUT_FP) == 0
        assert bytes(out[0]) == bytes(LARGE)
        assert tier.counters.checksum_failures == 1 and not admin.exists(rkey(keys[0]))
