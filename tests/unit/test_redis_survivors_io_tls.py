"""The Redis tier's raw socket over TLS (kvtier.tiers.redis_socket), the behaviour no other
test pinned (mutation review): the certificate name checked is ``tls_hostname`` when given,
every send and receive is bounded by what is left of the exchange's deadline, and bytes
the TLS layer decrypted past the replies read make the connection stale (reused, its next
exchange would read them as its own reply)."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiers.redis_resp import ConnOptions
from kvtier.tiers.redis_socket import RedisSocket
from tests.support.certs import self_signed
from tests.support.resp_peer import peer


class Recorded:
    """A plain socket standing in for a TLS one: records ``settimeout``."""

    def __init__(self, real: socket.socket) -> None:
        self.real = real
        self.timeouts: list[float | None] = []

    def settimeout(self, value: float | None) -> None:
        self.timeouts.append(value)
        self.real.settimeout(value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class FakeTLS:
    """An ``ssl.SSLContext`` stand-in: records the name asked for, wraps nothing."""

    def __init__(self) -> None:
        self.names: list[str | None] = []
        self.wrapped: list[Recorded] = []

    def wrap_socket(self, sock: socket.socket, *, server_hostname: str | None) -> Recorded:
        self.names.append(server_hostname)
        self.wrapped.append(Recorded(sock))
        return self.wrapped[-1]


def opts(tls: Any, op_timeout_s: float = 1.0, **over: Any) -> ConnOptions:
    return ConnOptions(connect_timeout_s=1.0, op_timeout_s=op_timeout_s, tls=tls, **over)


def answers(reply: bytes) -> Any:
    def script(sock: socket.socket) -> None:
        sock.sendall(reply)
        time.sleep(0.5)
    return script


def test_the_certificate_name_is_tls_hostname_when_given(tmp_path: Path) -> None:
    """A server reached by address whose certificate names a host: ``tls_hostname`` is
    the name checked (ignored, every such connection fails its handshake)."""
    tls = FakeTLS()
    served = threading.Event()

    def script(sock: socket.socket) -> None:
        served.set()

    with peer(tmp_path, script, tcp=True, read_first=False) as addr:
        RedisSocket(addr, opts(tls, tls_hostname="cache.internal")).close()
        RedisSocket(addr, opts(tls)).close()
        served.wait(5)   # (the peer's thread has started: it may be stopped now)
    assert tls.names == ["cache.internal", addr.host]


def test_a_tls_read_is_bounded_by_what_is_left_of_the_exchange(tmp_path: Path) -> None:
    """The socket timeout set before a read is the deadline's rest, not op_timeout_s
    again (each read of a slow reply would restart the clock)."""
    tls = FakeTLS()
    with (peer(tmp_path, answers(b"+OK\r\n"), tcp=True, read_first=False) as addr,
          closing(RedisSocket(addr, opts(tls, op_timeout_s=1.0))) as sock):
        sock.begin()
        time.sleep(0.3)
        assert sock._line() == b"+OK"
    last = tls.wrapped[0].timeouts[-1]
    assert last is not None and 0 < last <= 0.75


def test_a_tls_send_after_the_deadline_times_out(tmp_path: Path) -> None:
    """A send is armed like a read: past the deadline it raises before writing (else
    a command goes out on an exchange already given up)."""
    tls = FakeTLS()
    with (peer(tmp_path, answers(b""), tcp=True, read_first=False) as addr,
          closing(RedisSocket(addr, opts(tls, op_timeout_s=0.1))) as sock):
        sock.begin()
        time.sleep(0.15)
        with pytest.raises(TimeoutError):
            sock.send([b"*1\r\n$4\r\nPING\r\n"])


def _server_context(tmp_path: Path) -> ssl.SSLContext:
    """A TLS server context with a fresh self-signed certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(*map(str, self_signed(tmp_path, "localhost")))
    return ctx


def test_bytes_decrypted_past_the_replies_make_a_tls_connection_stale(
        tmp_path: Path) -> None:
    """A value and a reply too many in one TLS record: the value is read straight into
    its buffer, the extra reply is left decrypted inside the TLS layer (the kernel socket
    holds nothing). ``stale`` must see it, else the pool reuses the connection and its
    next exchange reads that reply as its own."""
    server_ctx = _server_context(tmp_path)
    client_ctx = ssl.create_default_context()
    client_ctx.check_hostname = False
    client_ctx.verify_mode = ssl.CERT_NONE
    value = bytes(range(256)) * 20
    done = threading.Event()

    def script(conn: socket.socket) -> None:
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            tls.sendall(value + b"+EXTRA\r\n")   # one record
            done.wait(5)

    with peer(tmp_path, script, tcp=True, read_first=False) as addr:
        sock = RedisSocket(addr, opts(client_ctx, op_timeout_s=2.0))
        try:
            sock.begin()
            out = memoryview(bytearray(len(value)))
            sock._read_into(out)
            assert bytes(out) == value
            time.sleep(0.05)
            assert sock.buffered() == 0
            assert sock.stale()
        finally:
            done.set()
            sock.close()


class SlowTLS:
    """A TLS socket whose every send takes 0.15 s (a slow-reading server); a send given
    less time than that times out when it runs out."""

    def __init__(self, real: socket.socket) -> None:
        self.real = real
        self.timeout: float | None = None

    def settimeout(self, value: float | None) -> None:
        self.timeout = value

    def send(self, data: Any) -> int:
        if self.timeout is not None and self.timeout < 0.15:
            time.sleep(self.timeout)
            raise TimeoutError("The write operation timed out")
        time.sleep(0.15)
        return len(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class SlowContext:
    def wrap_socket(self, sock: socket.socket, *, server_hostname: str | None) -> SlowTLS:
        return SlowTLS(sock)


def test_a_tls_send_of_several_buffers_ends_by_the_deadline(tmp_path: Path) -> None:
    """A value goes out as header, payload and CRLF: sendall per buffer gave each the
    whole op_timeout_s again (and Python's TLS sendall per 16 KiB record), so a slow
    reader held one exchange several times its deadline."""
    with (peer(tmp_path, lambda s: time.sleep(1.5), tcp=True, read_first=False) as addr,
          closing(RedisSocket(addr, opts(SlowContext(), op_timeout_s=0.4))) as sock):
        sock.begin()
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not answer within"):
            sock.send([b"*3\r\n", b"x" * 100, b"\r\n", b"y" * 100])
        assert time.monotonic() - started <= 0.47
