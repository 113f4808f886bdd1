"""Bounded client reads pinned where a mutation review found them unwatched: httpget (the
CLI's GET of the daemon), files.read_regular, jsonin and statsdoc's typed accessors. The
peer is a thread on a 127.0.0.1 socket; no process is started."""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier import httpget, jsonin
from kvtier.files import NotRegularFile, TooLarge, read_regular
from kvtier.statsdoc import MalformedStats, check_policy, clean, number, scalar

Reply = Callable[[socket.socket], None]


class Peer:
    """A server answering each connection with ``reply``; ``requests`` holds what came."""

    def __init__(self, reply: Reply) -> None:
        self.requests: list[bytes] = []
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.srv.getsockname()[1]}"
        self._reply = reply
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            try:
                self.requests.append(c.recv(65536))
                self._reply(c)
            except OSError:
                pass
            finally:
                c.close()


@pytest.fixture
def peer() -> Iterator[Callable[[Reply], Peer]]:
    peers: list[Peer] = []

    def start(reply: Reply) -> Peer:
        peers.append(Peer(reply))
        return peers[-1]

    yield start
    for p in peers:
        p.srv.close()


def send(data: bytes) -> Reply:
    return lambda c: c.sendall(data)


def ok(body: bytes, length: bool = True) -> Reply:
    head = b"HTTP/1.1 200 OK\r\nConnection: close\r\n"
    if length:
        head += b"Content-Length: %d\r\n" % len(body)
    return send(head + b"\r\n" + body)


def test_the_query_string_is_sent(peer: Callable[[Reply], Peer]) -> None:
    """Without it, /v1/lookups/recent?limit=..&misses=.. reads as the defaults."""
    p = peer(ok(b"{}"))
    assert httpget.get(p.url + "/v1/lookups/recent?limit=7&misses=1") == b"{}"
    assert p.requests[0].startswith(b"GET /v1/lookups/recent?limit=7&misses=1 HTTP/1.1")


def test_https_is_not_spoken_as_plain_http(peer: Callable[[Reply], Peer]) -> None:
    """An https URL gets TLS: a plain-HTTP peer fails the handshake instead of answering."""
    p = peer(ok(b"{}"))
    with pytest.raises(httpget.FetchError):
        httpget.get(p.url.replace("http:", "https:"), deadline_s=3)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/x", "file:///etc/passwd", "http:///x",
                                 "http://:80/x"])
def test_only_http_urls_with_a_host_are_fetched(url: str) -> None:
    with pytest.raises(httpget.FetchError, match="not an http"):
        httpget.get(url)


def test_a_long_or_unprintable_reason_phrase_is_cut_and_cleaned(
        peer: Callable[[Reply], Peer]) -> None:
    p = peer(send(b"HTTP/1.1 503 \x1b[2J" + b"r" * 200 + b"\r\nContent-Length: 0\r\n\r\n"))
    with pytest.raises(httpget.FetchError) as info:
        httpget.get(p.url)
    msg = str(info.value)
    assert msg.startswith("HTTP 503 ?[2J") and "\x1b" not in msg
    assert msg.endswith("r...") and len(msg) == len("HTTP 503 ") + 80 + 3


@pytest.mark.parametrize("status", [b"101 Switching", b"304 Not Modified", b"302 Found"])
def test_only_a_2xx_is_a_body(peer: Callable[[Reply], Peer], status: bytes) -> None:
    p = peer(send(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n\r\n"))
    with pytest.raises(httpget.FetchError, match="HTTP " + status[:3].decode()):
        httpget.get(p.url, deadline_s=3)


def test_a_body_of_exactly_the_cap_is_read(peer: Callable[[Reply], Peer]) -> None:
    """The cap is the most bytes taken, not one less (with and without a length)."""
    for length in (True, False):
        p = peer(ok(b"x" * 1000, length))
        assert httpget.get(p.url, max_bytes=1000) == b"x" * 1000
        p = peer(ok(b"x" * 1001, length))
        with pytest.raises(httpget.FetchError, match="1,000-byte cap"):
            httpget.get(p.url, max_bytes=1000)


def test_a_body_cut_short_by_the_deadline_is_no_answer(peer: Callable[[Reply], Peer]) -> None:
    """A body without a length ends at the peer's close: the deadline cuts one dripped a
    byte at a time (the connection has handed its socket to the reply by then), and the
    part read is not the answer (it read as a whole, truncated document)."""
    def stall(c: socket.socket) -> None:
        c.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{\"partial\": ")
        for _ in range(40):   # 4 s if nobody cuts
            c.sendall(b" ")
            time.sleep(0.1)

    p = peer(stall)
    start = time.monotonic()
    with pytest.raises(httpget.FetchError, match=r"within 0\.5 s"):
        httpget.get(p.url, deadline_s=0.5)
    assert time.monotonic() - start < 2.5


def test_a_reset_after_part_of_the_body_is_not_unreachable(
        peer: Callable[[Reply], Peer]) -> None:
    """A daemon that answered then broke off was reached: 'no daemon answered' misleads."""
    def reset(c: socket.socket) -> None:
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 50000)
        time.sleep(0.2)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")

    p = peer(reset)
    with pytest.raises(httpget.FetchError) as info:
        httpget.get(p.url, deadline_s=5)
    assert not isinstance(info.value, httpget.Unreachable)


def test_a_refused_connection_is_unreachable() -> None:
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(httpget.Unreachable):
        httpget.get(f"http://127.0.0.1:{port}/", deadline_s=3)


def test_a_saved_file_over_the_cap_or_not_regular_is_one_phrase(tmp_path: Path) -> None:
    f = tmp_path / "stats.json"
    f.write_bytes(b"x" * (2 << 20))
    with pytest.raises(httpget.FetchError, match="larger than 1 MiB"):
        httpget.read_file(str(f), max_bytes=1 << 20)
    with pytest.raises(httpget.FetchError, match="not a regular file"):
        httpget.read_file(str(tmp_path))
    with pytest.raises(httpget.FetchError, match="No such file"):
        httpget.read_file(str(tmp_path / "missing"))


def _slow_connect(monkeypatch: pytest.MonkeyPatch, fail: bool) -> None:
    """connect() takes 0.3 s (then fails when ``fail``): the deadline passes meanwhile,
    before the connection has a socket for the timer to cut."""
    real = http.client.HTTPConnection.connect

    def connect(self: http.client.HTTPConnection) -> None:
        time.sleep(0.3)
        if fail:
            raise ConnectionRefusedError(111, "Connection refused")
        real(self)

    monkeypatch.setattr(http.client.HTTPConnection, "connect", connect)


@pytest.mark.parametrize("fail", [False, True])
def test_a_connect_that_outlasts_the_deadline_is_no_connection(
        peer: Callable[[Reply], Peer], monkeypatch: pytest.MonkeyPatch, fail: bool) -> None:
    """Past the deadline the fetch is over, whether connect then succeeds (nothing was
    cut: the exchange went on unbounded) or fails (said as the deadline, not the refusal
    that came after it). Nothing answered: ``Unreachable``, so callers say "is the service
    running?" rather than that an answer came."""
    p = peer(ok(b"{}"))
    _slow_connect(monkeypatch, fail)
    with pytest.raises(httpget.Unreachable, match=r"no connection within 0\.1 s"):
        httpget.get(p.url, deadline_s=0.1)


def test_a_fetch_leaves_no_deadline_timer_behind(peer: Callable[[Reply], Peer]) -> None:
    """Each fetch's timer is cancelled when it returns (doctor polls many times)."""
    p = peer(ok(b"{}"))
    for _ in range(3):
        httpget.get(p.url, deadline_s=30)
    end = time.monotonic() + 2
    while any(isinstance(t, threading.Timer) for t in threading.enumerate()) \
            and time.monotonic() < end:
        time.sleep(0.01)
    assert not any(isinstance(t, threading.Timer) for t in threading.enumerate())


def test_a_peer_that_closes_without_a_reply_is_unreachable(
        peer: Callable[[Reply], Peer]) -> None:
    """Nothing answered: 'no daemon answered' (start it / --url), not a bad answer."""
    p = peer(lambda c: None)
    with pytest.raises(httpget.Unreachable, match="closed without a reply"):
        httpget.get(p.url, deadline_s=3)


def test_a_host_or_path_that_cannot_be_encoded_is_one_phrase(
        peer: Callable[[Reply], Peer]) -> None:
    """A 70-character DNS label (IDNA refuses it) or a non-ASCII path raised a
    UnicodeError traceback out of http.client."""
    with pytest.raises(httpget.Unreachable):
        httpget.get("http://" + "a" * 70 + ".invalid/", deadline_s=3)
    with pytest.raises(httpget.FetchError):
        httpget.get(peer(ok(b"{}")).url + "/v1/\u00e9", deadline_s=3)


def test_a_failed_fetch_closes_its_connection_even_while_its_error_is_kept() -> None:
    """A non-2xx reply on a kept-alive connection: the socket is closed on the way out, not
    when the error (and the frames its traceback holds) is finally dropped."""
    srv = socket.create_server(("127.0.0.1", 0))
    closed = threading.Event()

    def serve() -> None:
        c, _ = srv.accept()
        c.recv(65536)
        c.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        c.settimeout(3)
        try:
            if c.recv(1) == b"":
                closed.set()
        except OSError:
            pass
        c.close()

    threading.Thread(target=serve, daemon=True).start()
    with pytest.raises(httpget.FetchError, match="HTTP 404") as kept:   # kept, as by a
        httpget.get(f"http://127.0.0.1:{srv.getsockname()[1]}/", deadline_s=5)   # logger
    assert closed.wait(3) and kept.value.__traceback__ is not None
    srv.close()


# -- files.read_regular ---------------------------------------------------------------

def test_a_file_of_exactly_the_cap_is_read_and_one_byte_more_refused(tmp_path: Path) -> None:
    """Reading stops one byte past the cap: a larger file is refused, never cut short."""
    f = tmp_path / "f"
    f.write_bytes(b"a" * 100)
    assert read_regular(f, 100) == b"a" * 100
    with pytest.raises(TooLarge):
        read_regular(f, 99)
    f.write_bytes(b"a" * (3 << 20))   # more than one read's chunk
    with pytest.raises(TooLarge):
        read_regular(f, (1 << 20) + 5)


def test_devnull_reads_empty_only_when_asked_and_no_other_device_does() -> None:
    assert read_regular(os.devnull, 10, devnull_ok=True) == b""
    with pytest.raises(NotRegularFile):
        read_regular(os.devnull, 10)
    with pytest.raises(NotRegularFile):
        read_regular("/dev/zero", 10, devnull_ok=True)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result: list[BaseException] = []

    def read() -> None:
        try:
            read_regular(fifo, 10)
        except BaseException as exc:   # handed to the test thread
            result.append(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(3)
    if t.is_alive():   # unblock the stuck open so that the thread ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(3)
        pytest.fail("opening a FIFO blocked until a writer came")
    assert isinstance(result[0], NotRegularFile)


def test_reads_close_their_descriptor(tmp_path: Path) -> None:
    """Every read (good, too large, not regular) gives its descriptor back."""
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        read_regular(f, 10)
        with pytest.raises(TooLarge):
            read_regular(f, 1)
        with pytest.raises(NotRegularFile):
            read_regular(tmp_path, 1)
    assert len(os.listdir("/proc/self/fd")) == before


# -- jsonin -------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "phrase"), [
    (b"\xff\xfe{", "not UTF-8 text"), ("[" * 100_000, "JSON nested too deeply"),
    ("1" * 5000, "an integer too long"), ('{"a": }', "not JSON (Expecting value at line 1)")])
def test_each_refusal_is_named(text: str | bytes, phrase: str) -> None:
    with pytest.raises(ValueError) as info:
        jsonin.loads(text)
    assert str(info.value).startswith(phrase)


# -- statsdoc -------------------------------------------------------------------------------

@pytest.mark.parametrize("v", [True, "1", None, [1]])
def test_number_refuses_what_is_not_a_number(v: Any) -> None:
    with pytest.raises(MalformedStats, match="not a number"):
        number({"x": v}, "x", "a.")


def test_number_takes_a_negative_only_when_allowed() -> None:
    assert number({"x": -2}, "x", negative_ok=True) == -2.0
    with pytest.raises(MalformedStats, match=">= 0"):
        number({"x": -0.5}, "x")


@pytest.mark.parametrize("v", [{"a": 1}, [1]])
def test_scalar_refuses_an_object_or_a_list(v: Any) -> None:
    with pytest.raises(MalformedStats, match="not a value"):
        scalar({"mode": v}, "mode", "?")


def test_clean_cuts_at_its_limit() -> None:
    assert clean("a" * 100) == "a" * 80 and clean("\x1bb", 1) == "?"


@pytest.mark.parametrize(("policy", "words"), [
    ({"tiers": []}, "policy.tiers is a list"),
    ({"tiers": {"cpu": 5}}, "policy.tiers.cpu is a int"),
    ({"tiers": {"cpu": {"mode": {"x": 1}}}}, "policy.tiers.cpu.mode"),
    ({"tiers": {"cpu": {"switches": [1]}}}, "policy.tiers.cpu.switches"),
    ({"tiers": {"cpu": {"mrc": [1]}}}, "not a list of points"),
    ({"tiers": {"cpu": {"mrc": [{"scale": 1}]}}}, "without hit_rate"),
    ({"tiers": {"cpu": {"mrc": [{"scale": 1, "hit_rate": "x"}]}}}, "mrc.hit_rate"),
])
def test_check_policy_names_the_malformed_field(policy: dict[str, Any], words: str) -> None:
    with pytest.raises(MalformedStats, match=words.replace(".", r"\.")):
        check_policy({"policy": policy})
