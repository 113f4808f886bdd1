"""Survivors of the tiers' mutation round: Redis Cluster membership (``redis_route``) and
the read batching of ``redis_reads``, as pure functions. (A CLUSTER SLOTS reply that is
not an array is a case of tests/unit/test_redis_hostile.py's malformed replies.)"""

from __future__ import annotations

from kvtier.tiers.redis_reads import _batches
from kvtier.tiers.redis_resp import NodeAddr
from kvtier.tiers.redis_route import _member_addrs


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
