"""A small blocking RESP connection for the Redis tier's block traffic (GET/SET/EXISTS/DEL).

Why not redis-py for blocks: on Python 3.11 its asyncio writer joins every command into one
``bytes`` (a copy of each value), and a GET reply becomes a new ``bytes`` that the tier then
copies again into the arena. Here a SET goes out with ``sendmsg`` as [command prefix, frame
header, payload view, CRLF] straight from the caller's buffers, and a GET's payload is
received straight into the caller's buffer (``recv_into``) and checked there.

A ``Conn`` is a blocking socket with a timeout on every read and write (so every wait is
bounded by ``op_timeout_s``), used by one worker thread at a time: kernel copies and
checksums release the GIL, so several requests are in flight over several connections.
A plain (non-TLS) socket stays in blocking mode with kernel timeouts (SO_RCVTIMEO /
SO_SNDTIMEO, set to what is left of the exchange's deadline): a payload is then received
with one ``recv_into(MSG_WAITALL)`` and a pipeline sent with one ``sendmsg``, instead of a
poll and a partial read or write per socket-buffer's worth with the GIL taken back each time
(Python's socket timeouts make the descriptor non-blocking).
A connection that failed in any way mid-command is closed, never reused
(kvtier.tiers.redis_pool keeps the idle ones per server). With ``asking`` set, every command
goes out behind an ASKING (a Redis Cluster slot being migrated: the key is asked for at the
slot's new owner before the move is over) and its +OK is read and checked.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

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

_SCRATCH = 1 << 16           # read buffer for reply lines and small values
_IOV_MAX = 512               # buffers per sendmsg call (Linux IOV_MAX is 1024)
SEND_PIECE_BYTES = 1 << 20     # a SET pipeline is sent in pieces of about this size
_TIMEVAL = struct.Struct("@ll")   # struct timeval for SO_RCVTIMEO / SO_SNDTIMEO
_REARM_S = 0.02                   # a kernel timeout is set again at most this often
_SMALL = 4096                     # reads up to this size go through the read buffer
_ASKING = command(b"ASKING")


class Conn:
    """One blocking RESP connection (see the module docstring)."""

    __slots__ = ("_armed", "_buf", "_deadline", "_hi", "_lo", "_lowat", "_op_timeout", "_plain",
                 "_sock", "_tcp", "addr", "asking")

    def __init__(self, addr: NodeAddr, opts: ConnOptions) -> None:
        self.addr = addr
        self.asking = False   # send each command behind an ASKING (see the module docstring)
        if addr.unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(opts.connect_timeout_s)
            try:
                sock.connect(addr.host)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((addr.host, addr.port), opts.connect_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if opts.tls is not None:
            sock = opts.tls.wrap_socket(sock, server_hostname=opts.tls_hostname or addr.host)
        self._plain = opts.tls is None
        self._tcp = self._plain and not addr.unix
        self._lowat = 1
        sock.settimeout(None if self._plain else opts.op_timeout_s)  # plain: kernel timeouts
        self._sock = sock
        self._op_timeout = opts.op_timeout_s
        self._deadline = time.monotonic() + opts.op_timeout_s
        self._armed: dict[int, float] = {}   # socket option -> until when its timeout holds
        self._buf = bytearray(_SCRATCH)
        self._lo = self._hi = 0
        try:
            self._handshake(opts)
        except BaseException:
            self.close()
            raise

    def _handshake(self, opts: ConnOptions) -> None:
        cmds: list[bytes] = []
        if opts.password:
            auth = (opts.username.encode(),) if opts.username else ()
            cmds.append(command(b"AUTH", *auth, opts.password.encode()))
        if opts.db:
            cmds.append(command(b"SELECT", str(opts.db).encode()))
        if not cmds:
            return
        self.begin()
        self.send(cmds)
        for _ in cmds:
            reply = self.read_reply()
            if isinstance(reply, ErrorReply):
                raise PermissionError(f"redis {self.addr} refused authentication: {reply}")

    def begin(self) -> None:
        """Start one exchange: all of it (every send and read) must end within op_timeout_s."""
        self._deadline = time.monotonic() + self._op_timeout
        self._armed.clear()
        if self._lowat != 1:   # left raised by a read that ended mid-value: wake on a byte
            self.wake_at(1)

    def _arm(self, opt: int = socket.SO_RCVTIMEO) -> None:
        """Bound the next socket call (a receive, or a send with SO_SNDTIMEO) by what is
        left of the exchange's deadline."""
        now = time.monotonic()
        left = self._deadline - now
        if left <= 1e-6:   # (a zero timeval would mean "no timeout" to the kernel)
            raise self._timed_out()
        if self._plain:
            if now < self._armed.get(opt, 0.0):
                return   # armed moments ago for a deadline it still meets: no syscall
            if left > 2 * _REARM_S:   # a timeout short of the deadline by _REARM_S holds
                left -= _REARM_S      # for calls in the next _REARM_S
                self._armed[opt] = now + _REARM_S
            else:
                self._armed.pop(opt, None)
            sec = int(left)
            self._sock.setsockopt(socket.SOL_SOCKET, opt,
                                  _TIMEVAL.pack(sec, max(1, int((left - sec) * 1e6))))
        else:
            self._sock.settimeout(left)

    def _timed_out(self) -> TimeoutError:
        return TimeoutError(f"redis {self.addr} did not answer within {self._op_timeout} s")

    def close(self) -> None:
        with contextlib.suppress(OSError):  # already broken: nothing left to release
            self._sock.close()

    # --- sending --------------------------------------------------------------------------

    def send(self, bufs: Sequence[bytes | bytearray | memoryview]) -> None:
        """Write every buffer in order without joining them (no copy of large values)."""
        if not self._plain:
            self._arm()
            for buf in bufs:
                self._sock.sendall(buf)
            return
        views = [memoryview(b).cast("B") for b in bufs if len(b)]
        if len(views) <= _IOV_MAX:
            # first without blocking, so without arming the send timeout (a syscall): a
            # pipeline of commands fits the socket's buffer, and a GET job is one
            with contextlib.suppress(BlockingIOError):
                _advance(views, self._sock.sendmsg(views, (), socket.MSG_DONTWAIT))
        while views:
            self._arm(socket.SO_SNDTIMEO)
            try:   # blocking: returns once all was queued, or short at the deadline
                sent = self._sock.sendmsg(views[:_IOV_MAX])
            except BlockingIOError:   # SO_SNDTIMEO passed with nothing sent
                raise self._timed_out() from None
            _advance(views, sent)

    # --- receiving ------------------------------------------------------------------------

    def _room(self) -> memoryview:
        """The read buffer's free end (the unread tail moved to the front when short)."""
        if self._lo == self._hi:
            self._lo = self._hi = 0
        elif len(self._buf) - self._hi < _SMALL:
            tail = self._hi - self._lo
            self._buf[:tail] = self._buf[self._lo:self._hi]
            self._lo, self._hi = 0, tail
        return memoryview(self._buf)[self._hi:]

    def _fill(self) -> None:
        room = self._room()
        self._arm()
        try:
            n = self._sock.recv_into(room)
        except BlockingIOError:   # SO_RCVTIMEO passed (plain sockets)
            raise self._timed_out() from None
        if n == 0:
            raise ConnectionResetError(f"redis {self.addr} closed the connection")
        self._hi += n

    def _line(self) -> bytes:
        while (line := self.take_line()) is None:
            self._fill()
        return line

    def _read_into(self, out: memoryview) -> None:
        """Fill ``out`` exactly: buffered bytes first, then straight from the socket (a small
        ``out`` through the read buffer: a value's CRLF comes with the next reply's line in
        one receive instead of one each)."""
        if out.nbytes <= _SMALL:
            while self.buffered() < out.nbytes:
                self._fill()
            self.take_into(out, 0)
            return
        pos = self.take_into(out, 0)
        flags = socket.MSG_WAITALL if self._plain else 0
        while pos < out.nbytes:
            self._arm()
            try:   # plain: one call for the whole rest (short only at the deadline)
                n = self._sock.recv_into(out[pos:], 0, flags)
            except BlockingIOError:
                raise self._timed_out() from None
            if n == 0:
                raise ConnectionResetError(f"redis {self.addr} closed the connection")
            pos += n

    # --- receiving without blocking (kvtier.tiers.redis_mux reads several at once) -----

    @property
    def deadline(self) -> float:
        """When the current exchange must have ended (``time.monotonic``)."""
        return self._deadline

    def fileno(self) -> int:
        return self._sock.fileno()

    def wake_at(self, nbytes: int) -> None:
        """Have ``poll`` report the socket readable only once ``nbytes`` have arrived
        (SO_RCVLOWAT; 1, the default, restores it). A value's body then comes in one
        receive, not one per 64 KiB a Redis server writes to a client per turn of its
        loop. The kernel caps the mark at half the largest receive buffer and reports a
        socket whose window closed anyway, so a mark never above the bytes still due
        cannot stall a read. Plain TCP only (a no-op elsewhere); ``begin`` puts it back
        at 1 for the next exchange. A kernel that refuses to raise the mark (a sandbox's)
        turns it off for the connection: reads then wake as data comes, as before; one
        that refuses to lower it again raises (the connection is then discarded)."""
        n = max(1, nbytes)
        if n != self._lowat and self._tcp:
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
            except OSError:
                if n == 1:
                    raise
                self._tcp = False
                return
            self._lowat = n

    def take_line(self) -> bytes | None:
        """A reply line from the read buffer, or None when it holds no whole line yet."""
        end = self._buf.find(CRLF, self._lo, self._hi)
        if end < 0:
            if self._hi - self._lo >= len(self._buf):
                raise ProtocolError("reply line longer than the read buffer")
            return None
        line = bytes(self._buf[self._lo:end])
        self._lo = end + 2
        return line

    def take_into(self, out: memoryview, pos: int) -> int:
        """Copy buffered bytes into ``out[pos:]``; the new position."""
        have = min(self._hi - self._lo, out.nbytes - pos)
        if have > 0:
            out[pos:pos + have] = self._buf[self._lo:self._lo + have]
            self._lo += have
            pos += have
        return pos

    def fill_nowait(self, cap: int = 0) -> bool:
        """Receive what has arrived into the read buffer, at most ``cap`` bytes when given
        (so that a large value's body is left in the socket for ``recv_nowait`` straight
        into its buffer); False when nothing had."""
        room = self._room()
        n = self._recv_nowait(room[:cap] if cap else room)
        self._hi += n
        return n > 0

    def recv_nowait(self, out: memoryview) -> int:
        """Receive what has arrived straight into ``out`` (buffered bytes first); 0 when
        nothing had."""
        pos = self.take_into(out, 0)
        if pos:
            return pos
        return self._recv_nowait(out)

    def buffered(self) -> int:
        """Bytes received and not yet taken."""
        return self._hi - self._lo

    def drop(self, n: int) -> int:
        """Discard up to ``n`` buffered bytes; how many were."""
        n = min(n, self._hi - self._lo)
        self._lo += n
        return n

    @property
    def plain(self) -> bool:
        """Whether the connection is a plain socket (not TLS, which may hold decrypted bytes
        that polling the socket does not see)."""
        return self._plain

    def send_nowait(self, data: memoryview) -> int:
        """Send what the socket takes now, without blocking; how many bytes it took."""
        try:
            return self._sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0

    def _recv_nowait(self, out: memoryview) -> int:
        try:
            n = self._sock.recv_into(out, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        if n == 0:
            raise ConnectionResetError(f"redis {self.addr} closed the connection")
        return n

    def timed_out(self) -> TimeoutError:
        """The error of an exchange that ran past its deadline (the connection is unusable)."""
        return self._timed_out()

    def _skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            step = min(n, scratch.nbytes)
            self._read_into(scratch[:step])
            n -= step

    def read_reply(self) -> Any:
        """Read one reply: bytes, int, None, ErrorReply, str (+OK) or a list of those."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return ErrorReply(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            out = bytearray(n + 2)
            self._read_into(memoryview(out))
            return bytes(out[:n])
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read_reply() for _ in range(n)]
        raise ProtocolError(f"unexpected reply type {kind!r} from redis {self.addr}")

    def read_value(self, index: int, head: int, place: Placer) -> int | ErrorReply | None:
        """Read one GET reply: None (missing), an ErrorReply, or the value's length.

        The first ``head`` bytes of the value are read into a small buffer and handed to
        ``place``, which says where the rest goes (e.g. straight into the caller's block).
        """
        line = self._line()
        if line[:1] == b"-":
            return ErrorReply(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise ProtocolError(f"expected a bulk reply from redis {self.addr}, got {line[:1]!r}")
        n = int(line[1:])
        if n < 0:
            return None
        first = bytearray(min(head, n))
        self._read_into(memoryview(first))
        dest = place(index, bytes(first), n)
        rest = n - len(first)
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

    def _replies(self, n: int) -> list[Any]:
        """``n`` replies (each after its ASKING's +OK while ``asking``)."""
        if not self.asking:
            return [self.read_reply() for _ in range(n)]
        replies = []
        for _ in range(n):
            self._asked()
            replies.append(self.read_reply())
        return replies

    def simple_many(self, cmds: Sequence[bytes]) -> list[Any]:
        """Send pre-encoded small commands in one write; read one reply each."""
        self.begin()
        self.send(self._ask(cmds))
        return self._replies(len(cmds))

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

    def getrange_into(self, key: bytes, start: int, dest: memoryview) -> int | ErrorReply | None:
        """GETRANGE of ``dest.nbytes`` bytes from ``start``, received straight into
        ``dest`` (``read_value``); the length of the reply (``dest`` is filled only when it
        is exact)."""
        self.begin()
        self.send(self._ask([command(b"GETRANGE", key, b"%d" % start,
                                     b"%d" % (start + dest.nbytes - 1))]))
        self._asked()
        return self.read_value(0, 0, lambda _i, _head, n: dest if n == dest.nbytes else None)

    def get_exact(self, key: bytes, dest: memoryview) -> int | ErrorReply | None:
        """GET a value received straight into ``dest``; the value's length (``dest`` is
        filled only when it is exact), None when missing."""
        self.begin()
        self.send(self._ask([command(b"GET", key)]))
        self._asked()
        return self.read_value(0, 0, lambda _i, _head, n: dest if n == dest.nbytes else None)

    def get_many(self, keys: Sequence[bytes], head: int, place: Placer) -> list[Any]:
        """Pipelined GETs; each value lands where ``place`` says (see ``read_value``)."""
        self.begin()
        self.send(self._ask([command(b"GET", k) for k in keys]))
        values = []
        for i in range(len(keys)):
            self._asked()
            values.append(self.read_value(i, head, place))
        return values


def _advance(views: list[memoryview], sent: int) -> None:
    """Drop the ``sent`` bytes from the front of ``views`` (in place)."""
    while sent:
        n = views[0].nbytes
        if sent >= n:
            sent -= n
            views.pop(0)
        else:
            views[0] = views[0][sent:]
            sent = 0
