"""A small blocking RESP connection for the Redis tier's block traffic (GET/SET/EXISTS/DEL).

Why not redis-py for blocks: on Python 3.11 its asyncio writer joins every command into one
``bytes`` (a copy of each value), and a GET reply becomes a new ``bytes`` that the tier then
copies again into the arena. Here a SET goes out with ``sendmsg`` as [command prefix, frame
header, payload view, CRLF] straight from the caller's buffers, and a GET's payload is
received straight into the caller's buffer (``recv_into``) and checked there.

A ``Conn`` is a blocking socket with a timeout on every read and write (so every wait is
bounded by ``op_timeout_s``; kvtier.tiers.redis_socket), used by one worker thread at a
time: kernel copies and checksums release the GIL, so several requests are in flight over
several connections.
A connection that failed in any way mid-command is closed, never reused
(kvtier.tiers.redis_pool keeps the idle ones per server). With ``asking`` set, every command
goes out behind an ASKING (a Redis Cluster slot being migrated: the key is asked for at the
slot's new owner before the move is over) and its +OK is read and checked.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.statsdoc import clean
from kvtier.tiers.redis_resp import (
    CRLF,
    ConnOptions,
    ErrorReply,
    NodeAddr,
    Placer,
    ProtocolError,
    _bulk,
    command,
)
from kvtier.tiers.redis_socket import RedisSocket

SEND_PIECE_BYTES = 1 << 20     # a SET pipeline is sent in pieces of about this size
_ASKING = command(b"ASKING")

# What one reply read by ``read_reply`` may hold (its bulk strings' bytes, plus
# ``_ITEM_BYTES`` per array element): a server's announced length is checked against it
# before anything is allocated. Small: probes, frame headers, DEL/EXISTS/SET replies.
# Large: INFO, CLUSTER SLOTS and CLUSTER NODES, which grow with the cluster. Block
# values never come through here (``read_value`` hands them to a placer).
SMALL_REPLY_BYTES = 4096
LARGE_REPLY_BYTES = 64 << 20
MAX_REPLY_DEPTH = 8            # nested arrays (CLUSTER SLOTS uses 4)
_ITEM_BYTES = 16               # what an array element is charged (a Python object at least)


class Conn(RedisSocket):
    """One blocking RESP connection (see the module docstring)."""

    __slots__ = ("_room_left", "asking", "mid_reply", "out_of_step", "stray_frame")

    def __init__(self, addr: NodeAddr, opts: ConnOptions) -> None:
        super().__init__(addr, opts)
        self.asking = False   # send each command behind an ASKING (see the module docstring)
        # bytes arrived past an exchange's replies (``stale``): the connection is out of
        # step with its server and the pool drops it (``NodePool.give``), counted
        self.out_of_step = False
        # a GET was answered with another key's frame: a value copied under the wrong key
        # or a reply out of step; dropped too (found by review: counted apart)
        self.stray_frame = False
        # a value was refused without being read to its end (``read_value``'s ``most``):
        # the rest of it is still due, so the pool closes the connection (found by review)
        self.mid_reply = False
        self._room_left = 0   # what the reply being read may still hold (``read_reply``)
        try:
            self._handshake(opts)
        except BaseException:
            self.close()
            raise

    def _handshake(self, opts: ConnOptions) -> None:
        cmds: list[tuple[str, bytes]] = []
        if opts.password:
            auth = (opts.username.encode(),) if opts.username else ()
            cmds.append(("AUTH", command(b"AUTH", *auth, opts.password.encode())))
        if opts.db:
            cmds.append(("SELECT", command(b"SELECT", str(opts.db).encode())))
        if not cmds:
            return
        self.begin()
        self.send([cmd for _, cmd in cmds])
        refused = [(name, reply) for name, _ in cmds
                   if isinstance(reply := self.read_reply(), ErrorReply)]
        if not refused:   # (every reply read first: the connection stays in step)
            return
        name, reply = refused[0]
        if name == "SELECT":   # not an authentication failure: say which db
            raise PermissionError(f"redis {self.addr} refused SELECT: db {opts.db} out of "
                                  f"range or not allowed ({clean(str(reply), 200)}); give a db "
                                  "the server has in the path of redis.url")
        raise PermissionError(f"redis {self.addr} refused authentication: "
                              f"{clean(str(reply), 200)}")

    def read_reply(self, max_bytes: int = SMALL_REPLY_BYTES) -> Any:
        """Read one reply: bytes, int, None, ErrorReply, str (+OK) or a list of those.

        ProtocolError (the connection is then unusable) for a reply that would hold more
        than ``max_bytes`` (see ``SMALL_REPLY_BYTES``) or nest arrays deeper than
        ``MAX_REPLY_DEPTH``, before anything of that size is allocated: a server's
        ``$<n>`` is not a reason to allocate n bytes."""
        self._room_left = max_bytes
        return self._reply(0)

    def _reply(self, depth: int) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode(errors="replace")
        if kind == b"-":
            return ErrorReply(rest.decode(errors="replace"))
        if kind == b":":
            return self._number(rest)
        if kind == b"$":
            n = self.nil_or_length(rest)
            if n is None:
                return None
            self._take_room(n, "value")
            out = bytearray(n + 2)
            self._read_into(memoryview(out))
            if out[n:] != CRLF:
                raise ProtocolError(f"bulk reply from redis {self.addr} not followed by CRLF")
            return bytes(out[:n])
        if kind == b"*":
            n = self.nil_or_length(rest)
            if n is None:
                return None
            if depth >= MAX_REPLY_DEPTH:
                raise ProtocolError(f"redis {self.addr} nested arrays deeper than "
                                    f"{MAX_REPLY_DEPTH}")
            self._take_room(n * _ITEM_BYTES, "array")
            return [self._reply(depth + 1) for _ in range(n)]
        raise ProtocolError(f"unexpected reply type {kind!r} from redis {self.addr}")

    def _take_room(self, n: int, what: str) -> None:
        """Charge ``n`` bytes to the reply being read (ProtocolError past its bound)."""
        if n > self._room_left:
            raise ProtocolError(f"redis {self.addr} announced a {what} of {n} bytes where "
                                f"{self._room_left} at most were expected")
        self._room_left -= n

    def _number(self, text: bytes) -> int:
        try:
            return int(text)
        except ValueError:
            raise ProtocolError(f"redis {self.addr} sent {text[:40]!r} for a number") from None

    def nil_or_length(self, text: bytes) -> int | None:
        """A bulk string's or array's length; None for RESP2's nil (``-1``). Any other
        negative length is a ProtocolError (found by review: ``$-99999999999999999999``
        answering a stripe's GET read as a missing stripe, and the block was deleted)."""
        n = self._number(text)
        if n == -1:
            return None
        if n < 0:
            raise ProtocolError(f"redis {self.addr} sent a length of {text[:40]!r}")
        return n

    def read_value(self, index: int, head: int, place: Placer,
                   most: int | None = None) -> int | ErrorReply | None:
        """Read one GET reply: None (missing), an ErrorReply, or the value's length.

        The first ``head`` bytes of the value are read into a small buffer and handed to
        ``place``, which says where the rest goes (e.g. straight into the caller's block).
        A value ``place`` refuses that is longer than ``most`` bytes is not read on (found
        by review: 500 MiB planted behind a sound header were drained until the deadline,
        every read of it a timeout): its length is returned and ``mid_reply`` set, so that
        the connection is closed, never reused; the caller reads nothing more on it.
        """
        line = self._line()
        if line[:1] == b"-":
            return ErrorReply(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise ProtocolError(f"expected a bulk reply from redis {self.addr}, got {line[:1]!r}")
        n = self.nil_or_length(line[1:])
        if n is None:
            return None
        first = bytearray(min(head, n))
        self._read_into(memoryview(first))
        dest = place(index, bytes(first), n)
        rest = n - len(first)
        if dest is None and most is not None and n > most:
            self.mid_reply = True
            return n
        if dest is None:
            self._skip(rest)
        else:
            if dest.nbytes != rest:
                raise ValueError(f"placer gave {dest.nbytes} bytes for a {rest}-byte value")
            self._read_into(dest)
        tail = bytearray(2)
        self._read_into(memoryview(tail))
        if tail != CRLF:
            raise ProtocolError(f"bulk value from redis {self.addr} not followed by CRLF")
        return n

    # --- commands -------------------------------------------------------------------------

    def _ask(self, cmds: Sequence[bytes]) -> Sequence[bytes]:
        """``cmds``, each behind an ASKING while ``asking``."""
        return [_ASKING + c for c in cmds] if self.asking else cmds

    def _asked(self) -> None:
        """Read the +OK of the ASKING before a reply (while ``asking``)."""
        if self.asking and (reply := self.read_reply()) != "OK":
            raise ProtocolError(f"redis {self.addr} answered ASKING with {reply!r}")

    def _replies(self, n: int, max_bytes: int = SMALL_REPLY_BYTES) -> list[Any]:
        """``n`` replies (each after its ASKING's +OK while ``asking``)."""
        if not self.asking:
            return [self.read_reply(max_bytes) for _ in range(n)]
        replies = []
        for _ in range(n):
            self._asked()
            replies.append(self.read_reply(max_bytes))
        return replies

    def simple_many(self, cmds: Sequence[bytes],
                    max_bytes: int = SMALL_REPLY_BYTES) -> list[Any]:
        """Send pre-encoded small commands in one write; read one reply each, each of at
        most ``max_bytes`` (``read_reply``; ``LARGE_REPLY_BYTES`` for INFO and CLUSTER)."""
        self.begin()
        self.send(self._ask(cmds))
        return self._replies(len(cmds), max_bytes)

    def set_many(self, keys: Sequence[bytes],
                 parts_of: Callable[[int], Sequence[bytes | bytearray | memoryview]],
                 ttl_s: int | None) -> list[Any]:
        """Pipelined SETs of ``keys``; value i is ``parts_of(i)``, parts sent back to back
        (header, payload), asked for just before it is sent. The pipeline goes out in
        pieces of about ``SEND_PIECE_BYTES``, so preparing the next values (framing: a
        checksum) overlaps the server reading the first ones instead of delaying them all.
        (1 MiB, not 256 KiB: 32 SETs of 256 KiB from the tier took 1.8-2.1 ms against 1.9-2.5
        ms, fewer sends and fewer, larger reads by the server; values of 1 MiB and more go
        one per send either way.)"""
        expiry = (b"$2\r\nEX\r\n" + _bulk(str(ttl_s).encode()) + str(ttl_s).encode() + CRLF
                  if ttl_s else b"")
        argc = b"*5\r\n" if ttl_s else b"*3\r\n"
        self.begin()
        bufs: list[bytes | bytearray | memoryview] = []
        pending = 0
        for i, key in enumerate(keys):
            parts = parts_of(i)
            size = sum(memoryview(p).nbytes for p in parts)
            bufs.append(b"%s%s$3\r\nSET\r\n%s%s\r\n$%d\r\n" % (
                _ASKING if self.asking else b"", argc, _bulk(key), key, size))
            bufs += parts
            bufs.append(CRLF + expiry)
            pending += size
            if pending >= SEND_PIECE_BYTES or i == len(keys) - 1:
                self.send(bufs)
                bufs, pending = [], 0
        return self._replies(len(keys))

    def in_step(self) -> bool:
        """Whether this connection's next reply answers its next command: a PING with a
        fresh nonce must come back as its own echo. A reply the server sent once too often,
        later than any ``stale`` peek could see, comes first instead (found by review: such
        a reply read as a striped block's next stripe fails the block's checksum, and a
        sound block would be deleted as corrupt). A PING that fails is no such evidence:
        a timeout or a broken connection propagates, and an error reply (LOADING, BUSY) is
        a ProtocolError saying so; either way the exchange failed and nothing is judged."""
        nonce = b"kvtier-" + os.urandom(8).hex().encode()
        try:
            (reply,) = self.simple_many([command(b"PING", nonce)])
        except ProtocolError:   # more than a PING's echo: a stale value came first
            return False
        if isinstance(reply, ErrorReply):
            raise ProtocolError(f"redis {self.addr} answered PING with an error: "
                                f"{clean(str(reply), 200)}")
        return reply == nonce

    def getrange_into(self, key: bytes, start: int, dest: memoryview) -> int | ErrorReply | None:
        """GETRANGE of ``dest.nbytes`` bytes from ``start``, received straight into
        ``dest`` (``read_value``); the length of the reply (``dest`` is filled only when it
        is exact)."""
        self.begin()
        self.send(self._ask([command(b"GETRANGE", key, b"%d" % start,
                                     b"%d" % (start + dest.nbytes - 1))]))
        self._asked()
        return self.read_value(0, 0, lambda _i, _head, n: dest if n == dest.nbytes else None,
                               dest.nbytes)

    def get_exact(self, key: bytes, dest: memoryview) -> int | ErrorReply | None:
        """GET a value received straight into ``dest``; the value's length (``dest`` is
        filled only when it is exact), None when missing."""
        self.begin()
        self.send(self._ask([command(b"GET", key)]))
        self._asked()
        return self.read_value(0, 0, lambda _i, _head, n: dest if n == dest.nbytes else None,
                               dest.nbytes)

    def get_many(self, keys: Sequence[bytes], head: int, place: Placer,
                 most: int | None = None) -> list[Any]:
        """Pipelined GETs; each value lands where ``place`` says (see ``read_value``). After
        a value refused unread (longer than ``most``) the rest are None: misses, never read
        on a connection that is mid-reply."""
        self.begin()
        self.send(self._ask([command(b"GET", k) for k in keys]))
        values: list[Any] = []
        for i in range(len(keys)):
            self._asked()
            values.append(self.read_value(i, head, place, most))
            if self.mid_reply:
                return values + [None] * (len(keys) - len(values))
        return values
