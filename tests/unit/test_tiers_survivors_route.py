"""Survivors of the tiers' mutation round: Redis Cluster routing (``redis_route.Router``)
and the read batching of ``redis_reads``, against scripted RESP peers (threads in this
process, tests/support/resp_peer.py) or as pure functions."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiers.redis_reads import _batches
from kvtier.tiers.redis_resp import ConnOptions, NodeAddr
from kvtier.tiers.redis_route import Reach, Router, _member_addrs
from tests.support.resp_peer import answering, bulk, peer

OPTS = ConnOptions(connect_timeout_s=1.0, op_timeout_s=1.0)
LOCAL = b"127.0.0.1"


def resp(value: Any) -> bytes:
    """``value`` in RESP: ints, bytes (bulk), None (nil) and lists of those."""
    if value is None:
        return b"$-1\r\n"
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, bytes):
        return bulk(value)
    return b"*%d\r\n" % len(value) + b"".join(resp(v) for v in value)


def cluster_peer(tmp_path: Path, slots: Callable[[], Any], nodes: Callable[[], bytes],
                 name: str) -> Any:
    def answer(cmd: list[bytes]) -> bytes:
        if cmd == [b"CLUSTER", b"SLOTS"]:
            return resp(slots())
        if cmd == [b"CLUSTER", b"NODES"]:
            return bulk(nodes())
        return b"+PONG\r\n"
    return peer(tmp_path, answering(answer), name=name, tcp=True, read_first=False)


def nodes_line(addr: NodeAddr) -> bytes:
    return b"%s %s:%d@%d master - 0 0 1 connected\n" % (
        os.urandom(20).hex().encode(), addr.host.encode(), addr.port, addr.port + 10000)


@pytest.mark.parametrize("odd", [None, 7, b"0-16383"], ids=["nil", "integer", "bulk"])
def test_a_cluster_slots_reply_that_is_not_an_array_is_refused_and_the_next_member_asked(
        tmp_path: Path, odd: Any) -> None:
    """A member that answers CLUSTER SLOTS with something that is not an array (a nil, an
    integer, a bulk string: a proxy or a broken server) is skipped with ``last_error``
    saying so, and the next member's map is used. Mutant that survived: the
    ``not isinstance(reply, list)`` test dropped from ``Router._fetch_slots``: the reply
    then reached ``_slot_ranges``, whose loop over a nil or an integer raised TypeError out
    of ``refresh`` (the next member never asked; the tier stayed down)."""
    addrs: dict[str, NodeAddr] = {}
    calls: list[int] = []

    def bad_slots() -> Any:
        calls.append(1)
        if len(calls) == 1:   # sound at first: it serves every slot, the other replicates
            return [[0, 16383, [LOCAL, addrs["bad"].port], [LOCAL, addrs["good"].port]]]
        return odd

    with cluster_peer(tmp_path, lambda: [[0, 16383, [LOCAL, addrs["good"].port]]],
                      lambda: nodes_line(addrs["good"]), "good.sock") as good, \
            cluster_peer(tmp_path, bad_slots, lambda: nodes_line(addrs["bad"]),
                         "bad.sock") as bad:
        addrs.update(good=good, bad=bad)
        router = Router(bad, OPTS, cluster=True, pool_size=1)
        try:
            assert router.refresh() is Reach.HEALED and router.masters() == [bad]
            assert router.refresh() is Reach.HEALED
            assert "CLUSTER SLOTS" in router.last_error
            assert router.masters() == [good]
        finally:
            router.close()


def test_read_batches_hold_at_most_max_keys_blocks() -> None:
    """``_batches`` cuts a read into runs of at most ``max_keys`` blocks (GET_BATCH_KEYS
    per pipeline) and about ``max_bytes``, each holding at least one block. Mutant that
    survived: ``hi - lo < max_keys`` made ``<=`` (33 GETs per pipeline): no test looked at
    the runs themselves."""
    assert _batches([1] * 70, 32, 1 << 20) == [(0, 32), (32, 64), (64, 70)]
    assert _batches([1] * 3, 1, 1 << 20) == [(0, 1), (1, 2), (2, 3)]
    assert _batches([10, 10, 10, 50], 32, 25) == [(0, 2), (2, 3), (3, 4)]   # bytes bound
    assert _batches([100], 32, 10) == [(0, 1)]    # one block over the byte bound: alone


def test_cluster_nodes_members_without_an_address_or_in_a_handshake_are_not_members() -> None:
    """``_member_addrs`` (which members a redirect may be followed to) leaves out lines
    whose flags say ``noaddr`` or ``handshake``: such a node is not a member yet, or its
    address is not known, and a redirect there must not be followed. Mutant that
    survived: both flags ignored."""
    nodes = (b"a1 127.0.0.1:7001@17001 master,noaddr - 0 0 1 disconnected\n"
             b"a2 127.0.0.1:7002@17002 handshake - 0 0 0 connected\n"
             b"a3 127.0.0.1:7003@17003 myself,master - 0 0 2 connected 0-16383\n"
             b"a4 :7004@17004 slave a3 0 0 2 connected\n")
    assert _member_addrs(nodes, "10.0.0.9") == [NodeAddr("127.0.0.1", 7003),
                                                NodeAddr("10.0.0.9", 7004)]
