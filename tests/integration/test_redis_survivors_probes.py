"""The Redis tier's prefix probes and byte accounting against a real redis-server, at edges
the mutation review found unpinned: a stripe one byte short is not whole, a head of
another namespace or one that can never be valid ends ``whole_prefix`` (counted), and
the bytes read and written count each frame's wire length exactly."""

from __future__ import annotations

from kvtier.frame import HEADER_SIZE, STRIPE_BYTES, STRIPED_MIN_BYTES
from kvtier.tiers.redis_stripes import part_keys
from tests.support.redis_servers import RedisServer
from tests.support.redis_tier import (
    NS,
    blocks,
    cfg_for,
    head_at,
    put_all,
    read_exact,
    rkey,
    running,
    stored_bytes,
)

LARGE = STRIPED_MIN_BYTES + STRIPE_BYTES   # a head and two stripes


async def test_a_stripe_one_byte_short_is_not_whole(redis_server: RedisServer) -> None:
    """``whole_prefix`` reads each stripe's last byte: a stripe cut by one byte (a value
    replaced by a shorter one) is no whole block, and the blocks before it still are
    (a synchronous commit would otherwise promise a chain no get can read)."""
    keys, data = blocks(2, LARGE, seed=5)
    admin = redis_server.client()
    async with running(cfg_for(redis_server.url, op_timeout_s=5.0)) as tier:
        await put_all(tier, keys, data)
        assert await tier.whole_prefix(keys, namespace=NS) == 2
        last = part_keys(rkey(keys[1]), head_at(admin, keys[1]))[-1]
        admin.set(last, stored_bytes(admin.get(last))[:-1])
        assert await tier.whole_prefix(keys, namespace=NS) == 1


async def test_whole_prefix_stops_at_a_head_of_another_namespace_and_counts_it(
        redis_server: RedisServer) -> None:
    """A sound head of another namespace is no block of this one: the prefix ends there
    and the mismatch is counted (as a lookup's probe counts it)."""
    keys, data = blocks(3, 4096, seed=6)
    async with running(cfg_for(redis_server.url)) as tier:
        await put_all(tier, keys, data)
        assert await tier.whole_prefix(keys, namespace=NS) == 3
        assert tier.namespace_mismatches == 0
        assert await tier.whole_prefix(keys, namespace=bytes(reversed(NS))) == 0
        assert tier.namespace_mismatches == 1
        assert await tier.exists_prefix(keys, namespace=bytes(reversed(NS))) == 0
        assert tier.namespace_mismatches == 2


async def test_bytes_read_and_written_count_each_frames_wire_length(
        redis_server: RedisServer) -> None:
    """``bytes_written``/``bytes_read`` (the tier's traffic counters, exported) add each
    frame's header and payload once: a read or a write not counted under-reports the
    tier's traffic to operators."""
    keys, data = blocks(3, 4096, seed=7)
    async with running(cfg_for(redis_server.url)) as tier:
        await put_all(tier, keys, data)
        assert tier.counters.bytes_written == 3 * (HEADER_SIZE + 4096)
        await read_exact(tier, keys, data, 4096)
        assert tier.counters.bytes_read == 3 * (HEADER_SIZE + 4096)
