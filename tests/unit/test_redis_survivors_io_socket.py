"""The Redis tier's raw socket (kvtier.tiers.redis_socket) against a scripted peer: every
byte of a pipeline is sent once and in order, a send or a read never outlives its
exchange's deadline, a hang-up is told apart from a silence at once, and the socket
options a read relies on (SO_RCVLOWAT, TCP_NODELAY, the kernel timeouts) are what the
next exchange needs. (Mutation review; the readers above it: test_redis_mux.py.)"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiers.redis_resp import ConnOptions, NodeAddr, ProtocolError
from kvtier.tiers.redis_socket import RedisSocket
from tests.support.resp_peer import cuts, peer

TIMEVAL = struct.Struct("@ll")


def opts(op_timeout_s: float = 2.0, **over: Any) -> ConnOptions:
    return ConnOptions(connect_timeout_s=1.0, op_timeout_s=op_timeout_s, **over)


def sink(got: bytearray, want: int) -> Any:
    """A peer script that keeps the first ``want`` bytes it receives in ``got``."""
    def script(sock: socket.socket) -> None:
        while len(got) < want:
            data = sock.recv(1 << 16)
            if not data:
                return
            got.extend(data)
    return script


def held(served: threading.Event) -> Any:
    """A peer script that says it runs, then holds the connection open a while."""
    def script(sock: socket.socket) -> None:
        served.set()
        time.sleep(0.5)
    return script


def test_a_pipeline_of_more_buffers_than_one_sendmsg_takes_arrives_whole(
        tmp_path: Path) -> None:
    """Past 512 buffers the send goes in slices of IOV_MAX: all at once is EMSGSIZE from
    the kernel (a multi-get's pipeline of many small commands then never left)."""
    bufs = [b"%05d;" % i for i in range(1500)]
    want = b"".join(bufs)
    got = bytearray()
    with (peer(tmp_path, sink(got, len(want)), read_first=False) as addr,
          closing(RedisSocket(addr, opts())) as sock):
        sock.begin()
        sock.send(bufs)
        deadline = time.monotonic() + 5
        while len(got) < len(want) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert bytes(got) == want


def test_a_send_the_peer_never_takes_fails_at_the_deadline(tmp_path: Path) -> None:
    """A peer that stops reading: the send is a TimeoutError at the exchange's deadline,
    never a return with the value half sent (the connection would be reused mid-command
    and the next command read by the server as the rest of this value)."""
    stop = threading.Event()

    def deaf(sock: socket.socket) -> None:
        stop.wait(5)

    with peer(tmp_path, deaf, read_first=False) as addr:
        sock = RedisSocket(addr, opts(op_timeout_s=0.3))
        try:
            sock.begin()
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                sock.send([bytes(32 << 20)])
            assert time.monotonic() - started < 3
        finally:
            stop.set()
            sock.close()


def test_the_kernel_timeout_never_reaches_past_the_deadline(tmp_path: Path) -> None:
    """After a read, SO_RCVTIMEO is what is left of the exchange, less the re-arm margin:
    one set past it lets a silent server hold the exchange beyond op_timeout_s."""
    def answer(sock: socket.socket) -> None:
        sock.sendall(b"+OK\r\n")
        time.sleep(1)

    with (peer(tmp_path, answer, read_first=False) as addr,
          closing(RedisSocket(addr, opts(op_timeout_s=1.0))) as sock):
        sock.begin()
        assert sock._line() == b"+OK"
        sec, usec = TIMEVAL.unpack(sock._sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_RCVTIMEO, TIMEVAL.size))
        assert 0 < sec + usec / 1e6 <= 1.0 - 0.015


def test_many_small_replies_past_the_read_buffer_are_read_exact(tmp_path: Path) -> None:
    """Replies that fill the 64 KiB read buffer with one cut at its end: the unread tail
    is moved to the front (else no room is left, a receive of 0 bytes reads as a
    hang-up, and a sound pipeline fails)."""
    lines = [b"+%s\r\n" % (b"v%d" % i * (1 + i % 9)) for i in range(6000)]
    data = b"".join(lines)
    assert len(data) > 2 * (1 << 16)
    pieces = cuts(data, random.Random(3), most=7000)

    def script(sock: socket.socket) -> None:
        for piece in pieces:
            sock.sendall(piece)

    with (peer(tmp_path, script, read_first=False) as addr,
          closing(RedisSocket(addr, opts())) as sock):
        sock.begin()
        got = [sock._line() for _ in lines]
    assert got == [line[:-2] for line in lines]


def test_a_hang_up_mid_line_is_a_reset_not_a_timeout(tmp_path: Path) -> None:
    """The peer closes mid-reply: ConnectionResetError at once (a receive of 0 bytes),
    not a spin until the deadline read as a slow server."""
    def script(sock: socket.socket) -> None:
        sock.sendall(b"+PAR")

    with (peer(tmp_path, script, read_first=False) as addr,
          closing(RedisSocket(addr, opts(op_timeout_s=5.0))) as sock):
        sock.begin()
        started = time.monotonic()
        with pytest.raises(ConnectionResetError):
            sock._line()
        assert time.monotonic() - started < 2


def test_a_hang_up_mid_value_is_a_reset_not_a_timeout(tmp_path: Path) -> None:
    """As above for a large value read straight into the caller's buffer."""
    def script(sock: socket.socket) -> None:
        sock.sendall(b"x" * 10000)

    with (peer(tmp_path, script, read_first=False) as addr,
          closing(RedisSocket(addr, opts(op_timeout_s=5.0))) as sock):
        sock.begin()
        started = time.monotonic()
        with pytest.raises(ConnectionResetError):
            sock._read_into(memoryview(bytearray(100000)))
        assert time.monotonic() - started < 2


def test_a_hang_up_seen_without_blocking_is_a_reset(tmp_path: Path) -> None:
    """``fill_nowait`` / ``recv_nowait`` on a closed peer raise: taken for "nothing yet",
    the multiplexed reader would wait on a dead socket until the deadline."""
    def script(sock: socket.socket) -> None:
        pass

    with (peer(tmp_path, script, read_first=False) as addr,
          closing(RedisSocket(addr, opts())) as sock):
        sock.begin()
        time.sleep(0.2)
        with pytest.raises(ConnectionResetError):
            sock.fill_nowait()
        with pytest.raises(ConnectionResetError):
            sock.recv_nowait(memoryview(bytearray(8)))


def test_a_line_longer_than_the_read_buffer_is_a_protocol_error(tmp_path: Path) -> None:
    """A reply line past 64 KiB is refused as not RESP the tier reads."""
    def script(sock: socket.socket) -> None:
        sock.sendall(b"+" + b"a" * (1 << 17))
        time.sleep(1)

    with (peer(tmp_path, script, read_first=False) as addr,
          closing(RedisSocket(addr, opts())) as sock):
        sock.begin()
        with pytest.raises(ProtocolError):
            sock._line()


def test_begin_puts_the_low_water_mark_back_to_one_byte(tmp_path: Path) -> None:
    """A read that ended mid-value left SO_RCVLOWAT raised: the next exchange's poll must
    wake on its first byte again (else a short reply never wakes the reader)."""
    served = threading.Event()
    with (peer(tmp_path, held(served), tcp=True, read_first=False) as addr,
          closing(RedisSocket(addr, opts())) as sock):
        served.wait(5)
        lowat = sock._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
        sock.wake_at(5000)
        if sock._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == lowat:
            pytest.skip("this kernel does not raise SO_RCVLOWAT")
        sock.begin()
        assert sock._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1


class _RefusesLowering:
    """A socket whose SO_RCVLOWAT cannot be set back to 1."""

    def __init__(self, real: socket.socket) -> None:
        self.real = real

    def setsockopt(self, level: int, opt: int, value: Any) -> None:
        if opt == socket.SO_RCVLOWAT and value == 1:
            raise OSError("refused")
        self.real.setsockopt(level, opt, value)

    def close(self) -> None:
        self.real.close()


def test_a_mark_that_cannot_be_lowered_again_raises(tmp_path: Path) -> None:
    """Raising the mark may fail quietly (reads then wake as data comes), lowering it may
    not: the connection would keep a mark above the next reply and stall on it."""
    served = threading.Event()
    with (peer(tmp_path, held(served), tcp=True, read_first=False) as addr,
          closing(RedisSocket(addr, opts())) as sock):
        served.wait(5)
        real = sock._sock
        sock._sock = _RefusesLowering(real)  # type: ignore[assignment]
        sock.wake_at(5000)
        with pytest.raises(OSError):
            sock.wake_at(1)


def test_a_tcp_connection_sends_without_delay(tmp_path: Path) -> None:
    """TCP_NODELAY: a pipeline's last segment is not held back by Nagle for 40 ms."""
    served = threading.Event()
    with (peer(tmp_path, held(served), tcp=True, read_first=False) as addr,
          closing(RedisSocket(addr, opts())) as sock):
        served.wait(5)
        assert sock._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_a_unix_socket_that_cannot_connect_is_closed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed connect releases its descriptor (a tier reconnecting with backoff to a
    missing socket would otherwise leak one per try). The sockets this thread makes are
    tracked, not the garbage collector's warnings, which other tests' leftovers raised too
    (a CI run failed on two)."""
    made: list[socket.socket] = []
    me = threading.get_ident()

    class Tracked(socket.socket):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if threading.get_ident() == me:   # (another test's thread may still accept)
                made.append(self)

    monkeypatch.setattr(socket, "socket", Tracked)
    addr = NodeAddr(str(tmp_path / "missing.sock"), 0, unix=True)
    with pytest.raises(OSError):
        RedisSocket(addr, opts())
    assert len(made) == 1
    assert made[0].fileno() == -1


def test_a_unix_connect_to_a_full_backlog_gives_up_at_the_connect_timeout(
        tmp_path: Path) -> None:
    """A server that accepts nothing: the connect is bounded by connect_timeout_s."""
    path = str(tmp_path / "full.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(0)
    fillers: list[socket.socket] = []
    outcome: list[BaseException | None] = []

    def attempt() -> None:
        try:
            RedisSocket(NodeAddr(path, 0, unix=True),
                        ConnOptions(connect_timeout_s=0.3, op_timeout_s=1.0)).close()
            outcome.append(None)
        except BaseException as exc:   # (handed to the test's thread)
            outcome.append(exc)

    try:
        for _ in range(4):   # fill the backlog (non-blocking: the last ones are refused)
            filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            filler.setblocking(False)
            fillers.append(filler)
            try:
                filler.connect(path)
            except BlockingIOError:
                break
        thread = threading.Thread(target=attempt, daemon=True)
        thread.start()
        thread.join(3)
        assert outcome, "the connect hung past its timeout"
        assert isinstance(outcome[0], OSError)
    finally:
        for filler in fillers:
            filler.close()
        srv.close()
        thread.join(3)


def test_a_new_exchange_rearms_the_kernel_timeout(tmp_path: Path) -> None:
    """The previous exchange armed SO_RCVTIMEO for the little it had left; ``begin``
    forgets that arming, else the next exchange's first read keeps the short timeout
    and a sound reply 150 ms away fails as a timeout."""
    def script(sock: socket.socket) -> None:
        sock.sendall(b"+A\r\n")
        time.sleep(1.1)
        sock.sendall(b"+B\r\n")
        time.sleep(0.5)

    with (peer(tmp_path, script, read_first=False) as addr,
          closing(RedisSocket(addr, opts(op_timeout_s=1.0))) as sock):
        sock.begin()
        time.sleep(0.88)   # about 0.1 s left: armed for about 0.08 s
        assert sock._line() == b"+A"
        sock.begin()
        assert sock._line() == b"+B"


def test_buffered_bytes_come_first_and_drop_and_skip_take_exactly(tmp_path: Path) -> None:
    """``recv_nowait`` hands out buffered bytes before the socket's (else a value's bytes
    are stored out of order), ``drop`` discards no more than is buffered, ``_skip``
    discards exactly n bytes over several reads, and a reply left in the read buffer makes
    the socket ``stale`` (an idle one is not)."""
    big = (1 << 20) + 5000
    data = b"abcdef" + b"z" * big + b"+OK\r\n+X\r\n"

    def script(sock: socket.socket) -> None:
        sock.sendall(data)
        time.sleep(0.5)

    with (peer(tmp_path, script, read_first=False) as addr,
          closing(RedisSocket(addr, opts())) as sock):
        sock.begin()
        time.sleep(0.1)
        assert sock.fill_nowait(3) and sock.buffered() == 3
        out = memoryview(bytearray(6))
        assert sock.recv_nowait(out) == 3
        assert sock.recv_nowait(out[3:]) == 3 and bytes(out) == b"abcdef"
        assert sock.fill_nowait(2) and sock.drop(10) == 2 and sock.buffered() == 0
        sock._skip(big - 2)
        assert sock._line() == b"+OK" and sock.stale()   # "+X" buffered: stale
        assert sock._line() == b"+X" and not sock.stale()
