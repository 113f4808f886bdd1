"""Bounded work per request: huge requests, slow clients, connect bursts and namespace churn
cost the daemon bounded time and memory, and every client gets a typed answer."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.client import connect
from kvtier.errors import (
    CapacityError,
    DaemonUnavailable,
    HandshakeError,
    LimitExceeded,
    Overloaded,
    ProtocolError,
)
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.protocol import LENGTH, pack, unpack_body
from tests.support.daemon import DaemonProcess
from tests.support.pinger import ping_forever
from tests.support.raw import register

LAYOUT = KVLayout(2, 2, 32, "float16", 64)   # 32 KiB blocks of 64 tokens
MIB = 2**20


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _raw(d: DaemonProcess, hello: bool = True, timeout: float = 10.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(str(d.socket))
    if hello:
        s.sendall(pack({"id": 1, "op": "hello", "version": 1}))
        assert _reply(s)["ok"]
    return s


def _reply(s: socket.socket) -> dict:
    head = s.recv(4, socket.MSG_WAITALL)
    if len(head) < 4:
        raise ConnectionError("closed")
    (n,) = LENGTH.unpack(head)
    return unpack_body(s.recv(n, socket.MSG_WAITALL), 64 * MIB)


def _closed(s: socket.socket, timeout: float = 10.0) -> bool:
    """Drain what the daemon sent; True once it has closed the connection, False when it
    sends nothing for ``timeout`` s without closing it (a daemon that never closes it must
    fail the test, not hang the suite: found by mutation review)."""
    s.settimeout(timeout)
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _stored(d: DaemonProcess, n: int = 4) -> tuple[Namespace, list[bytes], list[np.ndarray]]:
    with connect(d.socket) as c:
        ns = c.register_layout(LAYOUT, "m")
        keys = block_keys(ns, np.arange(64 * n))
        bufs = [np.full(LAYOUT.block_bytes, i + 1, np.uint8) for i in range(n)]
        assert c.put(ns, keys, bufs) == n
    return ns, keys, bufs


def _intact(d: DaemonProcess, ns: Namespace, keys: list[bytes], bufs: list[np.ndarray]) -> None:
    with connect(d.socket) as c:
        outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
        assert c.get(ns, keys, outs) == len(keys)
        assert all(np.array_equal(a, b) for a, b in zip(outs, bufs, strict=True))


class _Pinger(threading.Thread):
    """Another client pinging in a loop; records (sent, latency) of every ping."""

    def __init__(self, d: DaemonProcess) -> None:
        super().__init__(daemon=True)
        self.client = connect(d.socket)
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            self.client.ping()
            self.samples.append((t0, time.perf_counter() - t0))
            time.sleep(0.002)

    def during(self, start: float, end: float) -> list[float]:
        return [lat for t0, lat in self.samples if t0 + lat >= start and t0 <= end]


def test_million_key_lookup_and_put_are_refused_while_others_are_served(
        daemon: DaemonProcess) -> None:
    ns, keys, bufs = _stored(daemon)
    assert daemon.proc is not None
    pid = daemon.proc.pid
    big = os.urandom(16) * 10**6      # 10^6 keys in one 16 MB frame (under the frame limit)
    ctx = multiprocessing.get_context("spawn")
    stop, (recv, send) = ctx.Event(), ctx.Pipe(duplex=False)
    pinger = ctx.Process(target=ping_forever, args=(str(daemon.socket), stop, send))
    pinger.start()
    time.sleep(1.5)                   # the child starts and pings a while: the baseline
    rss0 = _rss(pid)
    s = _raw(daemon)
    register(s, ns)
    windows: list[tuple[float, float]] = []
    try:
        for i, op in enumerate(["lookup", "put_prepare", "get_prepare", "delete"] * 2):
            frame = pack({"id": 10 + i, "op": op, "ns": ns.digest,
                          "layout_fp": LAYOUT.fingerprint, "keys": big})
            start = time.perf_counter()
            s.sendall(frame)
            r = _reply(s)
            end = time.perf_counter()
            windows.append((start, end))
            assert not r["ok"] and r["code"] == LimitExceeded.code, r
            assert "1000000 keys" in r["error"] and "2048" in r["error"]
            time.sleep(0.05)
    finally:
        stop.set()
        samples = recv.recv() if recv.poll(20) else []
        pinger.join(10)
    rss1 = _rss(pid)
    slowest = []    # per big request: the slowest ping that overlapped it (if one did:
    for start, end in windows:    # a loaded machine may not run the pinger in a short one)
        during = [lat for t0, lat in samples if t0 + lat >= start and t0 <= end]
        if during:
            slowest.append(max(during))
    assert len(slowest) >= len(windows) // 2, "too few pings overlapped the big requests"
    before = [lat for t0, lat in samples if t0 + lat < windows[0][0]]
    print(f"\n10^6-key requests: answered in "
          f"{max(e - s for s, e in windows) * 1e3:.1f} ms at most; slowest ping per request "
          f"{', '.join(f'{x * 1e3:.0f}' for x in slowest)} ms (before them: "
          f"{max(before, default=0.0) * 1e3:.1f} ms); RSS {rss0 / MIB:.0f} -> {rss1 / MIB:.0f} MiB")
    # 50 ms as the issue asks, for the typical request; a loaded 2-core machine may
    # deschedule the daemon now and then, so one outlier gets a wider margin
    assert sorted(slowest)[len(slowest) // 2] < 0.05
    assert max(slowest) < 0.5
    assert rss1 - rss0 < 32 * MIB
    st = daemon.stats()
    assert st["daemon"]["errors"][LimitExceeded.code] == 8
    assert st["tiers"]["cpu"]["allocation_failures"] == 0
    _intact(daemon, ns, keys, bufs)


def test_allowed_requests_at_the_limit_are_served(daemon_factory) -> None:
    """The largest request the default limit allows (128k tokens in 16-token blocks: 8192
    keys) is served whole, and other clients wait for it well under a second."""
    d = daemon_factory(cpu_bytes="96MiB").start()
    small = KVLayout(1, 1, 8, "float16", 16)
    pinger = _Pinger(d)
    pinger.start()
    spans: dict[str, float] = {}
    try:
        with connect(d.socket) as c:
            ns = c.register_layout(small, "m")
            keys = block_keys(ns, np.arange(2**17))
            assert len(keys) == 8192

            def timed(name: str, fn: Any) -> Any:
                start = time.perf_counter()
                out = fn()
                time.sleep(0.05)
                spans[name] = max(pinger.during(start, time.perf_counter()), default=0.0)
                return out

            lease = timed("put_prepare", lambda: c.prepare_put(ns, keys))
            assert timed("put_commit", lease.commit) == 8192
            assert timed("lookup", lambda: c.lookup(ns, keys)).hits == 8192
            timed("get", lambda: c.prepare_get(ns, keys)).release()
            with pytest.raises(LimitExceeded, match="8193 keys"):
                c.lookup(ns, [*keys, os.urandom(16)])
    finally:
        pinger.stop.set()
        pinger.join(10)
    print("\nslowest ping while an 8192-key request ran: "
          + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in spans.items()))
    assert max(spans.values()) < 0.5


def test_a_put_longer_than_a_context_is_refused_whole(daemon_factory) -> None:
    """``put`` stores in batches: one over the key limit stored its first batches, then
    raised, so the caller could not know what was stored. It is now refused before any
    batch, as lookup, get and delete refuse it whole."""
    d = daemon_factory(cpu_bytes="16MiB",
                       env={"KVTIER_DAEMON_MAX_CONTEXT_TOKENS": "1024"}).start()
    small = KVLayout(1, 1, 8, "float16", 16)                  # 64 keys per context
    with connect(d.socket) as c:
        ns = c.register_layout(small, "m")
        keys = block_keys(ns, np.arange(100 * 16))
        bufs = [np.full(small.block_bytes, 5, np.uint8)] * len(keys)
        with pytest.raises(LimitExceeded, match="100 blocks in one put"):
            c.put(ns, keys, bufs)
        assert c.lookup(ns, keys[:64]).hits == 0              # nothing stored
        assert c.put(ns, keys[:64], bufs[:64]) == 64          # at the limit: stored


def test_put_that_cannot_fit_fails_fast_without_evicting(daemon_factory) -> None:
    d = daemon_factory(cpu_bytes="32MiB").start()
    ns, keys, bufs = _stored(d)
    before = d.stats()["tiers"]["cpu"]
    with connect(d.socket) as c:
        ns = c.register_layout(LAYOUT, "m")
        many = block_keys(ns, np.arange(64 * 2048) + 10**6)   # 2048 x 32 KiB = 64 MiB
        t0 = time.perf_counter()
        with pytest.raises(CapacityError, match="exceeds the cpu tier"):
            c.prepare_put(ns, many)
        huge = KVLayout(64, 8, 128, "float32", 256)             # a 128 MiB block
        hns = c.register_layout(huge, "m")
        with pytest.raises(CapacityError, match="larger than the cpu tier"):
            c.prepare_put(hns, block_keys(hns, np.arange(256)))
        elapsed = time.perf_counter() - t0
    after = d.stats()["tiers"]["cpu"]
    assert after["allocation_failures"] == before["allocation_failures"] == 0
    assert after["blocks"] == before["blocks"] == 4
    assert elapsed < 2.0
    _intact(d, ns, keys, bufs)


def test_slow_loris_and_half_sent_frames_are_dropped(daemon_factory) -> None:
    d = daemon_factory(env={"KVTIER_DAEMON_READ_TIMEOUT_S": "1",
                            "KVTIER_DAEMON_IDLE_TIMEOUT_S": "1.5"}).start()
    silent = _raw(d, hello=False)                       # connects, never says hello
    idle = _raw(d)                                      # says hello, then nothing
    half = _raw(d)                                      # half a frame, then nothing
    half.sendall(LENGTH.pack(1000) + b"\x81" + b"x" * 100)
    big_half = _raw(d)                                  # 15 MiB announced, 1 MiB sent
    big_half.sendall(LENGTH.pack(15 * MIB) + b"\xde" * MIB)
    t0 = time.monotonic()
    with connect(d.socket) as c:                        # everyone else is served meanwhile
        for _ in range(5):
            c.ping()
    for s, lo, hi in ((silent, 0.7, 6), (half, 0.7, 6), (big_half, 0.7, 6), (idle, 1.2, 8)):
        assert _closed(s)
        elapsed = time.monotonic() - t0
        assert lo <= elapsed < hi, elapsed               # after the timeout, not much later
    st = d.stats()["daemon"]
    assert st["dropped_slow"] == 3 and st["dropped_idle"] == 1
    assert st["clients"] == 0 and st["pending_request_bytes"] == 0


_OTHER_CLIENT = """
import sys, time
from kvtier.client import connect
with connect(sys.argv[1]) as c:
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()
    for _ in range(5):
        c.ping()
    print(time.monotonic() - t0, flush=True)
"""


def test_a_client_that_never_reads_its_replies_is_dropped(daemon_factory) -> None:
    """Replies pile up in the daemon only when a client leaves them unread: its connection is
    dropped after the read timeout, and every other process is served meanwhile. (Another
    connection of the deaf client's own process waits: its requests in flight hold the
    process's share until the drop. Pinging from the test's process measured that share,
    ~0.99 s against a 1 s bound, not the daemon.)"""
    d = daemon_factory(env={"KVTIER_DAEMON_READ_TIMEOUT_S": "1"}).start()
    other = subprocess.Popen([sys.executable, "-c", _OTHER_CLIENT, str(d.socket)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdin is not None
        assert other.stdout.readline().strip() == "ready"
        deaf = _raw(d)
        deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stats = pack({"id": 2, "op": "stats"})   # a few KiB of reply each
        with contextlib.suppress(OSError):       # the daemon stops reading, then drops us
            deaf.settimeout(0.3)                 # (a blocked send: the daemon stopped)
            for _ in range(2000):
                deaf.sendall(stats)
        deaf.settimeout(None)
        other.stdin.write("go\n")
        other.stdin.flush()
        elapsed = float(other.stdout.readline())
        assert elapsed < 0.5, elapsed            # not held up by the deaf client
    finally:
        other.kill()
        other.wait(10)
    deadline = time.monotonic() + 8
    while d.stats()["daemon"]["dropped_slow"] < 1:
        assert time.monotonic() < deadline, "the deaf client was never dropped"
        time.sleep(0.1)
    assert _closed(deaf)
    deadline = time.monotonic() + 5
    while (st := d.stats()["daemon"])["clients"] > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert st["clients"] == 0 and st["dropped_slow"] == 1


def test_partial_big_frames_hold_bounded_memory(daemon_factory) -> None:
    """20 connections each announce a 15 MiB frame and send all of it but its last byte:
    the daemon holds at most its total pending budget (64 MiB), not 300 MB, drops them all
    after the read timeout, and serves everyone else meanwhile."""
    d = daemon_factory(env={"KVTIER_DAEMON_READ_TIMEOUT_S": "2"}).start()
    pid = d.proc.pid
    rss0 = _rss(pid)
    body = b"\xc4" * (15 * MIB - 1)
    outcomes: list[str] = []

    def slow_sender() -> None:
        s = _raw(d, timeout=8)
        try:
            s.sendall(LENGTH.pack(15 * MIB) + body)
            r = _reply(s)
            outcomes.append(r.get("code", "ok"))
        except OSError as exc:
            outcomes.append(type(exc).__name__)
        finally:
            s.close()

    threads = [threading.Thread(target=slow_sender, daemon=True) for _ in range(20)]
    for t in threads:
        t.start()
    peak = rss0
    with connect(d.socket) as c:
        end = time.monotonic() + 1.8
        while time.monotonic() < end:
            t0 = time.perf_counter()
            c.ping()
            assert time.perf_counter() - t0 < 1.0
            peak = max(peak, _rss(pid))
            time.sleep(0.05)
    for t in threads:
        t.join(15)
    print(f"\n20 partial 15 MiB frames: RSS {rss0 / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB; "
          f"outcomes {sorted(set(outcomes))}")
    assert peak - rss0 < 100 * MIB
    assert len(outcomes) == 20
    assert set(outcomes) <= {ProtocolError.code, Overloaded.code, "BrokenPipeError",
                             "ConnectionResetError", "TimeoutError"}
    st = d.stats()["daemon"]
    assert st["clients"] == 0 and st["pending_request_bytes"] == 0
    assert st["dropped_slow"] + st["errors"].get(Overloaded.code, 0) == 20


def test_an_idle_client_is_dropped_and_told_on_its_next_call(daemon_factory) -> None:
    d = daemon_factory(env={"KVTIER_DAEMON_IDLE_TIMEOUT_S": "0.5"}).start()
    with connect(d.socket) as c:
        c.ping()
        time.sleep(1.2)   # idle past the timeout: dropped, and the next call says so
        with pytest.raises(DaemonUnavailable):
            c.ping()
    assert d.stats()["daemon"]["dropped_idle"] == 1


def test_two_thousand_concurrent_connects_succeed_or_are_refused(daemon_factory) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2200:
        pytest.skip(f"needs 2200 open files, the hard limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    d = daemon_factory(env={"KVTIER_DAEMON_MAX_CONNECTIONS": "500"}).start()
    socks, connect_errors = [], []
    try:
        for _ in range(2000):      # as fast as the kernel lets us: a burst
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(False)
            try:
                s.connect(str(d.socket))
            except OSError as exc:
                connect_errors.append(exc.errno)
            socks.append(s)
        assert connect_errors == []          # never EAGAIN: the backlog holds the burst
        hello = pack({"id": 1, "op": "hello", "version": 1})
        sel = selectors.DefaultSelector()
        bufs: dict[socket.socket, bytes] = {}
        for s in socks:
            s.setblocking(True)
            s.settimeout(5)
            with contextlib.suppress(OSError):   # refused and closed: the refusal is queued
                s.sendall(hello)
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
            bufs[s] = b""
        replies: dict[socket.socket, dict] = {}
        deadline = time.monotonic() + 90
        while len(replies) < len(socks) and time.monotonic() < deadline:
            for key, _ in sel.select(1.0):
                fileobj = key.fileobj
                assert isinstance(fileobj, socket.socket)
                s = fileobj
                try:
                    chunk = s.recv(4096)
                except OSError:
                    chunk = b""
                bufs[s] += chunk
                b = bufs[s]
                if len(b) >= 4 and len(b) >= 4 + LENGTH.unpack(b[:4])[0]:
                    replies[s] = unpack_body(b[4: 4 + LENGTH.unpack(b[:4])[0]])
                    sel.unregister(s)
                elif not chunk:
                    replies[s] = {"ok": False, "code": "eof"}
                    sel.unregister(s)
        codes: dict[str | None, int] = {}
        for r in replies.values():
            code = "ok" if r.get("ok") else r.get("code")
            codes[code] = codes.get(code, 0) + 1
        print(f"\n2000 concurrent connects: {codes}")
        assert len(replies) == 2000
        assert set(codes) <= {"ok", Overloaded.code}
        assert 0 < codes.get("ok", 0) <= 500
        assert d.stats()["daemon"]["refused_connections"] == codes.get(Overloaded.code, 0)
    finally:
        for s in socks:
            s.close()
    with connect(d.socket) as c:
        c.ping()


def test_one_process_cannot_take_every_connection(daemon_factory) -> None:
    """A process that leaks or hoards connections meets its own limit, with the daemon's
    other connections still open to other processes (it once took all 1024)."""
    d = daemon_factory(env={"KVTIER_DAEMON_MAX_CONNECTIONS_PER_CLIENT": "3"}).start()
    mine = [connect(d.socket) for _ in range(3)]
    with pytest.raises(Overloaded, match="max_connections_per_client"):
        connect(d.socket)
    # another process still connects (and is served) while this one holds its three
    code = ("import sys; from kvtier.client import connect; "
            "c = connect(sys.argv[1]); c.ping(); print('served')")
    out = subprocess.run([sys.executable, "-c", code, str(d.socket)], capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "served", out.stderr
    mine.pop().close()
    deadline = time.monotonic() + 5
    while True:   # the daemon notices the close asynchronously
        try:
            mine.append(connect(d.socket))
            break
        except Overloaded:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    for c in mine:
        c.ping()
        c.close()


def test_a_client_beyond_max_connections_gets_a_typed_refusal(daemon_factory) -> None:
    d = daemon_factory(env={"KVTIER_DAEMON_MAX_CONNECTIONS": "2"}).start()
    first, second = connect(d.socket), connect(d.socket)
    with pytest.raises(Overloaded, match="max_connections"):
        connect(d.socket)
    first.close()
    deadline = time.monotonic() + 5
    while True:   # the daemon notices the close asynchronously
        try:
            third = connect(d.socket)
            break
        except Overloaded:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    third.ping()
    second.ping()


def test_namespaces_are_bounded_and_clients_re_register(daemon_factory) -> None:
    d = daemon_factory(env={"KVTIER_DAEMON_MAX_NAMESPACES": "8"}).start()
    ns, keys, bufs = _stored(d)
    with connect(d.socket) as c:
        ns = c.register_layout(LAYOUT, "m")
        for i in range(20):
            c.register_layout(LAYOUT, f"other-{i}")   # pushes "m" out
        outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
        assert c.get(ns, keys, outs) == 4            # re-registered transparently
        assert all(np.array_equal(a, b) for a, b in zip(outs, bufs, strict=True))
        assert c.lookup(ns, keys).hits == 4
    st = d.stats()
    assert st["namespaces"] <= 8
    assert st["daemon"]["namespaces_evicted"] >= 13


def test_namespace_churn_does_not_grow_the_daemon(daemon: DaemonProcess) -> None:
    """50k distinct 1000-character model ids: unbounded, they would keep ~80 MB."""
    assert daemon.proc is not None
    pid = daemon.proc.pid
    s = _raw(daemon, timeout=60)
    layout = LAYOUT.to_dict()
    rss0 = _rss(pid)
    n = 50_000

    def send() -> None:
        batch = []
        for i in range(n):
            batch.append(pack({"id": i + 2, "op": "register_layout", "layout": layout,
                               "model_id": f"{i:08d}" + "m" * 992}))
            if len(batch) == 256:
                s.sendall(b"".join(batch))
                batch = []
        s.sendall(b"".join(batch))

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    ok = sum(1 for _ in range(n) if _reply(s)["ok"])
    sender.join(30)
    rss1 = _rss(pid)
    st = daemon.stats()
    print(f"\n{n} namespaces registered: RSS {rss0 / MIB:.0f} -> {rss1 / MIB:.0f} MiB, "
          f"{st['namespaces']} kept")
    assert ok == n
    assert st["namespaces"] <= 4096
    assert rss1 - rss0 < 30 * MIB


def test_every_handler_error_is_a_typed_counted_reply(daemon: DaemonProcess) -> None:
    s = _raw(daemon, hello=False)
    s.sendall(pack({"id": 1, "op": "hello", "version": [1]}))      # unhashable version
    assert _reply(s)["code"] == HandshakeError.code
    s = _raw(daemon, hello=False)
    s.sendall(pack({"id": 1, "op": "hello", "version": True}))      # 1, but not an int
    assert _reply(s)["code"] == HandshakeError.code
    s = _raw(daemon)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"tp_rank": "0"}, ProtocolError.code),
        ({"tp_size": 1.5}, ProtocolError.code),
        ({"tp_rank": 3, "tp_size": 2}, ProtocolError.code),
        ({"model_id": "m" * 5000}, ProtocolError.code),
    ]
    for i, (extra, code) in enumerate(bad):
        s.sendall(pack({"id": 10 + i, "op": "register_layout", "layout": LAYOUT.to_dict(),
                        "model_id": "m", **extra}))
        r = _reply(s)
        assert not r["ok"] and r["code"] == code, (extra, r)
    for heads in (2**63, 2**64 - 1):                  # a reply msgpack cannot encode
        layout = {**LAYOUT.to_dict(), "num_kv_heads": heads}
        s.sendall(pack({"id": 20, "op": "register_layout", "layout": layout, "model_id": "m"}))
        r = _reply(s)
        assert not r["ok"] and r["id"] == 20 and isinstance(r["code"], str), r
    s.sendall(pack({"id": "x", "op": "ping"}))
    assert _reply(s)["code"] == ProtocolError.code
    s.sendall(pack({"id": 21, "op": "ping"}))
    assert _reply(s)["ok"]
    errors = daemon.stats()["daemon"]["errors"]
    assert errors.get(HandshakeError.code) == 2
    assert sum(errors.values()) == 2 + len(bad) + 2 + 1
    assert "internal" not in errors


def _trickle(path: str, conns: int, frame: int, ready: Any, stop: Any) -> None:
    """Another process: ``conns`` connections each announce a ``frame``-byte frame and send
    its body one byte every 0.2 s (until the daemon drops them)."""
    socks = []
    for _ in range(conns):
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.sendall(pack({"id": 1, "op": "hello", "version": 1}))
        assert _reply(s)["ok"]
        s.sendall(LENGTH.pack(frame) + b"\x80")
        socks.append(s)
    ready.set()
    while not stop.wait(0.2):
        for s in socks:
            with contextlib.suppress(OSError):
                s.sendall(b"\0")


def _stall(path: str, conns: int, frame: int, stop: Any) -> None:
    """Another process: ``conns`` connections each send all of a ``frame``-byte frame but
    its last byte, as fast as the daemon reads, then stall."""
    def one() -> None:
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.sendall(pack({"id": 1, "op": "hello", "version": 1}))
        assert _reply(s)["ok"]
        with contextlib.suppress(OSError):
            s.sendall(LENGTH.pack(frame) + b"\xc4" * (frame - 1))
        stop.wait(60)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(conns)]
    for t in threads:
        t.start()
    stop.wait(60)


def test_trickled_frames_do_not_hold_the_shared_request_budget(daemon_factory) -> None:
    """8 connections of another process announce 16 MiB frames and trickle them: the
    shared budget (64 MiB) was taken at the announced length, so every other client's next
    request (its hello first) waited read_timeout_s and got Overloaded. Bytes are counted as
    they arrive now, and small frames never wait for the shared budget: a victim connects,
    pings and sends a 2 MiB frame well within the time the attack holds its frames."""
    d = daemon_factory(env={"KVTIER_DAEMON_READ_TIMEOUT_S": "6"}).start()
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    attack = ctx.Process(target=_trickle, args=(str(d.socket), 8, 16 * MIB, ready, stop))
    attack.start()
    try:
        assert ready.wait(30), "the attack did not start"
        time.sleep(0.3)
        t0 = time.monotonic()
        with connect(d.socket, timeout=15.0) as c:
            ns = c.register_layout(LAYOUT, "m")
            slowest = 0.0
            for _ in range(20):
                t = time.monotonic()
                c.ping()
                slowest = max(slowest, time.monotonic() - t)
            held = d.stats()["daemon"]["pending_request_bytes"]
        s = _raw(d)
        register(s, ns)
        s.sendall(pack({"id": 5, "op": "lookup", "ns": ns.digest,
                        "layout_fp": LAYOUT.fingerprint, "keys": os.urandom(16) * 131072}))
        r = _reply(s)                                    # 2 MiB: over the key bound
        elapsed = time.monotonic() - t0
        print(f"\nunder 8 trickled 16 MiB frames: victim done in {elapsed * 1e3:.0f} ms, "
              f"slowest ping {slowest * 1e3:.0f} ms, {held} request bytes held")
        assert not r["ok"] and r["code"] == LimitExceeded.code, r
        assert elapsed < 2.0          # the attack holds its frames for 6 s
        assert held < MIB             # not the 64 MiB announced
    finally:
        stop.set()
        attack.join(10)
        if attack.is_alive():
            attack.kill()


def test_one_process_cannot_hold_the_whole_shared_request_budget(daemon_factory) -> None:
    """One process sends 6 frames of 16 MiB but their last byte, and stalls: it holds its
    share (half of max_total_pending_bytes) and at most one frame more, so another
    process's 8 MiB request is read and answered at once instead of waiting
    read_timeout_s for Overloaded."""
    d = daemon_factory(env={"KVTIER_DAEMON_READ_TIMEOUT_S": "6"}).start()
    with connect(d.socket) as c:
        ns = c.register_layout(LAYOUT, "m")
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    attack = ctx.Process(target=_stall, args=(str(d.socket), 6, 16 * MIB, stop))
    attack.start()
    try:
        deadline = time.monotonic() + 30
        while d.stats()["daemon"]["pending_request_bytes"] < 30 * MIB:
            assert time.monotonic() < deadline, "the attack did not start"
            time.sleep(0.05)
        time.sleep(0.5)
        held = d.stats()["daemon"]["pending_request_bytes"]
        t0 = time.monotonic()
        s = _raw(d)
        register(s, ns)
        s.sendall(pack({"id": 5, "op": "lookup", "ns": ns.digest,
                        "layout_fp": LAYOUT.fingerprint, "keys": os.urandom(16) * 500_000}))
        r = _reply(s)
        elapsed = time.monotonic() - t0
        print(f"\none process stalling 6 frames holds {held / MIB:.0f} MiB; another's "
              f"8 MiB request answered in {elapsed * 1e3:.0f} ms: {r.get('code')}")
        assert not r["ok"] and r["code"] == LimitExceeded.code, r   # read, then refused
        assert elapsed < 2.0
        # its share (32 MiB), exceeded by at most what its oldest frame still needs, one
        # frame at most (kvtier.daemon.limits.ByteBudget: frames that each hold part of
        # their bytes must not wait for each other); CI saw 34.6 MiB. Without the share
        # it holds the whole 64 MiB budget and more.
        assert held <= (32 + 16) * MIB
    finally:
        stop.set()
        attack.join(10)
        if attack.is_alive():
            attack.kill()
