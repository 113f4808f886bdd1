"""WriteOutcomes: which queued SETs of a key reached Redis, for a synchronous commit."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtier.tiers import redis_queue
from kvtier.tiers.redis_queue import PendingWrite, WriteOutcomes


def item(key: bytes) -> PendingWrite:
    return PendingWrite.copy_of(key, bytes(16), key, 1, 0, memoryview(b"x" * 8))


def settle(w: PendingWrite, ok: bool) -> None:
    w.ok = ok
    w.done()


async def test_waits_for_the_pending_write_and_reports_its_reply() -> None:
    out = WriteOutcomes()
    good, bad = item(b"a"), item(b"b")
    out.track(good)
    out.track(bad)
    since = time.monotonic()
    waiting = asyncio.ensure_future(out.wait([b"a", b"b", b"c"], since))
    await asyncio.sleep(0)
    assert not waiting.done()                 # both writes are still pending
    settle(good, True)
    await asyncio.sleep(0)
    assert not waiting.done()
    settle(bad, False)
    assert await waiting == [True, False, None]   # "c" was never written here


async def test_a_newer_write_of_the_key_is_the_one_that_counts() -> None:
    out = WriteOutcomes()
    old, new = item(b"k"), item(b"k")
    out.track(old)
    out.track(new)
    waiting = asyncio.ensure_future(out.wait([b"k"], time.monotonic()))
    settle(old, True)                          # superseded: answers nothing
    await asyncio.sleep(0)
    assert not waiting.done()
    settle(new, False)
    assert await waiting == [False]


async def test_only_results_since_the_callers_start_count() -> None:
    out = WriteOutcomes()
    w = item(b"k")
    out.track(w)
    settle(w, True)
    after = time.monotonic() + 1.0
    assert await out.wait([b"k"], after) == [None]    # ended before: ask Redis
    assert await out.wait([b"k"], 0.0) == [True]


async def test_recent_results_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_queue, "RECENT_OUTCOMES", 3)
    out = WriteOutcomes()
    for k in (b"1", b"2", b"3", b"4"):
        w = item(k)
        out.track(w)
        settle(w, True)
    assert await out.wait([b"1", b"2", b"4"], 0.0) == [None, True, True]


async def test_a_cancelled_wait_leaves_the_write_alone() -> None:
    out = WriteOutcomes()
    w = item(b"k")
    out.track(w)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await out.wait([b"k"], 0.0)
    settle(w, True)
    assert await out.wait([b"k"], 0.0) == [True]


async def test_a_down_tier_answers_at_once() -> None:
    out = WriteOutcomes()
    w = item(b"k")
    out.track(w)
    assert await out.wait([b"k"], 0.0, up=False) == [False]   # queued until it is back
    waiting = asyncio.ensure_future(out.wait([b"k"], 0.0))
    await asyncio.sleep(0)
    out.give_up_waiting()                                      # the tier went down
    assert await waiting == [False]
    settle(w, True)                                            # written once it came back
    assert await out.wait([b"k"], 0.0) == [True]
