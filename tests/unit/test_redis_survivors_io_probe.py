"""The Redis tier's prefix probes (kvtier.tiers.redis_probe) against a scripted server,
the behaviour no other test pinned (mutation review): the namespace field read is the one
a frame header holds, a key absent is a miss and not a foreign namespace, a key of the
wrong type is deleted and counted corrupt, an EXISTS reply counts only as the integer 1,
and a header that can never be a frame of its namespace is not whole."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.frame import FLAG_STRIPED, HEADER_SIZE, STRIPED_MIN_BYTES, FrameHeader, payload_checksum
from kvtier.tiers.redis_link import UNSERVED
from kvtier.tiers.redis_probe import NS_END, NS_OFFSET, last_byte
from kvtier.tiers.redis_resp import NodeAddr, command
from tests.support.redis_tier import LAYOUT_FP, NS, cfg_for, running
from tests.support.resp_peer import answering, bulk, peer

OTHER_NS = bytes(reversed(NS))


def rkey(key: bytes) -> bytes:
    return b"kvtier:" + key.hex().encode()


def server(tmp_path: Path, answer: Callable[[list[bytes]], bytes]
           ) -> contextlib.AbstractContextManager[NodeAddr]:
    """A RESP server on a unix socket, every connection served at once."""
    return peer(tmp_path, answering(answer), name="probe.sock", read_first=False,
                concurrent=True)


def header(key: bytes, namespace: bytes = NS, *, flags: int = 0, size: int = 64) -> bytes:
    payload = bytes(size)
    return FrameHeader(namespace, key, LAYOUT_FP, size, size, payload_checksum(payload),
                       flags=flags).pack()


def test_the_namespace_field_probed_is_the_frame_headers() -> None:
    """GETRANGE NS_OFFSET..NS_END (inclusive) is exactly the header's namespace: one byte
    off, every probe compares a shifted field and finds nothing (or the wrong thing)."""
    packed = header(b"k" * 16)
    assert packed[NS_OFFSET:NS_END + 1] == NS


def test_last_byte_reads_the_stripes_last_byte() -> None:
    """A stripe of n bytes is whole when byte n - 1 is there (one byte back); asking
    byte n reads b"" of a whole stripe, asking n - 2 passes one byte short."""
    assert last_byte(b"k", 10) == command(b"GETRANGE", b"k", b"9", b"9")


def test_absent_and_foreign_keys_are_misses_counted_apart(tmp_path: Path) -> None:
    """GETRANGE of a missing key (b"") is a plain miss; a frame of another namespace is a
    miss counted in ``namespace_mismatches`` (an operator's sign of a shared database)."""
    mine, absent, foreign = os.urandom(16), os.urandom(16), os.urandom(16)
    seen: list[list[bytes]] = []

    def answer(cmd: list[bytes]) -> bytes:
        seen.append(cmd)
        if cmd[0] != b"GETRANGE":
            return b"+PONG\r\n"
        if cmd[1] == rkey(absent):
            return bulk(b"")
        return bulk(OTHER_NS if cmd[1] == rkey(foreign) else NS)

    async def main(url: str) -> None:
        async with running(cfg_for(url)) as tier:
            assert await tier.exists_prefix([mine, absent], namespace=NS) == 1
            assert tier.namespace_mismatches == 0
            assert await tier.exists_prefix([mine, foreign], namespace=NS) == 1
            assert tier.namespace_mismatches == 1
            assert tier.counters.errors == 0

    with server(tmp_path, answer) as addr:
        asyncio.run(main(f"unix://{addr.host}"))
    ranges = {tuple(c[2:]) for c in seen if c[0] == b"GETRANGE"}
    assert ranges == {(b"%d" % NS_OFFSET, b"%d" % NS_END)}


def test_a_probed_key_of_the_wrong_type_is_deleted_as_corrupt(tmp_path: Path) -> None:
    """WRONGTYPE for a probed key: the prefix ends there, the key is deleted (else every
    lookup meets it again) and counted as a corrupt eviction."""
    first, wrong = os.urandom(16), os.urandom(16)
    seen: list[list[bytes]] = []

    def answer(cmd: list[bytes]) -> bytes:
        seen.append(cmd)
        if cmd[0] == b"EXISTS" and cmd[1] == rkey(wrong):
            return b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
        if cmd[0] == b"EXISTS":
            return b":1\r\n"
        return b":1\r\n" if cmd[0] == b"DEL" else b"+PONG\r\n"

    async def main(url: str) -> None:
        async with running(cfg_for(url)) as tier:
            assert await tier.exists_prefix([first, wrong, first]) == 1
            assert tier.counters.checksum_failures == 1
            assert tier.counters.evictions.get("corrupt") == 1

    with server(tmp_path, answer) as addr:
        asyncio.run(main(f"unix://{addr.host}"))
    assert [b"DEL", rkey(wrong)] in seen


def test_exists_counts_only_the_integer_one(tmp_path: Path) -> None:
    """EXISTS of one key answers 0 or 1: a 2 is a server that is not Redis (or a proxy
    summing), never a block found."""
    key = os.urandom(16)

    def answer(cmd: list[bytes]) -> bytes:
        return b":2\r\n" if cmd[0] == b"EXISTS" else b"+PONG\r\n"

    async def main(url: str) -> None:
        async with running(cfg_for(url)) as tier:
            assert await tier.exists_prefix([key]) == 0

    with server(tmp_path, answer) as addr:
        asyncio.run(main(f"unix://{addr.host}"))


def test_a_tier_that_is_down_probes_nothing(tmp_path: Path) -> None:
    """Down, a probe answers 0 without a round trip (a lookup must not wait on a server
    the tier has taken out)."""
    key = os.urandom(16)
    seen: list[list[bytes]] = []

    def answer(cmd: list[bytes]) -> bytes:
        seen.append(cmd)
        return b":1\r\n" if cmd[0] == b"EXISTS" else b"+PONG\r\n"

    async def main(url: str) -> None:
        async with running(cfg_for(url)) as tier:
            assert await tier.exists_prefix([key]) == 1
            tier._up = False
            try:
                assert await tier.exists_prefix([key]) == 0
                assert await tier.whole_prefix([key], namespace=NS) == 0
            finally:
                tier._up = True

    with server(tmp_path, answer) as addr:
        asyncio.run(main(f"unix://{addr.host}"))
    assert sum(c[0] == b"EXISTS" for c in seen) == 1
    assert not any(c[0] == b"GETRANGE" for c in seen)


def test_whole_prefix_stops_at_a_foreign_or_never_valid_header(tmp_path: Path) -> None:
    """A head of another namespace is counted a mismatch; a striped flag on a block too
    small to be striped is no frame kvtier wrote: either ends the whole prefix there."""
    good, foreign, bogus = os.urandom(16), os.urandom(16), os.urandom(16)
    heads = {rkey(good): header(good), rkey(foreign): header(foreign, OTHER_NS),
             rkey(bogus): header(bogus, flags=FLAG_STRIPED)}

    def answer(cmd: list[bytes]) -> bytes:
        if cmd[0] == b"GETRANGE":
            return bulk(heads.get(cmd[1], b""))
        return b"+PONG\r\n"

    async def main(url: str) -> None:
        async with running(cfg_for(url)) as tier:
            assert await tier.whole_prefix([good, foreign], namespace=NS) == 1
            assert tier.namespace_mismatches == 1
            assert await tier.whole_prefix([good, bogus, good], namespace=NS) == 1

    with server(tmp_path, answer) as addr:
        asyncio.run(main(f"unix://{addr.host}"))


def test_a_probe_answered_ends_a_run_of_failures(tmp_path: Path) -> None:
    """Timeouts take the tier down only in a row: a probe answered in between resets the
    run (else failures scattered over hours of sound probes would take it down)."""
    key = os.urandom(16)

    def answer(cmd: list[bytes]) -> bytes:
        return b":1\r\n" if cmd[0] == b"EXISTS" else b"+PONG\r\n"

    async def main(url: str) -> None:
        async with running(cfg_for(url)) as tier:
            tier._consecutive_failures = 2
            assert await tier.exists_prefix([key]) == 1
            assert tier._consecutive_failures == 0

    with server(tmp_path, answer) as addr:
        asyncio.run(main(f"unix://{addr.host}"))


def test_a_striped_block_missing_one_stripe_is_not_whole(tmp_path: Path) -> None:
    """Each stripe must answer its last byte (one byte): a stripe Redis evicted answers
    b"" and ends the whole prefix at its block, though the head is still there (a
    synchronous commit would promise its consumers a block no get can read); a stripe
    check answered with an error is counted too (an ACL without +getrange)."""
    key = os.urandom(16)
    head = FrameHeader(NS, key, LAYOUT_FP, STRIPED_MIN_BYTES, STRIPED_MIN_BYTES, 0,
                       flags=FLAG_STRIPED).pack()
    evicted: set[bytes] = set()
    stripes: list[bytes] = []
    refused = False

    def answer(cmd: list[bytes]) -> bytes:
        if cmd[0] != b"GETRANGE":
            return b"+PONG\r\n"
        if cmd[1] == rkey(key):
            return bulk(head if cmd[3] == b"%d" % (HEADER_SIZE - 1) else b"x")
        stripes.append(cmd[1])
        if refused:
            return b"-NOPERM this user has no permissions to run the 'getrange' command\r\n"
        return bulk(b"" if cmd[1] in evicted else b"x")

    async def main(url: str) -> None:
        nonlocal refused
        async with running(cfg_for(url)) as tier:
            assert await tier.whole_prefix([key], namespace=NS) == 1
            assert stripes
            evicted.add(stripes[-1])
            assert await tier.whole_prefix([key], namespace=NS) == 0
            assert tier.counters.errors == 0
            refused = True   # a stripe check refused: not whole, and counted
            assert await tier.whole_prefix([key], namespace=NS) == 0
            assert tier.counters.errors >= 1 and "NOPERM" in tier.last_error

    with server(tmp_path, answer) as addr:
        asyncio.run(main(f"unix://{addr.host}"))


def test_a_header_read_refused_is_counted(tmp_path: Path) -> None:
    """The head's header read answered with an error: no whole block, and the error is
    counted (an ACL refusing GETRANGE must show in the stats, not as plain misses)."""
    key = os.urandom(16)

    def answer(cmd: list[bytes]) -> bytes:
        if cmd[0] == b"GETRANGE":
            return b"-NOPERM this user has no permissions to run the 'getrange' command\r\n"
        return b"+PONG\r\n"

    async def main(url: str) -> None:
        async with running(cfg_for(url)) as tier:
            assert await tier.whole_prefix([key], namespace=NS) == 0
            assert tier.counters.errors == 1 and "NOPERM" in tier.last_error

    with server(tmp_path, answer) as addr:
        asyncio.run(main(f"unix://{addr.host}"))


def test_a_key_of_an_unserved_slot_is_a_miss_not_a_protocol_error(tmp_path: Path) -> None:
    """A cluster slot no server serves answers UNSERVED: a miss, already accounted for by
    the routing, not a reply of the wrong type counted against the server."""
    def answer(cmd: list[bytes]) -> bytes:
        return b"+PONG\r\n"

    async def unserved(rkeys: list[bytes], *args: Any, **kw: Any) -> list[Any]:
        return [UNSERVED] * len(rkeys)

    async def main(url: str) -> None:
        async with running(cfg_for(url)) as tier:
            tier._per_server = unserved  # type: ignore[method-assign, assignment]
            assert await tier.exists_prefix([os.urandom(16)]) == 0
            assert await tier.exists_prefix([os.urandom(16)], namespace=NS) == 0
            assert tier.counters.errors == 0

    with server(tmp_path, answer) as addr:
        asyncio.run(main(f"unix://{addr.host}"))
