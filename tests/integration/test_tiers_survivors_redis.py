"""Survivors of the tiers' mutation round: the Redis tier's writes and reconnects against
real redis-servers (tests/support/redis_servers.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path

import pytest

from kvtier.frame import STRIPED_MIN_BYTES, FrameHeader, payload_checksum
from tests.support.redis_servers import RedisServer, free_port, running_cluster, start_server
from tests.support.redis_tier import LAYOUT_FP, NS, cfg_for, eventually, running

# kvtier's documented ACL rule, but its keys limited to block heads (``kvtier:`` and 32
# hex digits): every stripe key (``kvtier:<hex>:<tag>:<i>``) is refused with NOPERM
HEADS_ONLY = ("on >s3cret resetkeys ~kvtier:" + "?" * 32 + " -@all +get +set +getrange "
              "+exists +del +ping +info +dbsize +select +watch +multi +exec +unwatch")


async def test_a_striped_block_whose_stripe_is_refused_gets_no_head(
        redis_server: RedisServer) -> None:
    """A head is written only once every stripe of its block is stored: a block whose
    stripe SET Redis refuses (here NOPERM, as -OOM or a timeout would) must leave no head,
    or lookups would count a block that every get misses (and delete). The write counts
    as dropped. Mutant that survived: the filter of heads by their stripes' outcome
    dropped from ``RedisWrites._write_batch`` (the existing refusal tests refuse the
    whole block, head included)."""
    admin = redis_server.client()
    admin.execute_command("ACL", "SETUSER", "kvtier", *HEADS_ONLY.split())
    url = f"redis://kvtier:s3cret@127.0.0.1:{redis_server.port}/0"
    key = os.urandom(16)
    payload = os.urandom(STRIPED_MIN_BYTES)
    async with running(cfg_for(url, codec="none")) as tier:
        assert tier.up
        tier.submit(NS, key, LAYOUT_FP, memoryview(payload))
        assert await tier.flush(timeout=10)
        assert tier.counters.dropped_writes == 1
        assert await tier.exists_prefix([key], namespace=NS) == 0
    assert admin.exists(b"kvtier:" + key.hex().encode()) == 0
    assert admin.dbsize() == 0


async def test_a_cluster_whose_every_master_died_goes_down(tmp_path: Path) -> None:
    """In a cluster, a failed master leaves the routing and the tier stays up while any
    server answers; once none does (the slot map cannot be reloaded from any member) the
    tier is down as a whole (docs/redis.md: "down as a whole only when no server of the
    cluster answers"), so lookups stop paying for it and writes stop queueing as if it
    were up. Mutant that survived: the reconnect loop no longer marking an up tier down
    when its refresh finds nobody (``_mark_down`` dropped from ``_reconnect_loop``)."""
    with running_cluster(tmp_path / "cluster", masters=2) as cluster:
        async with running(cfg_for(cluster.url, cluster=True)) as tier:
            assert tier.up
            keys = [os.urandom(16) for _ in range(16)]   # over both masters' slots
            for node in cluster.nodes:
                node.kill()
            assert await tier.exists_prefix(keys) == 0
            await eventually(lambda: not tier.up, timeout=8.0)



async def test_refused_writes_in_a_row_never_take_the_tier_down(
        redis_server: RedisServer) -> None:
    """A server at its maxmemory refuses SETs with -OOM: those writes are dropped and
    counted, and a refusal never counts toward ``DOWN_AFTER_FAILURES`` (the server still
    serves reads), however many batches in a row are refused. Mutant that survived: -OOM
    counted as a server failure in ``_error_reply`` (the existing test refused two
    batches, one short of taking the tier down)."""
    admin = redis_server.client()
    async with running(cfg_for(redis_server.url, op_timeout_s=10.0)) as tier:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + 4096)
        for _ in range(5):                        # five batches of refused SETs in a row
            for _ in range(2):
                tier.submit(NS, os.urandom(16), LAYOUT_FP, memoryview(os.urandom(1 << 18)))
            assert await tier.flush(timeout=10)
        stats = tier.stats_extra()
        assert stats["dropped_writes"] == 10 and "OOM" in stats["last_error"]
        assert tier.up and stats["reconnects"] == 0
        assert stats["consecutive_failures"] == 0


async def test_values_of_another_type_in_a_row_never_take_the_tier_down(
        redis_server: RedisServer) -> None:
    """A value of another type under kvtier's prefix (a list: WRONGTYPE) is a miss for
    its key, counted in ``errors`` and deleted as corrupt by the probe, but says nothing
    of the server: several in a row never count toward ``DOWN_AFTER_FAILURES``
    (docs/redis.md, Hostile contents). Mutant that survived: WRONGTYPE counted as a
    server failure in ``_error_reply`` (the existing tests met one such value at a
    time)."""
    admin = redis_server.client()
    keys = [os.urandom(16) for _ in range(5)]
    for key in keys:
        admin.rpush(b"kvtier:" + key.hex().encode(), b"not a frame")
    async with running(cfg_for(redis_server.url)) as tier:
        for key in keys:
            assert await tier.exists_prefix([key], namespace=NS) == 0
        stats = tier.stats_extra()
        assert "WRONGTYPE" in stats["last_error"]
        assert tier.counters.errors == 5 and tier.counters.checksum_failures == 5
        assert tier.up and stats["consecutive_failures"] == 0
    assert admin.dbsize() == 0


async def test_a_down_tier_has_no_room_for_a_synchronous_write_through() -> None:
    """``room`` (how many writes a synchronous write-through may queue now) is 0 while the
    tier is down: nothing would drain the queue, and a commit must not queue its chain as
    if it would. Mutant that survived: ``room`` answering the queue's free capacity while
    down."""
    url = f"redis://127.0.0.1:{free_port()}/0"          # nobody listens there
    async with running(cfg_for(url, write_queue_blocks=8)) as tier:
        assert not tier.up
        assert await tier.room(4, 0.1) == 0


async def test_a_down_tier_reads_nothing_and_tries_no_connection() -> None:
    """While the tier is down every read is a miss answered at once: no connection is
    tried (the reconnect loop does that, with backoff), nothing more is counted in
    ``errors``, and the blocks asked are ``fetch_missed_blocks``; a delete is 0 at once
    too. Mutants that survived: ``get_into`` and ``delete`` going on while down (a
    connection tried per call, each failure counted)."""
    url = f"redis://127.0.0.1:{free_port()}/0"          # nobody listens there
    keys = [os.urandom(16) for _ in range(3)]
    outs = [memoryview(bytearray(4096)) for _ in keys]
    async with running(cfg_for(url)) as tier:
        assert not tier.up
        errors = tier.counters.errors
        assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 0
        assert await tier.delete(keys, namespace=NS) == 0
        assert tier.counters.errors == errors
        assert tier.stats_extra()["fetch_missed_blocks"] == 3


async def test_recovering_from_a_run_of_timeouts_starts_the_count_over(
        redis_server: RedisServer) -> None:
    """``DOWN_AFTER_FAILURES`` soft failures in a row (timeouts) take a server down; once
    the reconnect loop has it up again the count starts over, so a single timeout after a
    recovery does not take it down again at once. Mutant that survived: ``_set_up`` not
    resetting ``consecutive_failures``."""
    assert redis_server.proc is not None
    keys = [os.urandom(16)]
    async with running(cfg_for(redis_server.url, op_timeout_s=0.3)) as tier:
        redis_server.proc.send_signal(signal.SIGSTOP)    # every exchange times out
        try:
            while tier.up:
                assert await tier.exists_prefix(keys) == 0
            assert tier.stats_extra()["consecutive_failures"] >= 3
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        await eventually(lambda: tier.up, timeout=10.0)
        assert tier.stats_extra()["consecutive_failures"] == 0


async def test_a_cancelled_read_returns_only_once_its_thread_let_go_of_the_buffers(
        redis_server: RedisServer) -> None:
    """``get_into`` lands values straight in the caller's buffers from a worker thread;
    cancelled (a lookup budget, a client gone), it returns only once that thread is done
    with them (bounded by ``op_timeout_s``), so the caller may reuse its buffers at once.
    Mutant that survived: ``_in_thread`` returning at once on cancellation even when the
    thread holds the caller's buffers (the thread then wrote into freed or reused
    memory)."""
    assert redis_server.proc is not None
    keys = [os.urandom(16) for _ in range(4)]
    outs = [memoryview(bytearray(4096)) for _ in keys]
    async with running(cfg_for(redis_server.url, op_timeout_s=1.5)) as tier:
        redis_server.proc.send_signal(signal.SIGSTOP)    # the GETs hang in the thread
        try:
            read = asyncio.ensure_future(tier.get_into(keys, outs, namespace=NS,
                                                       layout_fp=LAYOUT_FP))
            await asyncio.sleep(0.3)
            assert not read.done()
            t0 = time.monotonic()
            read.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await read
            waited = time.monotonic() - t0
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        assert waited > 0.6     # the thread's exchange ran out its op timeout first


async def test_a_striped_block_missing_a_middle_stripe_gets_no_head(
        redis_server: RedisServer) -> None:
    """The same rule when only a stripe in the middle is refused and a later one is
    stored: the block failed as a whole (its first failure decides), so no head, and the
    stripe that was stored is deleted again. Mutant that survived: ``_first_failures``
    letting a later stripe's OK replace an earlier stripe's refusal."""
    admin = redis_server.client()
    admin.execute_command("ACL", "SETUSER", "kvtier",
                          *(HEADS_ONLY + " ~kvtier:*:2").split())   # stripe 2, not 1
    url = f"redis://kvtier:s3cret@127.0.0.1:{redis_server.port}/0"
    key = os.urandom(16)
    payload = os.urandom(STRIPED_MIN_BYTES + (4 << 20))            # head, stripes 1 and 2
    async with running(cfg_for(url, codec="none")) as tier:
        tier.submit(NS, key, LAYOUT_FP, memoryview(payload))
        assert await tier.flush(timeout=10)
        assert tier.counters.dropped_writes == 1
        assert await tier.exists_prefix([key], namespace=NS) == 0
    assert admin.dbsize() == 0


async def test_a_delete_after_its_writes_ended_does_not_wait(
        redis_server: RedisServer) -> None:
    """``forget_writes`` (a delete's first step) waits only for writes of its keys still
    being sent; once they ended it returns at once, not after ``op_timeout_s``. Mutant
    that survived: the count of a key's writes in flight never taken back after its
    batch (every later delete of a key once written waited the whole op timeout)."""
    key = os.urandom(16)
    async with running(cfg_for(redis_server.url, op_timeout_s=3.0)) as tier:
        tier.submit(NS, key, LAYOUT_FP, memoryview(os.urandom(4096)))
        assert await tier.flush(timeout=10)
        t0 = time.monotonic()
        assert await tier.forget_writes([key], namespace=NS) == 0
        assert time.monotonic() - t0 < 1.5
        assert await tier.delete([key], namespace=NS) == 1


async def test_an_acl_without_watch_is_said_once_and_never_counted_as_a_failure(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """Under an ACL without ``+watch +multi +exec +unwatch`` (kvtier's rule before
    2026-12-06) a block whose stripe Redis evicted keeps its head; the NOPERM answering
    WATCH is counted in ``errors`` and the daemon says so once in its log (naming the
    missing permissions), and it never counts toward taking the server down. Mutant
    that survived: that NOPERM handled as any error reply (a soft server failure, and
    nothing logged)."""
    admin = redis_server.client()
    rule = ("on >s3cret resetkeys ~kvtier:* -@all +get +set +getrange +exists +del +ping "
            "+info +dbsize +select")
    admin.execute_command("ACL", "SETUSER", "kvtier", *rule.split())
    url = f"redis://kvtier:s3cret@127.0.0.1:{redis_server.port}/0"
    key = os.urandom(16)
    head = b"kvtier:" + key.hex().encode()
    async with running(cfg_for(url, codec="none")) as tier:
        tier.submit(NS, key, LAYOUT_FP, memoryview(os.urandom(STRIPED_MIN_BYTES)))
        assert await tier.flush(timeout=10)
        stripes = admin.keys(head + b":*")
        assert len(stripes) == 1
        admin.delete(*stripes)                           # evicted, as far as kvtier knows
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.redis"):
            out = memoryview(bytearray(STRIPED_MIN_BYTES))
            assert await tier.get_into([key], [out], namespace=NS, layout_fp=LAYOUT_FP) == 0
        assert "refused WATCH" in caplog.text and "+watch" in caplog.text
        assert "NOPERM" in tier.stats_extra()["last_error"]
        assert tier.up and tier.stats_extra()["consecutive_failures"] == 0
    assert admin.exists(head) == 1                       # the head stays, as documented


async def test_a_truncated_large_frame_leaves_nothing_unverified_in_the_buffer(
        redis_server: RedisServer) -> None:
    """A large frame stored whole (by an earlier kvtier) is read as ranges into the
    caller's buffer; when a range comes back short (the value was cut: its header says
    more than it holds) the ranges already landed are zeroed before the one GET that
    decides, since that GET refuses the value before placing a byte. So the read is a
    counted miss, the value is deleted, and the buffer holds none of its unverified bytes.
    Mutant that survived: the zeroing after failed ranges dropped from
    ``fetch_ranged``."""
    admin = redis_server.client()
    key = os.urandom(16)
    payload = os.urandom(STRIPED_MIN_BYTES)
    header = FrameHeader(NS, key, LAYOUT_FP, len(payload), len(payload),
                         payload_checksum(payload))
    rkey = b"kvtier:" + key.hex().encode()
    admin.set(rkey, header.pack() + payload[:5 << 20])    # cut after 5 of its 8 MiB
    out = memoryview(bytearray(STRIPED_MIN_BYTES))
    async with running(cfg_for(redis_server.url)) as tier:
        assert await tier.get_into([key], [out], namespace=NS, layout_fp=LAYOUT_FP) == 0
        assert tier.counters.checksum_failures == 1
    assert bytes(out) == bytes(len(out))
    assert admin.exists(rkey) == 0


async def test_a_write_queued_behind_a_batch_in_flight_waits_when_the_tier_goes_down(
        tmp_path: Path) -> None:
    """One SET batch in flight (its server stopped), a second write queued behind it; the
    server dies and the tier goes down. The writer took the queue again as soon as the
    failed batch gave back its slot, without looking at ``up``: the queued copy was sent to
    a dead server and dropped, where a write queued while down waits for the tier to come
    back (found by mutation review)."""
    server = start_server(tmp_path / "redis")
    try:
        async with running(cfg_for(server.url, write_inflight=1)) as tier:
            assert server.proc is not None
            server.proc.send_signal(signal.SIGSTOP)          # the first batch hangs
            tier.submit(NS, os.urandom(16), LAYOUT_FP, memoryview(os.urandom(1024)))
            await eventually(lambda: tier.stats_extra()["queue_depth"] == 0, timeout=5.0)
            tier.submit(NS, os.urandom(16), LAYOUT_FP, memoryview(os.urandom(1024)))
            assert tier.stats_extra()["queue_depth"] == 1
            server.kill()
            await eventually(lambda: not tier.up, timeout=5.0)
            await asyncio.sleep(0.2)   # the writer's turn after the failed batch
            assert tier.stats_extra()["queue_depth"] == 1   # still waiting for the tier
            assert tier.counters.dropped_writes == 1         # only the batch in flight
    finally:
        server.stop()
