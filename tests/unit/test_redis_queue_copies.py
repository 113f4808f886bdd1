"""The Redis write queue bounds the bytes of the copies it owns (``write_queue_copy_bytes``):
a copy is the daemon's own memory (blocks demoted from nvme or from the arena, writes made
while Redis is down), a borrowed payload is an arena slot that costs nothing more. 256
queued copies of 32 MiB blocks were 8 GiB behind a slow Redis."""

from __future__ import annotations

from kvtier.tiers.redis_queue import PendingWrite, WriteQueue

NS = b"n" * 16


def copy(seq: int, nbytes: int) -> PendingWrite:
    return PendingWrite.copy_of(b"k%d" % seq, NS, bytes(16), 0, seq, memoryview(b"x" * nbytes))


def lent(seq: int, nbytes: int, released: list[int]) -> PendingWrite:
    return PendingWrite.borrow(b"b%d" % seq, NS, bytes(16), 0, seq,
                               memoryview(bytearray(nbytes)), lambda: released.append(seq))


def test_the_oldest_copies_go_when_copies_are_over_their_bytes() -> None:
    """Copies over the bound drop the oldest copies (counted), never a borrowed write
    (which holds no memory of the daemon's) nor the write just pushed; the bytes counted
    follow every way out of the queue."""
    released: list[int] = []
    q = WriteQueue(100, max_copy_bytes=250)
    assert q.push(copy(0, 100)) == [] and q.push(lent(1, 400, released)) == []
    assert q.push(copy(2, 100)) == []
    assert q.copy_bytes == 200 and q.queued_bytes == 600
    assert [d.seq for d in q.push(copy(3, 100))] == [0]           # 300 > 250: the oldest
    assert q.copy_bytes == 200 and q.dropped == 1
    assert [d.seq for d in q.push(copy(4, 240))] == [2, 3]        # as many as it takes
    assert q.copy_bytes == 240 and [it.seq for it in q.take(9, 1 << 20)] == [1, 4]
    assert q.copy_bytes == 0 and q.queued_bytes == 0 and released == []


def test_a_copy_larger_than_the_bound_is_kept_alone() -> None:
    """The newest block is the likeliest to be asked for again: one copy over the bound
    stays queued (the older copies go), and a queue without a bound keeps them all."""
    q = WriteQueue(100, max_copy_bytes=250)
    q.push(copy(0, 100))
    assert [d.seq for d in q.push(copy(1, 1000))] == [0]
    assert len(q) == 1 and q.copy_bytes == 1000
    unbounded = WriteQueue(100)
    assert all(unbounded.push(copy(i, 1000)) == [] for i in range(10))
    assert unbounded.copy_bytes == 10_000


def test_copy_bytes_follow_cancels_and_drops() -> None:
    """A cancel (a delete's keys), a drop of borrowed writes (Redis went down) and a clear
    leave the copies' byte count exact: it is what later pushes are checked against."""
    released: list[int] = []
    q = WriteQueue(100, max_copy_bytes=10_000)
    for i in range(3):
        q.push(copy(i, 100))
        q.push(lent(10 + i, 100, released))
    assert q.cancel({b"k1", b"b11"}, NS) == 2
    assert q.copy_bytes == 200 and released == [11]
    assert q.drop_borrowed() == 2 and q.copy_bytes == 200 and sorted(released) == [10, 11, 12]
    assert q.clear() == 2 and q.copy_bytes == 0 and q.queued_bytes == 0
