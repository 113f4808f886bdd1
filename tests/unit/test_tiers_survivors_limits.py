"""Survivors of the tiers' mutation round: the daemon's per-process reservations
(kvtier.daemon.inflight) and request byte budgets (kvtier.daemon.limits)."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.daemon.inflight import InFlight, Reserved
from kvtier.daemon.limits import (
    ByteBudget,
    Charge,
    LimitCounters,
    Limits,
    read_exactly,
    read_request,
)
from kvtier.errors import ProtocolError
from kvtier.protocol import pack


def test_a_put_reservation_that_ends_first_is_given_back_while_another_runs() -> None:
    """Two prepares of one process overlap; the put that ends first gives its bytes back
    at once, while the other still holds its own (the process's share must not stay
    charged for a prepare that is over). Mutant that survived: ``put_bytes`` not given
    back in ``InFlight.reserve``'s ``finally`` (the existing test ended the put last,
    when the whole entry is deleted anyway)."""
    f = InFlight()
    put = f.reserve(7, put_bytes=100)
    get = f.reserve(7, get_bytes=30)
    put.__enter__()
    get.__enter__()
    assert f.of(7) == Reserved(put_bytes=100, get_bytes=30, leases=2)
    put.__exit__(None, None, None)
    assert f.of(7) == Reserved(put_bytes=0, get_bytes=30, leases=1)
    get.__exit__(None, None, None)
    assert f.of(7) == Reserved()


async def test_a_wait_granted_then_cancelled_gives_its_bytes_back() -> None:
    """A reader granted room by a release and cancelled (its timeout) before it ran again
    must give the bytes back, or the budget stays short by them for good. Mutant that
    survived: the ``release`` in ``ByteBudget.acquire``'s cancel path dropped."""
    budget = ByteBudget(10)
    await budget.acquire(10)
    waiter = asyncio.ensure_future(budget.acquire(5))
    await asyncio.sleep(0)
    assert not waiter.done() and budget.used == 10
    budget.release(10)          # grants the waiter its 5 bytes ...
    assert budget.used == 5
    waiter.cancel()             # ... and it is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert budget.used == 0


async def test_a_cancelled_head_of_the_queue_lets_the_next_waiter_in() -> None:
    """Waiters are served first come first served: a small one waits behind a large one
    that does not fit. When the large one gives up (cancelled), the one behind it must be
    granted at once if it fits, not at the next release. Mutant that survived: the
    ``_wake`` after a cancelled waiter is removed dropped."""
    budget = ByteBudget(10)
    await budget.acquire(10)
    large = asyncio.ensure_future(budget.acquire(8))
    await asyncio.sleep(0)
    small = asyncio.ensure_future(budget.acquire(2))
    await asyncio.sleep(0)
    budget.release(5)           # 5 free: the large one does not fit, the small one waits
    await asyncio.sleep(0)
    assert not large.done() and not small.done()
    large.cancel()
    with pytest.raises(asyncio.CancelledError):
        await large
    await asyncio.wait_for(small, 1.0)
    assert budget.used == 7


async def test_the_oldest_holder_waiting_behind_a_head_that_does_not_fit_is_granted() -> None:
    """A frame read in pieces that holds bytes and waits for more is let in ahead of the
    queue once it is the oldest holder, even when the waiter at the head does not fit
    (else frames that each hold part of the budget wait for each other). Here the older
    holder lets go; the next holder's own wait (the head, too large for the room) must be
    granted by that release. Mutants that survived: ``_wake`` returning where the head
    does not fit (``break`` made ``return``), and its oldest-holder pass dropped."""
    budget = ByteBudget(10)
    older, newer = Charge(), Charge()
    await budget.acquire(2, older)
    await budget.acquire(2, newer)
    await budget.acquire(6)                          # full: 10 of 10
    more = asyncio.ensure_future(budget.acquire(3, newer))
    await asyncio.sleep(0)
    assert not more.done()                           # not the oldest holder: it waits
    budget.release(2, older)                         # 8 used: 3 more do not fit, but
    await asyncio.wait_for(more, 1.0)                # ``newer`` is now the oldest holder
    assert budget.used == 11


async def test_a_connection_waiting_for_its_replies_is_not_dropped_as_idle() -> None:
    """``read_request`` between frames: while ``busy()`` (the connection's requests are
    still being answered) an idle timeout passes without dropping the connection; once
    nothing is in flight it is dropped (None, ``dropped_idle``). Mutant that survived:
    the ``busy()`` test dropped, so a client waiting on a long request lost its
    connection after ``idle_timeout_s``."""
    lim = Limits(idle_timeout_s=0.05, read_timeout_s=1.0)
    counters = LimitCounters()
    looks: list[int] = []

    def busy() -> bool:
        looks.append(1)
        return len(looks) < 3   # in flight for two idle periods, then idle

    reader = asyncio.StreamReader()
    got = await asyncio.wait_for(read_request(reader, lim, ByteBudget(1 << 20), counters,
                                              ByteBudget(1 << 20), busy=busy), 2.0)
    assert got is None
    assert len(looks) == 3 and counters.dropped_idle == 1


async def test_a_large_frame_cut_short_by_the_peer_is_an_incomplete_read() -> None:
    """``read_exactly`` (large frames, read piece by piece against the byte budgets) must
    raise IncompleteReadError when the peer closes before ``n`` bytes came, never hand a
    short body on (``read_request`` turns the error into "connection closed inside a
    frame"). Mutant that survived: the end of stream ending the loop quietly."""
    reader = asyncio.StreamReader()
    reader.feed_data(b"x" * 1000)
    reader.feed_eof()
    seen: list[int] = []

    async def arrived(k: int) -> None:
        seen.append(k)

    with pytest.raises(asyncio.IncompleteReadError):
        await read_exactly(reader, 5000, arrived)
    assert sum(seen) == 1000


async def test_the_hello_must_arrive_whole_within_the_read_timeout_of_the_connect() -> None:
    """The hello (``held`` None) must be whole within ``read_timeout_s`` of the call, the
    wait for its first byte included: a client that sends its first byte late and the
    rest later still is dropped at that deadline (``dropped_slow``), not given a second
    ``read_timeout_s`` from its first byte. Mutant that survived: the hello's deadline
    counted from its first byte, as a later frame's is."""
    lim = Limits(read_timeout_s=1.0)
    counters = LimitCounters()
    frame = pack({"op": "hello"})
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    loop.call_later(0.6, reader.feed_data, frame[:1])      # first byte at 0.6 s
    loop.call_later(1.3, reader.feed_data, frame[1:])      # the rest at 1.3 s: too late
    with pytest.raises(ProtocolError):
        await asyncio.wait_for(read_request(reader, lim, ByteBudget(1 << 20), counters),
                               5.0)
    assert counters.dropped_slow == 1
