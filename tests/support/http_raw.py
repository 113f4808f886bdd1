"""Raw HTTP connections to a test daemon, for requests urllib would not send."""

from __future__ import annotations

import socket

from tests.support.daemon import DaemonProcess


def http_addr(d: DaemonProcess) -> tuple[str, int]:
    """(host, port) of the daemon's HTTP listener."""
    host, port = d.http_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def raw_http(d: DaemonProcess, data: bytes = b"") -> socket.socket:
    """A connection to the daemon's HTTP port, ``data`` sent on it."""
    s = socket.create_connection(http_addr(d), timeout=10)
    if data:
        s.sendall(data)
    return s


def closed_within(s: socket.socket, seconds: float) -> bytes:
    """What the daemon sent before closing ``s``; socket.timeout if it is still open after
    ``seconds``."""
    s.settimeout(seconds)
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got
