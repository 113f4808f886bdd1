"""Survivors of the request-handling mutation round: the client library. Its sans-I/O ops
(``kvtier.client.ops``) driven by hand over a real arena mapping, and the clients' transport
(``kvtier.client.sync``, ``kvtier.client.aio``) against a scripted same-uid daemon in a
thread of this process (no process is started)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.client import (
    AsyncKVTierClient,
    GetLease,
    PutLease,
    aio,
    connect,
    connect_async,
)
from kvtier.client.ops import MAX_REPLY, NoWait, Op, Ops
from kvtier.errors import (
    DaemonUnavailable,
    HandshakeError,
    KVTierError,
    LimitExceeded,
    ProtocolError,
    RequestTimeout,
)
from kvtier.keys import Namespace, block_keys
from kvtier.protocol import LENGTH, pack
from kvtier.tiers.arena_mapping import ArenaMapping
from tests.support.arena import temp_arena
from tests.support.fake_daemon import HostileSocketDaemon
from tests.unit.test_client_ops import BLOCK, LAYOUT, SLOT

NS = Namespace("test/survivors", LAYOUT)   # (the 256-byte blocks of test_client_ops)


def request(sent: Any) -> dict[str, Any]:
    """What an op yielded, as the request it is (never a NoWait or a Settle here)."""
    assert isinstance(sent, dict), sent
    return sent


@pytest.fixture
def ops() -> Iterator[Ops]:
    with temp_arena(1 << 20, 1 << 20) as arena:
        o = Ops()
        o.arena = ArenaMapping(str(arena.path), arena.size)
        o._registered.add(NS.digest)
        yield o
        o.close()


def finish(op: Op, reply: dict[str, Any]) -> Any:
    """Send ``reply`` to the op's one request; its result."""
    next(op)
    with pytest.raises(StopIteration) as stop:
        op.send(reply)
    return stop.value.value


def test_a_gets_views_are_read_only(ops: Ops) -> None:
    """The views a get hands out are read-only: they are the cached blocks themselves,
    shared with every other reader, so a caller's stray write must fail, not change
    another engine's KV bytes. Mutant that survived: get views were mapped writable."""
    keys = block_keys(NS, range(2 * LAYOUT.tokens_per_block))
    _, views, devices, _ = finish(ops.op_prepare_get(NS, keys),
                                  {"ok": True, "lease": 1, "offsets": [0, SLOT], "ttl_s": 30.0})
    assert devices == ["cpu", "cpu"] and len(views) == 2
    for view in views:
        assert not view.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            view[:] = np.uint8(7)



def test_a_put_one_block_longer_than_a_context_is_refused_before_any_request(
        ops: Ops) -> None:
    """A put of more blocks than the daemon takes in one context (``max_keys`` of the
    namespace's registration) is refused whole by the client (``LimitExceeded``) before
    any batch is prepared; exactly ``max_keys`` blocks go ahead. Mutant that survived:
    the bound was one block too lax, so a put of max_keys + 1 blocks stored its leading
    batches and was refused only at the last."""
    assert finish(ops.op_register(LAYOUT, NS.model_id, 0, 1, None),
                  {"ok": True, "ns": NS.digest, "max_keys": 3}) == NS
    keys = block_keys(NS, range(4 * LAYOUT.tokens_per_block))
    bufs = [np.zeros(BLOCK, np.uint8) for _ in keys]
    with pytest.raises(LimitExceeded, match="4 blocks in one put"):
        next(ops.op_put(NS, keys, bufs, False, None))
    assert request(next(ops.op_put(NS, keys[:3], bufs[:3], False, None)))["op"] == "put_prepare"


@pytest.mark.parametrize("reply", [{"id": 3, "stored": 2}, {"id": 3, "ok": None},
                                   {"id": 3, "ok": 0, "code": "lease_expired"}])
def test_a_reply_that_does_not_say_ok_is_an_error(reply: dict[str, Any]) -> None:
    """A reply counts as a success only when it says ``ok`` (true): one without the field
    or with a false value is an error (its code's, else ``internal``), never results the
    client would act on. Mutant that survived: only ``ok: false`` was an error, so a reply
    missing ``ok`` (a daemon bug, something else on the socket) was a success."""
    with pytest.raises(KVTierError):
        Ops.check_reply(reply)
    assert Ops.check_reply({"id": 3, "ok": True, "stored": 2})["stored"] == 2

# -- the blocking client against a same-uid daemon in a thread of this process ------------
# (tests.support.fake_daemon.HostileSocketDaemon: every trust check passes, then it answers
# as each test scripts it)
TIMEOUT = 0.5


def _answer(conn: socket.socket, req: dict[str, Any]) -> None:
    HostileSocketDaemon.send(conn, {"id": req["id"], "ok": True, "deleted": 0, "stats": {}})


def test_a_sync_reply_announced_larger_than_any_is_refused_before_its_body(
        tmp_path: Path) -> None:
    """A reply frame whose length prefix exceeds ``MAX_REPLY`` is a ProtocolError as soon
    as the prefix is read: the client neither waits for nor buffers a body it would refuse
    anyway. Mutant that survived: the sync client's length check dropped (it waited for
    the announced bytes until its timeout)."""
    def huge(conn: socket.socket, req: dict[str, Any]) -> None:
        conn.sendall(LENGTH.pack(MAX_REPLY + 1))

    with HostileSocketDaemon(tmp_path, BLOCK, handler=huge) as d:
        c = connect(d.path, timeout=TIMEOUT)
        with pytest.raises(ProtocolError, match="too large"):
            c.stats()
        c.close()


def test_an_error_about_the_whole_connection_is_not_an_answered_refusal(
        tmp_path: Path) -> None:
    """An error reply to a request is the daemon's answer (``reported``: the connection
    stands, the vLLM link keeps it); the same error sent with id 0 is about the whole
    connection, which the daemon closes: ``reported`` is False, so the link drops it and
    reconnects. Mutant that survived: an id-0 error kept ``reported`` True."""
    answers = [{"ok": False, "code": "limit", "error": "this request is too long"},
               {"ok": False, "code": "limit", "error": "frame too large", "id": 0}]

    def refuse(conn: socket.socket, req: dict[str, Any]) -> None:
        HostileSocketDaemon.send(conn, {"id": req["id"], **answers.pop(0)})

    with HostileSocketDaemon(tmp_path, BLOCK, handler=refuse) as d:
        c = connect(d.path, timeout=TIMEOUT)
        with pytest.raises(LimitExceeded) as answered:
            c.stats()
        assert answered.value.reported is True
        with pytest.raises(LimitExceeded) as ended:
            c.stats()
        assert ended.value.reported is False
        c.close()


def test_a_skipped_nowait_reply_is_no_longer_owed(tmp_path: Path) -> None:
    """A reply to a request sent without waiting (``report_engine_nowait``) that the next
    call skips is paid: a ``delete`` then settles nothing and is answered at once. Mutant
    that survived: skipping did not count the reply as paid, so the delete waited for a
    reply that never comes and failed with RequestTimeout."""
    with HostileSocketDaemon(tmp_path, BLOCK, handler=_answer) as d:
        c = connect(d.path, timeout=TIMEOUT)
        c.report_engine_nowait(running=1)
        c.ping()    # reads the report's reply first, then its own
        assert c.delete(NS, block_keys(NS, range(LAYOUT.tokens_per_block))) == 0
        assert [r["op"] for r in d.requests] == ["report_engine", "ping", "register_layout",
                                                 "delete"]
        c.close()



def _open_on(path: Path) -> int:
    """Descriptors of this process open on ``path``."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
    return n


@pytest.mark.parametrize("bad", [{"version": 99}, {"key_scheme": "other/0"},
                                 {"arena": {"path": "/dev/shm/x", "size": 0}}])
def test_a_refused_hello_leaves_no_descriptor_open(tmp_path: Path,
                                                   bad: dict[str, Any]) -> None:
    """A hello the client refuses (another protocol version or key scheme, no valid arena)
    closes the arena descriptor the daemon passed with it: a client retrying such a daemon
    must not run out of descriptors. Mutant that survived: the descriptors were not closed
    when a hello check failed (one leaked per connect)."""
    with HostileSocketDaemon(tmp_path, BLOCK, hello_extra=bad) as d:
        assert _open_on(d.arena) == 1   # the scripted daemon's own
        for _ in range(3):
            with pytest.raises((HandshakeError, ProtocolError)):
                connect(d.path, timeout=TIMEOUT)
        assert _open_on(d.arena) == 1

class ExactView:
    """A presence filter that says every key may be present."""

    exact = True

    def leading_bound(self, keys: Any) -> int:
        return len(keys)

    def close(self) -> None:
        pass


def test_the_presence_bound_is_not_trusted_once_the_daemon_wrote_out_of_turn(
        tmp_path: Path) -> None:
    """``leading_bound`` answers from the daemon's presence filter only while the connection
    is quiet: a frame the daemon wrote with nothing asked (an error about the connection,
    the connection about to close) makes it None, so the caller asks the daemon, which
    reports what happened. Mutant that survived: only a hang-up was looked at."""
    with HostileSocketDaemon(tmp_path, BLOCK, handler=_answer) as d:
        c = connect(d.path, timeout=TIMEOUT)
        c._ops.presence = ExactView()   # type: ignore[assignment]
        keys = block_keys(NS, range(2 * LAYOUT.tokens_per_block))
        assert c.leading_bound(keys) == 2
        d.send(d.conns[0], {"id": 0, "ok": False, "code": "internal", "error": "going"})
        assert select.select([c._sock], [], [], 2.0)[0]
        assert c.leading_bound(keys) is None
        c._ops.presence = None
        c.close()


def test_a_sync_call_ends_by_its_deadline_when_each_byte_comes_just_in_time(
        tmp_path: Path) -> None:
    """A call ends by its deadline even when each byte of the reply comes just before a
    whole timeout passed: the socket's own timeout is cut to what the call has left, so
    the last receive cannot wait a whole timeout past the deadline. Mutant that survived:
    the socket's timeout stayed the whole timeout (the call ended up to a timeout late)."""
    gap = 0.9 * TIMEOUT

    def trickling(conn: socket.socket, req: dict[str, Any]) -> None:
        threading.Thread(target=HostileSocketDaemon.trickle, daemon=True, args=(
            conn, pack({"id": req["id"], "ok": True, "stats": {}}), gap)).start()

    with HostileSocketDaemon(tmp_path, BLOCK, handler=trickling) as d:
        c = connect(d.path, timeout=TIMEOUT)
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):
            c.stats()
        assert time.monotonic() - t0 < TIMEOUT + gap / 2
        c.close()


class RecordingClient:
    """What a lease needs of its client: ``_ops`` and a ``_run`` that answers every
    request ok (a commit stores what its lease held) and records the requests."""

    def __init__(self, ops: Ops) -> None:
        self._ops = ops
        self.sent: list[str] = []

    def _run(self, op: Op) -> Any:
        try:
            req = next(op)
            while True:
                req = req.req if isinstance(req, NoWait) else req
                self.sent.append(request(req)["op"])
                req = op.send({"ok": True, "stored": 0})
        except StopIteration as stop:
            return stop.value


def test_a_put_lease_is_ended_once(ops: Ops) -> None:
    """A put lease sends one ``put_abort`` however often it is aborted, and none after its
    commit: the daemon has forgotten the lease by then, and a second end would be a
    LeaseError out of a harmless cleanup. Mutant that survived: ``abort`` sent its request
    whatever the lease's state."""
    client = RecordingClient(ops)
    lease = PutLease(client, 7, [])  # type: ignore[arg-type]
    lease.abort()
    lease.abort()
    committed = PutLease(client, 8, [])  # type: ignore[arg-type]
    committed.commit()
    committed.abort()
    assert client.sent == ["put_abort", "put_commit"]


def test_a_get_lease_is_released_once(ops: Ops) -> None:
    """A get lease sends one ``get_release`` however often it is released (its context's
    exit after an explicit release included). Mutant that survived: every release sent
    its request, so a second one was the daemon's LeaseError."""
    client = RecordingClient(ops)
    with GetLease(client, 7, []) as lease:  # type: ignore[arg-type]
        lease.release()
        lease.release()
    assert client.sent == ["get_release"]


def test_a_get_fills_the_callers_own_buffers_of_any_kind(ops: Ops) -> None:
    """A copying ``get`` writes each block into the caller's buffer itself, a bytearray or
    a memoryview as much as a numpy array (one memcpy through a flat view), never into a
    temporary copy of it. Mutant that survived: a buffer that is not an ndarray was copied
    first, so the get reported the blocks loaded and left the caller's buffer as it was."""
    assert ops.arena is not None
    for i in range(3):
        ops.arena.view(i * SLOT, BLOCK, writable=True)[:] = i + 1
    keys = block_keys(NS, range(3 * LAYOUT.tokens_per_block))
    outs: list[Any] = [bytearray(BLOCK), memoryview(bytearray(BLOCK)), np.zeros(BLOCK, np.uint8)]
    op = ops.op_get(NS, keys, outs)
    assert request(next(op))["op"] == "get_prepare"
    release = op.send({"ok": True, "lease": 1, "offsets": [0, SLOT, 2 * SLOT], "ttl_s": 30.0})
    assert isinstance(release, NoWait) and release.req["op"] == "get_release"
    with pytest.raises(StopIteration) as stop:
        op.send({})
    assert stop.value.value == 3
    for i, out in enumerate(outs):
        assert bytes(out) == bytes([i + 1]) * BLOCK


# -- the asyncio client against the scripted daemon ---------------------------------------


async def _connected(d: HostileSocketDaemon, timeout: float = TIMEOUT) -> AsyncKVTierClient:
    return await connect_async(d.path, timeout=timeout)


def test_an_async_reply_announced_larger_than_any_ends_the_connection_at_once(
        tmp_path: Path) -> None:
    """The asyncio client refuses a reply frame announced beyond ``MAX_REPLY`` as soon as
    its length prefix is read: the connection ends and the waiting call fails with that
    reason, without waiting for the body. Mutant that survived: the length check dropped
    (the call waited for the body until its timeout)."""
    def huge(conn: socket.socket, req: dict[str, Any]) -> None:
        conn.sendall(LENGTH.pack(MAX_REPLY + 1))

    async def run() -> None:
        c = await _connected(d)
        with pytest.raises(DaemonUnavailable, match="too large"):
            await c.stats()
        await c.close()

    with HostileSocketDaemon(tmp_path, BLOCK, handler=huge) as d:
        asyncio.run(run())


def test_an_async_call_gets_the_typed_error_the_daemon_ended_its_connection_with(
        tmp_path: Path) -> None:
    """An error the daemon sends with id 0 (about the whole connection, before it closes
    it) reaches every call waiting as that typed error, with the daemon's reason, not as
    a bare "connection lost". Mutant that survived: the id-0 reply was not handed to the
    waiting calls, which saw only DaemonUnavailable."""
    def ended(conn: socket.socket, req: dict[str, Any]) -> None:
        HostileSocketDaemon.send(conn, {"id": 0, "ok": False, "code": "limit",
                                        "error": "a frame beyond daemon.max_frame"})

    async def run() -> None:
        c = await _connected(d)
        with pytest.raises(LimitExceeded, match="max_frame"):
            await c.stats()
        await c.close()

    with HostileSocketDaemon(tmp_path, BLOCK, handler=ended) as d:
        asyncio.run(run())


def test_every_late_lease_ends_however_many_came_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A get the asyncio client gave up on (past its timeout) is released as soon as its
    late reply names the lease; at most ``MAX_LATE_LEASES`` such replies are awaited at
    once, and each one that came frees its place. With one place, two gets given up on one
    after the other are both released. Mutant that survived: a place was never freed, so
    after ``MAX_LATE_LEASES`` late replies no lease was ended before its TTL."""
    monkeypatch.setattr(aio, "MAX_LATE_LEASES", 1)
    leases = iter(range(1, 100))
    timeout = 0.2

    def late(conn: socket.socket, req: dict[str, Any]) -> None:
        if req["op"] != "get_prepare":
            return _answer(conn, req)
        reply = {"id": req["id"], "ok": True, "lease": next(leases), "offsets": [],
                 "ttl_s": 30.0}
        threading.Timer(1.5 * timeout, HostileSocketDaemon.send, (conn, reply)).start()

    async def run() -> None:
        c = await _connected(d, timeout)
        keys = block_keys(NS, range(LAYOUT.tokens_per_block))
        for _ in range(2):
            with pytest.raises(RequestTimeout):
                await c.prepare_get(NS, keys)
            await asyncio.sleep(timeout)   # the late reply comes, and its release goes
        await c.stats()   # (answered after both releases: they reached the daemon)
        await c.close()

    with HostileSocketDaemon(tmp_path, BLOCK, handler=late) as d:
        asyncio.run(run())
        assert [r["lease"] for r in d.requests if r["op"] == "get_release"] == [1, 2]


def test_an_async_delete_fails_when_an_owed_release_never_comes(tmp_path: Path) -> None:
    """A delete first waits (within the timeout) for the replies of the releases this
    client sent without waiting: until they came, its own gets may still pin the blocks.
    A release never answered is a RequestTimeout of the delete, not a delete that skips
    the caller's own blocks. Mutant that survived: the wait's timeout was ignored and the
    delete went ahead."""
    def no_release_reply(conn: socket.socket, req: dict[str, Any]) -> None:
        if req["op"] == "get_prepare":
            HostileSocketDaemon.send(conn, {"id": req["id"], "ok": True, "lease": 5,
                                            "offsets": [0], "ttl_s": 30.0})
        elif req["op"] != "get_release":
            _answer(conn, req)

    async def run() -> None:
        c = await _connected(d)
        keys = block_keys(NS, range(LAYOUT.tokens_per_block))
        lease = await c.prepare_get(NS, keys)
        await lease.release()   # sent without waiting: its reply is owed
        with pytest.raises(RequestTimeout, match="sent without waiting"):
            await c.delete(NS, keys)
        await c.close()

    with HostileSocketDaemon(tmp_path, BLOCK, handler=no_release_reply) as d:
        asyncio.run(run())
        assert "delete" not in [r["op"] for r in d.requests]
