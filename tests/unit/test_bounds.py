"""Bounded work in-process: the limits' arithmetic, the byte budget, request decoding bounds,
and the store's fail-fast put and namespace bound."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest

from kvtier.config import DaemonConfig, load_config
from kvtier.daemon.limits import (
    STREAM_LIMIT,
    ByteBudget,
    Charge,
    LimitCounters,
    Limits,
    ProcessShares,
    read_request,
)
from kvtier.errors import CapacityError, ConfigError, Overloaded, ProtocolError
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from kvtier.protocol import (
    LENGTH,
    REQUEST_MAX_ENTRIES,
    REQUEST_MAX_ITEMS,
    optional_int,
    pack,
    request_id,
    unpack_body,
)
from kvtier.store import TieredStore
from kvtier.units import ByteSize
from tests.support.arena import temp_arena

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16",
                  tokens_per_block=128)   # 8 KiB blocks


def test_keys_per_request_follow_the_longest_context_and_the_block_size() -> None:
    lim = Limits(max_context_tokens=131072)
    assert lim.max_keys(16) == 8192
    assert lim.max_keys(256) == 512
    assert lim.max_keys(100) == 1311      # a partial last block still counts
    assert lim.max_keys(1) == 131072


def test_limits_from_config_derive_the_pending_budgets_from_the_frame() -> None:
    lim = Limits.from_config(DaemonConfig(max_frame_bytes=ByteSize(2**20)))
    assert lim.conn_pending_bytes == 2**20 and lim.total_pending_bytes == 4 * 2**20
    lim = Limits.from_config(DaemonConfig(max_frame_bytes=ByteSize(2**20),
                                          max_conn_pending_bytes=ByteSize(10),
                                          max_total_pending_bytes=ByteSize(2**30)))
    assert lim.conn_pending_bytes == 2**20          # never below one frame
    assert lim.total_pending_bytes == 2**30


def test_config_limits_from_env_and_validation() -> None:
    cfg = load_config(env={"KVTIER_DAEMON_MAX_CONTEXT_TOKENS": "1048576",
                           "KVTIER_DAEMON_MAX_TOTAL_PENDING_BYTES": "256MiB",
                           "KVTIER_DAEMON_IDLE_TIMEOUT_S": "0"})
    assert cfg.daemon.max_context_tokens == 2**20
    assert cfg.daemon.max_total_pending_bytes == 256 * 2**20
    assert cfg.daemon.idle_timeout_s == 0
    for env in ({"KVTIER_DAEMON_MAX_CONNECTIONS": "0"},
                {"KVTIER_DAEMON_READ_TIMEOUT_S": "0"},
                {"KVTIER_DAEMON_MAX_NAMESPACES": "-1"}):
        with pytest.raises(ConfigError, match=r"daemon\."):
            load_config(env=env)


async def test_a_process_shares_its_requests_in_flight_over_its_connections() -> None:
    """One process's connections draw on one in-flight bound (64 connections pipelining 64
    requests each made another client's ping wait a second; found by review); another
    process has its own, and a process's share goes when its last connection does."""
    shares = ProcessShares(1 << 20, inflight=2)
    a1, a2, b = shares.open(100), shares.open(100), shares.open(200)
    assert a1 is a2 and a1 is not b and shares.users(100) == 2
    await a1.inflight.acquire()
    await a2.inflight.acquire()
    assert a1.inflight.locked() and not b.inflight.locked()
    waiter = asyncio.ensure_future(a2.inflight.acquire())
    await asyncio.sleep(0)
    assert not waiter.done()
    a1.inflight.release()
    await asyncio.wait_for(waiter, 1)
    shares.close(100)
    shares.close(100)
    assert shares.users(100) == 0 and shares.open(100) is not a1


async def test_byte_budget_waits_for_room_and_can_be_given_up() -> None:
    budget = ByteBudget(100)
    await budget.acquire(60)
    waiter = asyncio.ensure_future(budget.acquire(60))
    await asyncio.sleep(0)
    assert not waiter.done() and budget.used == 60
    budget.release(60)
    await asyncio.wait_for(waiter, 1)
    assert budget.used == 60
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await budget.acquire(60)
    assert budget.used == 60 and not budget._waiters   # a cancelled wait takes nothing
    budget.release(60)
    await budget.acquire(500)   # larger than the limit but alone: admitted (progress)
    assert budget.used == 500


async def test_byte_budget_serves_waiters_first_come_first_served() -> None:
    """A waiter that does not fit yet keeps its place: nobody behind it overtakes it (a
    woken waiter went to the back of the queue, and a newcomer that fitted went first)."""
    budget = ByteBudget(100)
    await budget.acquire(60)
    order: list[str] = []

    async def take(name: str, n: int) -> None:
        await budget.acquire(n)
        order.append(name)

    a = asyncio.ensure_future(take("a", 60))
    await asyncio.sleep(0)
    b = asyncio.ensure_future(take("b", 30))   # would fit, but a came first
    await asyncio.sleep(0)
    assert order == []
    budget.release(10)                         # a (60) does not fit yet, b would
    await asyncio.sleep(0)
    assert order == []
    budget.release(50)
    await asyncio.wait_for(asyncio.gather(a, b), 1)
    assert order == ["a", "b"] and budget.used == 90


async def test_the_oldest_holder_of_a_full_budget_is_never_kept_waiting() -> None:
    """Frames read in pieces each hold part of their bytes: when they fill the budget
    together, the oldest goes on (else all would wait for each other until their timeout)."""
    budget = ByteBudget(100)
    x, y = object(), object()
    await budget.acquire(50, x)
    await budget.acquire(50, y)
    y_more = asyncio.ensure_future(budget.acquire(10, y))
    await asyncio.sleep(0)
    await asyncio.wait_for(budget.acquire(10, x), 1)   # x holds the oldest bytes
    assert not y_more.done() and budget.used == 110
    budget.release(60, x)
    await asyncio.wait_for(y_more, 1)
    assert budget.used == 60
    budget.release(60, y)
    assert budget.used == 0 and not budget._holders and not budget._waiters


async def test_frames_holding_two_budgets_in_opposite_orders_cannot_wait_in_a_cycle(
) -> None:
    """W is granted room in its process's share but has not resumed when X, of the same
    process, takes both budgets: W is the first holder of the share, X of the shared
    budget. Both full, each waited where the other was the first holder, until
    read_timeout_s dropped every frame (review repro). Age is one order for every budget:
    the oldest frame (W) goes on."""
    mib = 2**20
    pending, share_a, share_b = ByteBudget(64 * mib), ByteBudget(32 * mib), ByteBudget(32 * mib)

    async def arrived(charge: Charge, share: ByteBudget, n: int) -> None:
        for budget in (share, pending):   # as read_request takes them
            await charge.acquire(budget, n)

    v = Charge()
    await arrived(v, share_a, 32 * mib)
    w, x = Charge(), Charge()
    w_first = asyncio.ensure_future(arrived(w, share_a, mib))
    await asyncio.sleep(0)
    v.release()                           # W is granted; X runs before it resumes
    await arrived(x, share_a, mib)
    await w_first
    await arrived(w, share_a, 14 * mib)
    await arrived(x, share_a, 14 * mib)
    v2, b = Charge(), Charge()
    await arrived(v2, share_a, 2 * mib)
    await arrived(b, share_b, 32 * mib)
    assert share_a.used == 32 * mib and pending.used == 64 * mib
    nxt = {c: asyncio.ensure_future(arrived(c, share_a if c is not b else share_b, mib))
           for c in (x, w, v2, b)}
    done, _ = await asyncio.wait(nxt.values(), timeout=2.0)
    assert nxt[w] in done
    for t in nxt.values():
        t.cancel()


async def test_a_trickled_frame_holds_only_what_arrived_and_small_frames_never_wait(
        ) -> None:
    """A frame announced at 16 MiB whose body trickles held 16 MiB of the shared budget
    from its length on: four of them kept every other client's next request waiting for
    read_timeout_s (then Overloaded). Bytes are now counted as they arrive, and a frame the
    stream buffer bounds anyway does not wait for the shared budget at all."""
    lim = Limits(read_timeout_s=5.0)
    pending = ByteBudget(lim.total_pending_bytes)
    counters = LimitCounters()
    slow = asyncio.StreamReader(limit=STREAM_LIMIT)
    slow.feed_data(LENGTH.pack(16 * 2**20) + b"\x80")
    reading = asyncio.ensure_future(read_request(slow, lim, pending, counters,
                                                 ByteBudget(lim.conn_pending_bytes)))
    try:
        await asyncio.sleep(0.05)
        assert pending.used == 1
        slow.feed_data(b"\0" * 1000)
        await asyncio.sleep(0.05)
        assert pending.used == 1001
        await pending.acquire(pending.limit - pending.used)   # others fill the budget
        ping = asyncio.StreamReader(limit=STREAM_LIMIT)
        ping.feed_data(pack({"id": 7, "op": "ping"}))
        got = await asyncio.wait_for(read_request(ping, lim, pending, counters,
                                                  ByteBudget(lim.conn_pending_bytes)), 1)
        assert got is not None
        msg, charge = got
        assert msg["op"] == "ping"
        charge.release()
        assert pending.used == pending.limit
    finally:
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
    assert pending.used == pending.limit - 1001   # the cancelled frame gave its bytes back


async def test_a_connections_pipelined_requests_wait_for_its_own_budget() -> None:
    """One connection's requests in flight hold at most conn_pending_bytes
    (daemon.max_conn_pending_bytes), charged from a frame's length before its body is read:
    a client pipelining frames it does not wait the answers of waits for its own requests
    to be answered, however much room the shared budgets have (they are sized for many
    connections), and is told Overloaded after read_timeout_s."""
    lim = Limits(read_timeout_s=0.3)
    pending, counters = ByteBudget(lim.total_pending_bytes), LimitCounters()
    held = ByteBudget(1000)
    frame = pack({"id": 1, "op": "ping", "pad": b"x" * 600})
    conn = asyncio.StreamReader(limit=STREAM_LIMIT)
    conn.feed_data(frame * 3)
    first = await read_request(conn, lim, pending, counters, held)
    assert first is not None
    assert held.used == len(frame) - LENGTH.size              # the first request holds it
    second = asyncio.ensure_future(read_request(conn, lim, pending, counters, held))
    await asyncio.sleep(0.05)
    assert not second.done() and pending.used == len(frame) - LENGTH.size
    first[1].release()                                         # the first is answered
    got = await asyncio.wait_for(second, 1)
    assert got is not None and got[0]["op"] == "ping"
    with pytest.raises(Overloaded, match="max_conn_pending_bytes"):
        await read_request(conn, lim, pending, counters, held)  # the second is not
    got[1].release()
    assert held.used == 0 and pending.used == 0


def test_request_decoding_bounds_containers() -> None:
    ok = msgpack.packb({"xs": list(range(REQUEST_MAX_ITEMS))})
    assert len(unpack_body(ok, max_items=REQUEST_MAX_ITEMS)["xs"]) == REQUEST_MAX_ITEMS
    big = msgpack.packb({"xs": [None] * (REQUEST_MAX_ITEMS + 1)})
    with pytest.raises(ProtocolError, match="malformed"):
        unpack_body(big, max_items=REQUEST_MAX_ITEMS)
    assert len(unpack_body(big)["xs"]) == REQUEST_MAX_ITEMS + 1   # replies: unbounded


def test_request_decoding_bounds_all_containers_together() -> None:
    """4000 lists of 4096 entries (16 MB, each list within its bound) decoded into 16
    million objects and held the daemon's loop for ~1.2 s (found by review): refused after
    the budget, in a few milliseconds, before most of the frame is decoded."""
    nested = msgpack.packb({"op": "ping", "x": [[0] * REQUEST_MAX_ITEMS] * 4000})
    t0 = time.perf_counter()
    with pytest.raises(ProtocolError, match="entries in all"):
        unpack_body(nested, max_items=REQUEST_MAX_ITEMS, max_entries=REQUEST_MAX_ENTRIES)
    assert time.perf_counter() - t0 < 0.2   # (a full decode takes over a second)
    many_empty = msgpack.packb({"x": [[]] * REQUEST_MAX_ITEMS * 2})   # containers count too
    with pytest.raises(ProtocolError, match="entries in all"):
        unpack_body(many_empty, max_items=REQUEST_MAX_ITEMS * 2, max_entries=REQUEST_MAX_ENTRIES)
    # a request as large as an engine sends: every lengths entry of a batch, a layout map
    flat = {"op": "prefix_locality", "lengths": [1] * 256, "keys": b"k" * 16 * 4096,
            "layout": {"num_layers": 32, "dtype": "bfloat16"}}
    assert unpack_body(msgpack.packb(flat), max_items=REQUEST_MAX_ITEMS,
                       max_entries=REQUEST_MAX_ENTRIES)["lengths"] == [1] * 256
    # exactly the budget: a map of 4 (5), 3 lists of 4095 (12288) and one of 4090 (4091)
    exact = {"x": [0] * (REQUEST_MAX_ITEMS - 6)} | {
        f"y{i}": [0] * (REQUEST_MAX_ITEMS - 1) for i in range(3)}
    assert len(unpack_body(msgpack.packb(exact), max_items=REQUEST_MAX_ITEMS,
                           max_entries=REQUEST_MAX_ENTRIES)) == 4
    exact["x"].append(0)   # one entry over
    with pytest.raises(ProtocolError, match="entries in all"):
        unpack_body(msgpack.packb(exact), max_items=REQUEST_MAX_ITEMS,
                    max_entries=REQUEST_MAX_ENTRIES)


def test_request_id_and_optional_int() -> None:
    assert request_id({"id": 7}) == 7
    assert request_id({"id": "7"}) == request_id({"id": True}) == request_id({}) == 0
    assert optional_int({}, "tp_size", 1, 1, 8) == 1
    assert optional_int({"tp_size": 4}, "tp_size", 1, 1, 8) == 4
    for bad in ("4", 4.0, True, 0, 9, [4]):
        with pytest.raises(ProtocolError, match="tp_size"):
            optional_int({"tp_size": bad}, "tp_size", 1, 1, 8)


async def test_a_put_that_cannot_fit_fails_before_evicting() -> None:
    with temp_arena(16 * LAYOUT.block_bytes, 16 * LAYOUT.block_bytes) as arena:
        store = TieredStore(arena)
        ns = store.register_namespace(LAYOUT, "m", 0, 1, None)
        keys = block_keys(ns, range(128 * 40))
        lease, offsets = await store.prepare_put(1, ns.digest, LAYOUT.fingerprint, keys[:8])
        assert None not in offsets
        await store.commit_put(1, lease)
        with pytest.raises(CapacityError, match="exceeds the cpu tier"):
            await store.prepare_put(1, ns.digest, LAYOUT.fingerprint, keys[8:40])
        huge = KVLayout(64, 8, 128, "float32", 256)
        hns = store.register_namespace(huge, "m", 0, 1, None)
        with pytest.raises(CapacityError, match="larger than the cpu tier"):
            await store.prepare_put(1, hns.digest, huge.fingerprint, keys[:1])
        assert store.cpu.blocks == 8 and store.cpu.counters.allocation_failures == 0
        # the 8 stored keys are no new bytes: a put of them plus 8 new ones fits
        lease, offsets = await store.prepare_put(1, ns.digest, LAYOUT.fingerprint, keys[:16])
        assert offsets[:8] == [None] * 8 and None not in offsets[8:]
        # a put that fits in principle but finds no room stops at the first failed slot
        # (8 slots are written by the open lease, the 8 stored blocks can be evicted)
        _lease, offsets2 = await store.prepare_put(2, ns.digest, LAYOUT.fingerprint,
                                                   keys[16:32])
        assert None not in offsets2[:8] and offsets2[8:] == [None] * 8
        assert store.cpu.counters.allocation_failures == 1


def test_namespaces_beyond_the_bound_forget_the_least_recently_used() -> None:
    with temp_arena(16 * LAYOUT.block_bytes, 16 * LAYOUT.block_bytes) as arena:
        store = TieredStore(arena, max_namespaces=3)
        a, b, c = (store.register_namespace(LAYOUT, m, 0, 1, None) for m in "abc")
        assert store.touch_namespace(a.digest) == LAYOUT   # a is now the most recent
        store.register_namespace(LAYOUT, "d", 0, 1, None)
        assert store.touch_namespace(b.digest) is None
        assert store.touch_namespace(a.digest) is not None
        assert store.touch_namespace(c.digest) is not None
        assert len(store.namespaces) == 3 and store.namespaces_evicted == 1
