"""BeladyPolicy on its own (mutation review of kvtier/replay/belady.py): the furthest next
use is the victim even after many touches and stale heap entries, pins are honoured and
forgotten with the block, and a touch never makes an absent block resident."""

from __future__ import annotations

import math

from kvtier.replay.belady import BeladyPolicy
from kvtier.replay.simulator import Order, SimConfig, TierSpec, simulate
from kvtier.replay.trace import Request, Trace, TraceFormat


def put(pol: BeladyPolicy, key: int, next_use: float) -> None:
    pol.next_use = next_use
    pol.insert(key)


def test_the_latest_next_use_wins_over_stale_heap_entries() -> None:
    """A touch that moves a block's next use closer leaves its older (further) heap entry
    behind: that stale entry must not make it the victim."""
    pol = BeladyPolicy()
    put(pol, 1, 100.0)
    put(pol, 2, 50.0)
    pol.next_use = 10.0
    pol.touch(1)
    assert pol.victim() == 2 and pol.next_use_of(1) == 10.0


def test_many_touches_keep_the_victim_right() -> None:
    """Thousands of touches rebuild the heap from the live next uses (max-heap kept): the
    victim is still the block used furthest ahead."""
    pol = BeladyPolicy()
    put(pol, 1, 0.0)
    put(pol, 2, 0.0)
    for i in range(3000):
        pol.next_use = float(i)
        pol.touch(1 + i % 2)
        assert pol.victim() == 1 + i % 2     # the one just touched is used furthest ahead
    assert len(pol) == 2
    pol.remove(2)
    assert pol.victim() == 1


def test_a_touch_of_an_absent_block_does_nothing() -> None:
    pol = BeladyPolicy()
    pol.next_use = 5.0
    pol.touch(9)
    assert 9 not in pol and len(pol) == 0 and pol.victim() is None


def test_next_use_of_an_unknown_block_is_never() -> None:
    assert BeladyPolicy().next_use_of(3) == math.inf


def test_pins_hide_a_block_until_unpinned_and_go_with_it() -> None:
    """A pinned block is never the victim; unpinned after a victim() call skipped it, it is
    a candidate again; removed and inserted again, it is no longer pinned."""
    pol = BeladyPolicy()
    put(pol, 1, 100.0)
    put(pol, 2, 50.0)
    pol.set_pinned(1, True)
    assert pol.victim() == 2
    pol.set_pinned(1, False)
    assert pol.victim() == 1
    pol.set_pinned(1, True)
    pol.remove(1)
    put(pol, 1, 100.0)
    assert pol.victim() == 1
    pol.set_pinned(7, True)          # not resident: ignored, and no resident afterwards
    put(pol, 7, 1000.0)
    assert pol.victim() == 7


def test_head_first_each_block_of_a_request_gets_its_own_next_use() -> None:
    """In the reference order too, a request's blocks each carry their own next use: block
    2 (never used again) is the victim when 3 arrives, and both 1 and 3 hit afterwards.
    Giving every block the head's next use made Belady bypass 3 instead."""
    reqs = ([1, 2], [3], [1], [3])
    trace = Trace(tuple(Request(float(i), 4 * len(b), 1, tuple(b)) for i, b in enumerate(reqs)),
                  4, TraceFormat.MOONCAKE)
    config = SimConfig(tiers=(TierSpec("cpu", 2, 25e9),), order=Order.REFERENCE)
    assert simulate(trace, "belady", config).hit_blocks == 2
