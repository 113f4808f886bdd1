"""Bounded reads for the client commands (``stats``, ``explain``, ``doctor``): an HTTP GET
with one deadline for the whole exchange and a cap on the body, and a file read that takes
only regular files under the same cap.

A per-socket timeout alone lets a server that sends a byte a second keep a command running
forever, and ``resp.read()`` takes a 4 GB body whole; a FIFO blocks ``open`` and
``/dev/zero`` never ends. Every failure here is a :class:`FetchError` whose message is one
phrase (the caller names the source), never a traceback.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import urllib.parse

from kvtier.files import NotRegularFile, TooLarge, read_regular

MAX_BODY_BYTES = 64 << 20
"""Largest body or file read (a /v1/stats or vLLM /metrics page is tens of KB)."""
DEFAULT_DEADLINE_S = 10.0
"""Seconds one fetch may take in all (connect, headers, body) when the caller gives none."""
_CHUNK = 1 << 16


class FetchError(Exception):
    """Why a source gave no usable bytes, as one phrase; the caller names the source."""


class Unreachable(FetchError):
    """Nothing answered: no connection, refused, reset before a reply, name not resolved."""


def _shown(text: str, limit: int = 80) -> str:
    """A peer's text (an HTTP reason phrase) made safe for one line of a terminal."""
    clean = "".join(c if c.isprintable() else "?" for c in text)
    return clean if len(clean) <= limit else clean[:limit] + "..."


def _phrase(exc: BaseException) -> str:
    """What an http.client or socket failure means, in words."""
    if isinstance(exc, http.client.RemoteDisconnected):
        return "the connection closed without a reply"
    if isinstance(exc, http.client.BadStatusLine):
        return "not an HTTP reply (bad status line)"
    if isinstance(exc, http.client.IncompleteRead):
        return f"the reply ended early ({len(exc.partial)} bytes of the body)"
    if isinstance(exc, http.client.HTTPException):
        return f"malformed HTTP reply ({type(exc).__name__})"
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timed out"
    if isinstance(exc, OSError):
        return _shown(exc.strerror or str(exc) or type(exc).__name__)
    return _shown(str(exc) or type(exc).__name__)


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    """The connection for ``url`` (not yet open) and the request target (path and query)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:   # "Invalid IPv6 URL", a port out of range
        raise FetchError(f"not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError("not an http(s) URL")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.hostname, port, timeout=timeout), target


def get(url: str, *, deadline_s: float = DEFAULT_DEADLINE_S,
        max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The body of a 2xx answer to ``GET url``; FetchError when none came, the status is not
    2xx, the body is cut short or over ``max_bytes``, or it all took over ``deadline_s``.

    A timer shuts the socket down at the deadline, which wakes a read blocked in headers or
    body whatever the peer's pace; redirects are not followed (the daemon sends none)."""
    conn, target = _connection(url, deadline_s)
    expired = threading.Event()
    opened: list[socket.socket] = []   # the connection forgets its socket once a reply
    #                                    that closes it has begun ("Connection: close"): a
    #                                    body without a length is read from it after that

    def cut() -> None:
        expired.set()
        for sock in (conn.sock, *opened):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(deadline_s, cut)
    timer.daemon = True
    timer.start()
    try:
        try:
            conn.connect()
        except (OSError, ValueError) as exc:   # ValueError: a host name IDNA cannot encode
            if expired.is_set():
                raise Unreachable(f"no connection within {deadline_s:g} s") from None
            raise Unreachable(_phrase(exc)) from None
        if conn.sock is not None:
            opened.append(conn.sock)
        if expired.is_set():   # the timer fired before ``conn.sock`` was set: nothing cut
            raise Unreachable(f"no connection within {deadline_s:g} s")
        return _exchange(conn, target, max_bytes, expired, deadline_s)
    finally:
        timer.cancel()
        conn.close()


def _exchange(conn: http.client.HTTPConnection, target: str, max_bytes: int,
              expired: threading.Event, deadline_s: float) -> bytes:
    """Send the GET on an open connection and read the body, one piece at a time."""
    late = f"no complete reply within {deadline_s:g} s: the server is too slow"
    body = bytearray()
    try:
        conn.request("GET", target, headers={"Accept": "*/*", "Connection": "close"})
        resp = conn.getresponse()
        if not 200 <= resp.status < 300:
            raise FetchError(f"HTTP {resp.status} {_shown(resp.reason)}")
        if resp.length is not None and resp.length > max_bytes:
            raise FetchError(f"the reply is {resp.length:,} bytes, over the "
                             f"{max_bytes:,}-byte cap")
        while piece := resp.read1(min(_CHUNK, max_bytes + 1 - len(body))):
            body += piece
            if len(body) > max_bytes:
                raise FetchError(f"the reply is over the {max_bytes:,}-byte cap")
        if expired.is_set():
            raise FetchError(late)
        if resp.length:   # read1 ends quietly when the peer closes before Content-Length
            raise FetchError(f"the reply ended early ({len(body)} of "
                             f"{len(body) + resp.length} bytes)")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if expired.is_set():
            raise FetchError(late) from None
        if isinstance(exc, ConnectionError) and not body:
            raise Unreachable(_phrase(exc)) from None
        raise FetchError(_phrase(exc)) from None
    return bytes(body)


def read_file(path: str, *, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """A regular file's bytes, at most ``max_bytes``; FetchError for anything else: a FIFO
    would block forever, a device such as /dev/zero would read until memory runs out.

    (``kvtier.files.read_regular``)."""
    try:
        return read_regular(path, max_bytes)
    except NotRegularFile:
        raise FetchError("not a regular file (a FIFO, device or directory): give a saved "
                         "file") from None
    except TooLarge:
        raise FetchError(f"larger than {max_bytes >> 20} MiB") from None
    except OSError as exc:
        raise FetchError(_phrase(exc)) from None
