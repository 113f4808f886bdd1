"""Two versions of one striped block in Redis: a rewrite (a producer sending a block again
after a stripe was evicted, two nodes storing the same prefix) and a reader cleaning up
after the old version must never cost the new one (review of 2026-12-06: a reader that saw
the old head with a stripe missing deleted the head and the stripe keys a rewrite had just
stored, so a block every SET of which was answered OK was gone for every node)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

from kvtier.checksum import header_for
from kvtier.frame import FLAG_STRIPE_TAG, FLAG_STRIPED, STRIPE_BYTES, FrameHeader
from kvtier.tiers import redis_stripes
from kvtier.tiers.redis_blocks import BlockRead
from tests.support.redis_servers import RedisServer
from tests.support.redis_tier import (
    ACL_RULE,
    LAYOUT_FP,
    NS,
    blocks,
    buffers,
    cfg_for,
    head_at,
    put_all,
    read_exact,
    rkey,
    running,
    stored_bytes,
)

if TYPE_CHECKING:
    from kvtier.tiers.redis_reads import RedisReads

SIZE = 3 * STRIPE_BYTES   # three stripes: a head (stripe 0) and two more


async def test_each_write_names_its_stripes_after_its_own_tag(
        redis_server: RedisServer) -> None:
    """A block stored twice: two tags, and the first version's stripes are deleted once the
    second's head is in (no orphan holds the server's memory)."""
    admin = redis_server.client()
    keys, first = blocks(1, size=SIZE, seed=41)
    _, second = blocks(1, size=SIZE, seed=42)
    async with running(cfg_for(redis_server.url, op_timeout_s=10.0)) as tier:
        await put_all(tier, keys, first)
        old = head_at(admin, keys[0])
        assert old.flags & FLAG_STRIPED and old.flags & FLAG_STRIPE_TAG
        assert sorted(admin.keys(rkey(keys[0]) + b":*")) == [
            rkey(keys[0]) + b":%016x:%d" % (old.seq, i) for i in (1, 2)]
        await put_all(tier, keys, second)
        new = head_at(admin, keys[0])
        assert new.seq != old.seq
        assert admin.dbsize() == 3                       # the head and the new stripes only
        await read_exact(tier, keys, second, SIZE)


@pytest.mark.parametrize("head_landed", [True, False])
async def test_a_reader_cleaning_up_an_old_version_keeps_a_rewrite(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, head_landed: bool) -> None:
    """Node B reads the old version, whose stripe Redis evicted, while node A stores the
    block again: A's stripes are in (and with ``head_landed`` its head too) by the time B
    cleans up. B misses; A's block stays whole and readable."""
    admin = redis_server.client()
    keys, old_data = blocks(1, size=SIZE, seed=43)
    _, new_data = blocks(1, size=SIZE, seed=44)
    async with running(cfg_for(redis_server.url, op_timeout_s=10.0)) as writer, \
            running(cfg_for(redis_server.url, op_timeout_s=10.0)) as reader:
        await put_all(writer, keys, old_data)
        old = head_at(admin, keys[0])
        admin.delete(rkey(keys[0]) + b":%016x:2" % old.seq)   # evicted in Redis
        real = redis_stripes._read_stripes
        held: list[bytes | str | None] = []

        async def rewritten_meanwhile(tier: RedisReads, rk: bytes, header: FrameHeader,
                                      out: memoryview) -> BlockRead:
            got = await real(tier, rk, header, out)
            await put_all(writer, keys, new_data)            # A's whole write
            if not head_landed:                              # A's head not in yet
                held.append(admin.get(rk))
                admin.delete(rk)
            return got

        monkeypatch.setattr(redis_stripes, "_read_stripes", rewritten_meanwhile)
        out = buffers(1, SIZE)
        assert await reader.get_into(keys, out, namespace=NS, layout_fp=LAYOUT_FP) == 0
        assert bytes(out[0]) == bytes(SIZE)
        monkeypatch.setattr(redis_stripes, "_read_stripes", real)
        if held:                                             # A's head lands now
            admin.set(rkey(keys[0]), stored_bytes(held[0]))
        await read_exact(reader, keys, new_data, SIZE)
        assert not admin.keys(rkey(keys[0]) + b":%016x:*" % old.seq)   # old stripes gone


async def test_a_block_striped_before_tags_is_still_read(redis_server: RedisServer) -> None:
    """A frame written before stripe tags (stripes under key + ``:i``) reads back exactly,
    and a delete takes its stripes along."""
    admin = redis_server.client()
    key, payload = os.urandom(16), os.urandom(SIZE)
    header = header_for(NS, key, LAYOUT_FP, payload, seq=7, flags=FLAG_STRIPED).pack()
    admin.set(rkey(key), header + payload[:STRIPE_BYTES])
    for i in (1, 2):
        admin.set(rkey(key) + b":%d" % i, payload[i * STRIPE_BYTES:(i + 1) * STRIPE_BYTES])
    async with running(cfg_for(redis_server.url, op_timeout_s=10.0)) as tier:
        await read_exact(tier, [key], [payload], SIZE)
        assert await tier.delete([key], namespace=NS) == 1
        assert admin.dbsize() == 0


@pytest.mark.parametrize("watch", [True, False])
async def test_a_lost_stripe_under_kvtiers_acl(redis_server: RedisServer, watch: bool) -> None:
    """Under the documented ACL rule the head of a block that lost a stripe goes with it;
    under the rule from before (no WATCH, MULTI, EXEC, UNWATCH) it stays, the read still
    misses, and the refusal is counted, not a failure of the server."""
    rule = ACL_RULE if watch else ACL_RULE.replace("+watch +multi +exec +unwatch ", "")
    admin = redis_server.client()
    admin.execute_command("ACL", "SETUSER", "kvtier", *rule.split())
    url = f"redis://kvtier:s3cret@127.0.0.1:{redis_server.port}/0"
    keys, data = blocks(1, size=SIZE, seed=45)
    async with running(cfg_for(url, op_timeout_s=10.0)) as tier:
        await put_all(tier, keys, data)
        admin.delete(sorted(admin.keys(rkey(keys[0]) + b":*"))[-1])   # evicted in Redis
        out = buffers(1, SIZE)
        assert await tier.get_into(keys, out, namespace=NS, layout_fp=LAYOUT_FP) == 0
        assert bytes(out[0]) == bytes(SIZE)
        assert admin.exists(rkey(keys[0])) == (not watch)
        assert not admin.keys(rkey(keys[0]) + b":*")             # that version's stripes
        assert tier.up
        assert ("WATCH" in tier.stats_extra()["last_error"] or
                "NOPERM" in tier.stats_extra()["last_error"]) == (not watch)
