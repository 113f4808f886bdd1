"""A blocking socket to one Redis server with a deadline per exchange (the Redis tier's
worker threads use it through ``kvtier.tiers.redis_wire.Conn``, which speaks RESP on it).

Every read and write of an exchange (``begin``) must end within ``op_timeout_s``. A plain
(non-TLS) socket stays in blocking mode with kernel timeouts (SO_RCVTIMEO / SO_SNDTIMEO, set
to what is left of the exchange's deadline): a payload is then received with one
``recv_into(MSG_WAITALL)`` and a pipeline sent with one ``sendmsg``, instead of a poll and a
partial read or write per socket-buffer's worth with the GIL taken back each time (Python's
socket timeouts make the descriptor non-blocking). Reply lines and small values go through
a read buffer; the non-blocking half (``*_nowait``, ``wake_at``) lets kvtier.tiers.redis_mux
read several connections from one thread.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import time
from collections.abc import Sequence

from kvtier.tiers.redis_resp import CRLF, ConnOptions, NodeAddr, ProtocolError

_SCRATCH = 1 << 16           # read buffer for reply lines and small values
_IOV_MAX = 512               # buffers per sendmsg call (Linux IOV_MAX is 1024)
_TIMEVAL = struct.Struct("@ll")   # struct timeval for SO_RCVTIMEO / SO_SNDTIMEO
_REARM_S = 0.02                   # a kernel timeout is set again at most this often
_SMALL = 4096                     # reads up to this size go through the read buffer


class RedisSocket:
    """One blocking socket with deadlines and a read buffer (see the module docstring)."""

    __slots__ = ("_armed", "_buf", "_deadline", "_hi", "_lo", "_lowat", "_op_timeout", "_plain",
                 "_sock", "_tcp", "addr")

    def __init__(self, addr: NodeAddr, opts: ConnOptions) -> None:
        self.addr = addr
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
        if not self._plain:   # TLS: sendall would give each call (and record) the
            for buf in bufs:      # whole timeout again; each send gets the deadline's rest
                view = memoryview(buf).cast("B")
                while view:
                    self._arm()
                    try:
                        view = view[self._sock.send(view):]
                    except TimeoutError:
                        raise self._timed_out() from None
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

    def stale(self) -> bool:
        """Whether bytes have arrived past the replies read so far: buffered, or waiting in
        the socket (one non-blocking peek; a TLS socket: its decrypted bytes only). Checked
        between two exchanges on one connection, where a reply too many would be read by
        the next exchange as its own (found by review: a stripe's GETRANGE answered twice
        was read as the next stripe, and the sound block deleted as corrupt)."""
        if self._hi > self._lo:
            return True
        if isinstance(self._sock, ssl.SSLSocket):
            return self._sock.pending() > 0
        try:
            return bool(self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            return False

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
