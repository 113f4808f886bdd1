"""Survivors of the tiers' mutation round: the Redis write-behind queue (pure Python).

No process starts here: ``WriteQueue`` is driven directly, as ``RedisTier.forget_writes``
(a delete's first step) drives it.
"""

from __future__ import annotations

from kvtier.tiers.redis_queue import PendingWrite, WriteQueue

NS_A = b"A" * 16
NS_B = b"B" * 16


def test_a_delete_cancels_only_its_own_namespaces_queued_writes() -> None:
    """``WriteQueue.cancel`` (called by ``forget_writes`` before a DEL) drops the queued
    writes of the keys under the deleting namespace only. The Redis key holds no namespace,
    so another namespace's queued write of the same key (another tenant's block) must stay
    queued and keep its borrowed buffer: cancelling it would lose that tenant's write and
    release a buffer its owner still counts as lent. Mutant that survived: the namespace
    test dropped from ``cancel``."""
    released: list[bytes] = []
    q = WriteQueue(8)
    rkey = b"kvtier:" + b"00" * 16
    theirs = PendingWrite.borrow(rkey, NS_B, bytes(16), 1, 1, memoryview(b"b" * 64),
                                 lambda: released.append(b"B"))
    mine = PendingWrite.borrow(rkey, NS_A, bytes(16), 1, 2, memoryview(b"a" * 64),
                               lambda: released.append(b"A"))
    q.push(theirs)
    q.push(mine)
    assert q.cancel({rkey}, NS_A) == 1
    assert released == [b"A"]           # only the deleting namespace's buffer came back
    assert len(q) == 1 and q.queued_bytes == 64
    assert q.take(8, 1 << 20) == [theirs]
    assert q.cancel({rkey}, NS_A) == 0  # nothing of A's left to cancel
