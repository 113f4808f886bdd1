"""A property-based protocol fuzzer against a live daemon.

Hypothesis draws sequences of requests: known and random op names, the fields the ops read
with values of every msgpack type (and targeted ones: the real namespace, fingerprint, keys
and layout, slightly off), msgpack garbage and bad lengths, and openings other than a proper
hello. Every request that decodes to a map must get a typed reply (never silence, never
``internal``); after each sequence another client's ping is answered and the blocks stored
before the fuzzing still read back exact. Bounded to well under a minute.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections import Counter
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from kvtier.protocol import DEFAULT_MAX_FRAME, LENGTH, OPS, pack, unpack_body
from tests.support.daemon import DaemonProcess

LAYOUT = KVLayout(2, 2, 32, "float16", 64)
REPLY_TIMEOUT = 10.0
EXAMPLES = int(os.environ.get("KVTIER_TEST_FUZZ_EXAMPLES", "1000"))  # ~20 s; more to soak
FIELDS = ["id", "op", "ns", "layout_fp", "keys", "layout", "model_id", "tp_rank", "tp_size",
          "cache_salt", "parent", "depth", "lease", "durable", "output_tokens", "prefetch",
          "device", "version", "client", "running", "context_tokens_p99"]
CODES = {"protocol", "handshake", "layout_mismatch", "unknown_namespace", "buffer_size",
         "lease", "lease_expired", "capacity", "limit", "overloaded"}

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
    st.text(max_size=24), st.binary(max_size=72))
values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


class Target:
    """What the fuzzer may aim at: a registered namespace with decoy blocks it may read,
    write or delete; the protected blocks it is never given are checked after each run."""

    def __init__(self, d: DaemonProcess) -> None:
        self.daemon = d
        with connect(d.socket) as c:
            self.ns = c.register_layout(LAYOUT, "fuzz")
            self.protected = block_keys(self.ns, np.arange(64 * 4))
            self.bufs = [np.full(LAYOUT.block_bytes, 11 * (i + 1), np.uint8) for i in range(4)]
            assert c.put(self.ns, self.protected, self.bufs) == 4
            self.decoys = block_keys(self.ns.with_salt("decoy"), np.arange(64 * 4))
            dns = c.register_layout(LAYOUT, "fuzz", cache_salt="decoy")
            assert c.put(dns, self.decoys, self.bufs) == 4
        self.dns = dns
        self.pinger = connect(d.socket, timeout=REPLY_TIMEOUT)

    def check(self) -> None:
        t0 = time.perf_counter()
        self.pinger.ping()
        assert time.perf_counter() - t0 < 2.0
        outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in self.protected]
        assert self.pinger.get(self.ns, self.protected, outs) == 4
        assert all(np.array_equal(a, b) for a, b in zip(outs, self.bufs, strict=True))


def targeted(name: str, t_ns: bytes, t_fp: int, decoys: list[bytes]) -> st.SearchStrategy:
    layout = LAYOUT.to_dict()
    by_name: dict[str, st.SearchStrategy] = {
        "op": st.one_of(st.sampled_from(sorted(OPS)), st.text(max_size=12)),
        "ns": st.one_of(st.just(t_ns), st.binary(min_size=16, max_size=16)),
        "layout_fp": st.one_of(st.just(t_fp), st.integers(0, 2**64 - 1)),
        "keys": st.one_of(
            st.lists(st.sampled_from(decoys), max_size=6).map(b"".join),
            st.binary(max_size=100),
            st.integers(0, 3000).map(lambda n: b"\x01" * (16 * n))),
        "layout": st.one_of(
            st.just(layout),
            st.tuples(st.sampled_from(sorted(layout)), values).map(
                lambda kv: {**layout, kv[0]: kv[1]}),
            st.tuples(st.sampled_from(["num_layers", "num_kv_heads", "head_dim",
                                       "tokens_per_block"]),
                      st.integers(1, 2**64 - 1)).map(lambda kv: {**layout, kv[0]: kv[1]})),
        "model_id": st.one_of(st.text(max_size=16), st.integers(0, 3000).map(lambda n: "m" * n)),
        "tp_rank": st.integers(-2, 2**64 - 1), "tp_size": st.integers(-2, 2**64 - 1),
        "parent": st.one_of(st.none(), st.sampled_from(decoys), st.binary(max_size=20)),
        "depth": st.integers(-2**63, 2**64 - 1),
        "lease": st.integers(-2**63, 2**64 - 1),
        "version": st.one_of(st.just(1), st.integers(-2, 3)),
    }
    strategy = by_name.get(name)
    return values if strategy is None else st.one_of(strategy, values)


@st.composite
def request(draw: Any, t_ns: bytes, t_fp: int, decoys: list[bytes]) -> dict[str, Any]:
    msg: dict[str, Any] = {"op": draw(targeted("op", t_ns, t_fp, decoys))}
    if draw(st.booleans()):  # a well-formed request of a real op, its fields fuzzed
        msg["op"] = draw(st.sampled_from(sorted(OPS - {"hello"})))
        msg.update({"ns": t_ns, "layout_fp": t_fp, "keys": b"".join(decoys[:2]),
                    "layout": LAYOUT.to_dict(), "model_id": "fuzz", "lease": 1})
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True)):
        msg[name] = draw(targeted(name, t_ns, t_fp, decoys))
    if "id" not in msg or draw(st.booleans()):
        msg["id"] = draw(st.integers(1, 2**31))
    return msg


def actions(t_ns: bytes, t_fp: int, decoys: list[bytes]) -> st.SearchStrategy:
    req = request(t_ns, t_fp, decoys)
    return st.lists(st.one_of(
        st.tuples(st.just("request"), req),
        st.tuples(st.just("request"), req),
        st.tuples(st.just("garbage"), st.binary(min_size=1, max_size=64)),
        st.tuples(st.just("length"), st.sampled_from([0, DEFAULT_MAX_FRAME + 1, 2**32 - 1])),
        st.tuples(st.just("opening"), req),
    ), min_size=1, max_size=8)


class Conn:
    """One fuzzed connection; reopened (with a proper hello) after the daemon closes it."""

    def __init__(self, d: DaemonProcess) -> None:
        self.daemon = d
        self.sock: socket.socket | None = None

    def open(self, hello: bool = True) -> socket.socket:
        self.close()
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(REPLY_TIMEOUT)
        s.connect(str(self.daemon.socket))
        self.sock = s
        if hello:   # and the target's namespace: a connection names only those it registered
            assert self.call(pack({"id": 1, "op": "hello", "version": 1}))["ok"]
            assert self.call(pack({"id": 2, "op": "register_layout",
                                   "layout": LAYOUT.to_dict(), "model_id": "fuzz"}))["ok"]
        return s

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def call(self, frame: bytes) -> dict[str, Any]:
        """Send one frame; the daemon's next reply (None-free: it must answer)."""
        assert self.sock is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.sock.sendall(frame)  # if the daemon closed, its last word is still queued
        head = self.sock.recv(4, socket.MSG_WAITALL)
        assert len(head) == 4, "the daemon closed the connection without a reply"
        (n,) = LENGTH.unpack(head)
        return unpack_body(self.sock.recv(n, socket.MSG_WAITALL), 64 * 2**20)


SEEN: Counter[str] = Counter()


def _check_reply(reply: dict[str, Any], rid: int | None) -> None:
    SEEN["ok" if reply.get("ok") else str(reply.get("code"))] += 1
    assert isinstance(reply.get("ok"), bool), reply
    if not reply["ok"]:
        assert reply.get("code") in CODES, reply
        assert isinstance(reply.get("error"), str) and reply["error"], reply
    if rid is not None and reply.get("id") != 0:
        assert reply["id"] == rid, reply


def run_sequence(conn: Conn, steps: list[tuple[str, Any]]) -> None:
    conn.open()
    for kind, arg in steps:
        if conn.sock is None:
            conn.open()
        if kind == "request":
            reply = conn.call(pack(arg))
            _check_reply(reply, arg["id"])
            if reply.get("id") == 0 and not reply["ok"]:
                conn.close()        # a connection-level error: the daemon closes it
        elif kind == "garbage":
            reply = conn.call(LENGTH.pack(len(arg)) + arg)
            _check_reply(reply, None)
            if reply.get("id") == 0 and not reply["ok"]:
                conn.close()
        elif kind == "length":
            reply = conn.call(LENGTH.pack(arg))
            assert not reply["ok"] and reply["code"] == "protocol", reply
            conn.close()
        else:  # an opening other than a proper hello
            conn.open(hello=False)
            reply = conn.call(pack(arg))
            _check_reply(reply, None)
            if not reply["ok"]:
                conn.close()
    conn.close()


def test_fuzzed_protocol_never_breaks_the_daemon(daemon: DaemonProcess) -> None:
    target = Target(daemon)
    conn = Conn(daemon)
    started = time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(steps=actions(target.dns.digest, LAYOUT.fingerprint, target.decoys))
    def fuzz(steps: list[tuple[str, Any]]) -> None:
        try:
            run_sequence(conn, steps)
        finally:
            conn.close()
        target.check()

    fuzz()
    elapsed = time.monotonic() - started
    st_ = daemon.stats()
    print(f"\nfuzzed for {elapsed:.1f} s; replies {dict(SEEN)}; daemon errors by code: "
          f"{st_['daemon']['errors']}")
    assert SEEN["ok"] > 0 and len(SEEN) >= 5   # the fuzzer reaches past the framing
    assert "internal" not in st_["daemon"]["errors"]
    assert daemon.proc is not None and daemon.proc.poll() is None
    target.check()
    # ~20-30 s idle; 82 s on a machine other work loaded (2026-12-06): the bound is for a
    # daemon that stalls on some input, not for a slow machine
    assert elapsed < 180 * max(1, EXAMPLES // 1000)
