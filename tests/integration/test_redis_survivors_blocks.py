"""One GET pipeline's block reads (kvtier.tiers.redis_blocks) on a connection to a real
redis-server, at edges the mutation review found unpinned: a striped head met by a plain
GET (a block striped between a read's header probe and its GET) is a miss, never a
failed connection or bytes taken for the block."""

from __future__ import annotations

from kvtier.frame import STRIPE_BYTES, STRIPED_MIN_BYTES
from kvtier.tiers.redis_blocks import ReadStatus, read_blocks, read_blocks_muxed
from kvtier.tiers.redis_pool import NodePool
from kvtier.tiers.redis_resp import ConnOptions, NodeAddr
from kvtier.tiers.redis_wire import Conn
from tests.support.redis_servers import RedisServer
from tests.support.redis_tier import (
    LAYOUT_FP,
    NS,
    blocks,
    buffers,
    cfg_for,
    put_all,
    rkey,
    running,
)

LARGE = STRIPED_MIN_BYTES + STRIPE_BYTES   # a head and two stripes
OPTS = ConnOptions(connect_timeout_s=1.0, op_timeout_s=5.0)


async def test_a_striped_head_read_by_get_is_a_miss_on_a_sound_connection(
        redis_server: RedisServer) -> None:
    """GET of a striped block's head returns its header and stripe 0 only: the read is a
    MISSING (the striped reader's job), the buffer untouched, and the connection stays in
    step for the next exchange (it was a "placer gave N bytes" failure of the job)."""
    keys, data = blocks(2, LARGE, seed=8)
    async with running(cfg_for(redis_server.url, op_timeout_s=5.0)) as tier:
        await put_all(tier, keys, data)
    node = NodeAddr("127.0.0.1", redis_server.port)
    conn = Conn(node, OPTS)
    try:
        outs = buffers(2, LARGE)
        reads = read_blocks(conn, [rkey(k) for k in keys], keys, outs, NS, LAYOUT_FP)
        assert [r.status for r in reads] == [ReadStatus.MISSING] * 2
        assert not conn.stray_frame and not conn.mid_reply and conn.in_step()
        assert bytes(outs[0][:STRIPE_BYTES]) == bytes(STRIPE_BYTES)
    finally:
        conn.close()
    pool = NodePool(node, OPTS, 2)
    try:
        outs = buffers(2, LARGE)
        got, failures = read_blocks_muxed([(node, [0, 1])], [rkey(k) for k in keys], keys,
                                          outs, NS, LAYOUT_FP, pool_of=lambda _n: pool,
                                          width=2)
        assert failures == [] and got[0].status is ReadStatus.MISSING
        assert bytes(outs[0][:STRIPE_BYTES]) == bytes(STRIPE_BYTES)
    finally:
        pool.close()
