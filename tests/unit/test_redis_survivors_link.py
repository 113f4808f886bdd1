"""When the Redis tier's link calls a server down (kvtier.tiers.redis_link), at edges the
mutation review found unpinned: soft failures (timeouts, error replies) mark it down only
as DOWN_AFTER_FAILURES in a row, a success restarts the count, a hard connection error
marks it down at once, and a key's own trouble (WRONGTYPE) never counts against the
server. No server is reached: the tier is never started, its state set by hand."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis_link import DOWN_AFTER_FAILURES
from kvtier.tiers.redis_resp import ErrorReply
from tests.support.redis_tier import cfg_for


@pytest.fixture
async def tier() -> AsyncIterator[RedisTier]:
    """A tier that believes it is up (the reconnects a down tier starts go nowhere)."""
    t = RedisTier(cfg_for("redis://127.0.0.1:1/0"))
    t._up = True
    try:
        yield t
    finally:
        await t.close(timeout=0)


async def test_soft_failures_mark_the_tier_down_only_in_a_row(tier: RedisTier) -> None:
    """Two timeouts, a success, two more: still up (a success restarts the count; a timeout
    is no proof the server is gone); the third in a row marks it down. Marked down early,
    one slow reply would drop every queued borrowed write; never, a hung server would
    keep every read waiting its op timeout."""
    for _ in range(2):
        tier._failed(TimeoutError("slow"))
    assert tier.up
    tier._succeeded()
    for _ in range(2):
        tier._failed(TimeoutError("slow"))
    assert tier.up
    tier._failed(TimeoutError("slow"))
    assert not tier.up
    assert tier.counters.errors == 5


async def test_a_connection_error_marks_the_tier_down_at_once(tier: RedisTier) -> None:
    """A refused or reset connection is a hard failure: down on the first."""
    tier._failed(ConnectionRefusedError("refused"))
    assert not tier.up


async def test_a_keys_own_error_reply_never_marks_the_tier_down(tier: RedisTier) -> None:
    """WRONGTYPE (a value of another type under the prefix) and -OOM (a write refused
    at maxmemory) are counted errors, not the server's failure: any number leaves it up,
    while other error replies count as soft failures."""
    for _ in range(DOWN_AFTER_FAILURES + 1):
        tier._error_reply(ErrorReply("WRONGTYPE Operation against a key"))
        tier._error_reply(ErrorReply("OOM command not allowed"))
    assert tier.up and tier.counters.errors == 2 * (DOWN_AFTER_FAILURES + 1)
    for _ in range(DOWN_AFTER_FAILURES):
        tier._error_reply(ErrorReply("ERR something else"))
    assert not tier.up


async def test_a_borrowed_write_submitted_while_down_gives_its_buffer_back_at_once(
        tier: RedisTier) -> None:
    """While down, a write may wait long for the tier: a borrowed one is copied and its
    buffer released before ``submit`` returns (a pinned arena slot is not held by a dead
    Redis), its checksum callback told None (nobody waits on the copy)."""
    tier._up = False
    told: list[int | None] = []
    released: list[bool] = []
    tier.submit(bytes(16), bytes(16), 1, memoryview(bytearray(64)),
                release=lambda: released.append(True), on_checksum=told.append)
    assert released == [True] and told == [None]
    assert len(tier._queue) == 1
