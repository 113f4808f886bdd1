"""The Redis tier's prefix probes: how many leading keys are in Redis, cheaply.

``RedisProbes`` is the layer of ``RedisTier`` (kvtier.tiers.redis, which states the
contract) under its reads: ``exists_prefix`` (pipelined EXISTS, or GETRANGE of the frame
header's namespace field when a namespace is given, several batches in flight, stopping at
the first miss) and ``whole_prefix`` (the headers read, a striped block's parts checked).
A reply of a type its command cannot answer is a counted miss, never trusted; a frame that
fails its checks is deleted and counted (``_drop_corrupt``, which the reads use too).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvtier.errors import FrameError
from kvtier.frame import FrameHeader, stripe_bounds
from kvtier.lograte import LogRate
from kvtier.tiers.base import EvictionReason
from kvtier.tiers.redis_blocks import header_range, never_valid
from kvtier.tiers.redis_link import UNSERVED, RedisLink
from kvtier.tiers.redis_resp import KEY_ERRORS, ErrorReply, ProtocolError, command
from kvtier.tiers.redis_stripes import owned_part_keys
from kvtier.tiers.redis_wire import Conn

log = logging.getLogger("kvtier.tiers.redis")   # one logger for the whole Redis tier
_warn = LogRate(log)   # corrupt frames: as many as a writer of the database plants

EXISTS_BATCH = 64                 # keys per pipelined EXISTS round trip


def last_byte(key: bytes, length: int) -> bytes:
    """The command reading byte ``length - 1`` of the value at ``key``: one byte when it
    is a string of at least ``length`` bytes, b"" when missing or shorter, WRONGTYPE when
    not a string. ``whole_prefix`` asks it of each stripe (found by review: EXISTS, 1 for
    a key of any type, counted a stripe turned into a list as whole, so a synchronous
    commit never sent such a block again)."""
    at = b"%d" % (length - 1)
    return command(b"GETRANGE", key, at, at)
NS_OFFSET, NS_END = 8, 23         # the frame header's namespace field (GETRANGE, inclusive)


class RedisProbes(RedisLink):
    """Probes of the Redis tier: ``exists_prefix`` and ``whole_prefix``."""

    async def exists_prefix(self, keys: Sequence[bytes], *,
                            namespace: bytes | None = None) -> int:
        """How many leading ``keys`` are in Redis (pipelined EXISTS, stops at the first miss).

        With ``namespace``, a key counts only when its frame's namespace field is
        ``namespace`` (pipelined GETRANGE of that field instead of EXISTS): a frame of
        another namespace is a miss, counted in ``namespace_mismatches``.
        0 while down; on an error, the prefix confirmed before it (the error is counted).
        """
        found = 0
        if not keys or not self._up:
            return 0
        for start in range(0, len(keys), EXISTS_BATCH):
            rkeys = [self._rkey(k) for k in keys[start:start + EXISTS_BATCH]]
            for rkey, reply in zip(rkeys, await self._probe(rkeys, namespace), strict=True):
                if isinstance(reply, ErrorReply):
                    self._error_reply(reply)
                    if reply.kind in KEY_ERRORS:
                        await self._drop_corrupt(rkey, str(reply))
                    return found
                if reply is UNSERVED or isinstance(reply, BaseException) or \
                        not self._present(reply, namespace):
                    return found
                found += 1
            self._succeeded()
        return found

    async def _probe(self, rkeys: list[bytes], namespace: bytes | None) -> list[Any]:
        """EXISTS per key, or GETRANGE of the frame's namespace field when ``namespace``."""
        lo, hi = str(NS_OFFSET).encode(), str(NS_END).encode()

        def cmds(idx: list[int]) -> list[bytes]:
            if namespace is None:
                return [command(b"EXISTS", rkeys[i]) for i in idx]
            return [command(b"GETRANGE", rkeys[i], lo, hi) for i in idx]

        def probe(conn: Conn, idx: list[int]) -> list[Any]:
            return conn.simple_many(cmds(idx))

        return await self._per_server(rkeys, probe, small=cmds)

    async def whole_prefix(self, keys: Sequence[bytes], *, namespace: bytes) -> int:
        """How many leading blocks of ``namespace`` a get would find whole: each head's
        header (one pipelined read), then every stripe of the striped ones. A lookup's
        probe reads the namespace field of heads only; a synchronous commit, which promises
        its consumers the chain, must not count a block whose stripe Redis evicted or
        expired (its head outlives it). 0 while down; on an error, the prefix before it."""
        if not keys or not self._up:
            return 0
        rkeys = [self._rkey(k) for k in keys]
        heads = await self._per_server(rkeys, lambda conn, idx: conn.simple_many(
            [header_range(rkeys[i]) for i in idx]))
        found = len(rkeys)
        owner: list[int] = []   # block index of each stripe key
        stripes: list[bytes] = []
        checks: list[bytes] = []   # the last byte of each stripe
        block_bytes = self._block_bytes_for(namespace)
        for i, (rkey, head) in enumerate(zip(rkeys, heads, strict=True)):
            if isinstance(head, ErrorReply):
                self._error_reply(head)
            elif not (head is UNSERVED or head is None or isinstance(head, (
                    bytes, bytearray, memoryview, BaseException))):
                self._odd_reply("GETRANGE", head)   # never bytes(n) of a server's n
            try:
                if not isinstance(head, (bytes, bytearray, memoryview)):
                    raise FrameError("no header")   # missing, unserved, failed, not one
                header = FrameHeader.unpack(bytes(head))   # (a copy of what was received)
            except FrameError:   # missing, unserved, not a frame
                found = i
                break
            if header.namespace != namespace:
                self.namespace_mismatches += 1
                found = i
                break
            if never_valid(header, block_bytes) is not None:   # a get deletes it
                found = i
                break
            parts = owned_part_keys(rkey, header, block_bytes)
            bounds = stripe_bounds(header.payload_len)[1:] if parts else []
            stripes += parts
            owner += [i] * len(parts)
            checks += [last_byte(part, hi - lo) for part, (lo, hi) in zip(parts, bounds,
                                                                          strict=True)]
        if stripes:
            there = await self._per_server(stripes, lambda conn, idx: conn.simple_many(
                [checks[j] for j in idx]))
            for reply in there:
                if isinstance(reply, ErrorReply):
                    self._error_reply(reply)
            found = min([found] + [owner[j] for j, r in enumerate(there)
                                   if not (isinstance(r, bytes) and len(r) == 1)])
        return found

    def _present(self, reply: Any, namespace: bytes | None) -> bool:
        """Whether a ``_probe`` reply says the block is there (for ``namespace``). A reply
        of a type the command cannot answer (EXISTS: an integer; GETRANGE: a bulk string)
        is a miss and a server error, counted: never converted (``bytes(n)`` of a
        server's integer allocates n bytes)."""
        if namespace is None:
            if isinstance(reply, int) and not isinstance(reply, bool):
                return reply == 1
            self._odd_reply("EXISTS", reply)
            return False
        if not isinstance(reply, (bytes, bytearray, memoryview)):
            self._odd_reply("GETRANGE", reply)
            return False
        if not reply:  # GETRANGE of a missing key: b""
            return False
        if bytes(reply) != namespace:
            self.namespace_mismatches += 1
            return False
        return True

    def _odd_reply(self, cmd: str, reply: Any) -> None:
        """Count a reply that ``cmd`` cannot answer (a broken or hostile server)."""
        self._note_error(ProtocolError(
            f"redis answered {cmd} with {type(reply).__name__} {reply!r:.60}"))

    async def _drop_corrupt(self, rkey: bytes, why: str) -> None:
        self.counters.checksum_failures += 1
        self.counters.evicted(EvictionReason.CORRUPT)
        _warn.warning("corrupt", "redis tier: corrupt frame at %r deleted (%s)", rkey, why)
        await self._per_server([rkey], lambda c, idx: c.simple_many([command(b"DEL", rkey)]))
