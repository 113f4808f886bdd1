"""The conditional delete of a striped block's head (``redis_stripes._delete_head_if``)
on a recording connection, at edges the mutation review found unpinned: during a slot
migration (ASKING) nothing is sent, and a refused WATCH is reported as such."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvtier.frame import FLAG_STRIPE_TAG, FLAG_STRIPED, STRIPED_MIN_BYTES, FrameHeader
from kvtier.tiers.redis_resp import ErrorReply
from kvtier.tiers.redis_stripes import _delete_head_if
from tests.support.redis_tier import LAYOUT_FP, NS

HEADER = FrameHeader(NS, bytes(16), LAYOUT_FP, STRIPED_MIN_BYTES, STRIPED_MIN_BYTES, 0,
                     flags=FLAG_STRIPED | FLAG_STRIPE_TAG, seq=3)


class Recorder:
    """A connection that records the commands sent and answers from ``replies``."""

    def __init__(self, replies: list[list[Any]], *, asking: bool = False) -> None:
        self.asking = asking
        self.sent: list[bytes] = []
        self.replies = replies

    def simple_many(self, cmds: Sequence[bytes]) -> list[Any]:
        self.sent += cmds
        return self.replies.pop(0)


class Tier:
    """What ``_delete_head_if`` uses of the tier: one exchange, and its error reports."""

    def __init__(self, conn: Recorder) -> None:
        self.conn = conn
        self.refused: list[ErrorReply] = []
        self.errors: list[ErrorReply] = []

    async def _per_server(self, rkeys: list[bytes],
                          fn: Callable[[Any, list[int]], list[Any]]) -> list[Any]:
        return fn(self.conn, list(range(len(rkeys))))

    def note_refused_watch(self, reply: ErrorReply) -> None:
        self.refused.append(reply)

    def _error_reply(self, reply: ErrorReply) -> None:
        self.errors.append(reply)


async def test_a_migrating_slots_head_is_left_for_a_later_read() -> None:
    """Behind ASKING every command of the exchange would be queued by MULTI: nothing is
    sent, nothing deleted (0)."""
    conn = Recorder([], asking=True)
    assert await _delete_head_if(Tier(conn), b"k", HEADER) == 0  # type: ignore[arg-type]
    assert conn.sent == []


async def test_the_head_goes_only_while_it_holds_the_header_read() -> None:
    """The DEL runs inside MULTI/EXEC after a WATCH, and only when the head still holds
    the header the read saw; a rewrite's head is unwatched and kept."""
    same = Recorder([["OK", HEADER.pack()], ["OK", "QUEUED", [1]]])
    assert await _delete_head_if(Tier(same), b"k", HEADER) == 1  # type: ignore[arg-type]
    assert [c.split(b"\r\n")[2] for c in same.sent] == [b"WATCH", b"GETRANGE", b"MULTI",
                                                       b"DEL", b"EXEC"]
    other = FrameHeader(NS, bytes(16), LAYOUT_FP, STRIPED_MIN_BYTES, STRIPED_MIN_BYTES, 0,
                        flags=FLAG_STRIPED | FLAG_STRIPE_TAG, seq=4)
    moved = Recorder([["OK", other.pack()], ["OK"]])
    assert await _delete_head_if(Tier(moved), b"k", HEADER) == 0  # type: ignore[arg-type]
    assert [c.split(b"\r\n")[2] for c in moved.sent][-1] == b"UNWATCH"


async def test_a_refused_watch_is_reported_as_one_not_as_a_server_failure() -> None:
    """An ACL without +watch answers NOPERM: told once as the ACL's gap
    (``note_refused_watch``), not counted as the server failing; other errors are."""
    tier = Tier(Recorder([[ErrorReply("NOPERM no watch"), b""]]))
    assert await _delete_head_if(tier, b"k", HEADER) == 0  # type: ignore[arg-type]
    assert [r.kind for r in tier.refused] == ["NOPERM"] and tier.errors == []
    tier = Tier(Recorder([[ErrorReply("LOADING later"), b""]]))
    assert await _delete_head_if(tier, b"k", HEADER) == 0  # type: ignore[arg-type]
    assert tier.refused == [] and [r.kind for r in tier.errors] == ["LOADING"]
