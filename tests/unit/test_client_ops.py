"""The client's put and get, written once as sans-I/O ops, driven by both clients' ``_run``.

The daemon is a scripted function over a real arena mapping (no socket, no process): each
test checks the requests an op sends, the bytes it copies and the errors it lets through,
and runs the same op under the sync and the asyncio driver, which must behave identically.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvtier.client import (
    PUT_BATCH,
    AsyncGetLease,
    AsyncKVTierClient,
    AsyncPutLease,
    GetLease,
    KVTierClient,
    PutLease,
)
from kvtier.client.ops import RELEASE_SAFE_SHARE, NoWait, Op, Ops, release_safe_until
from kvtier.errors import BufferSizeError, DaemonUnavailable, LeaseExpired, error_from_code
from kvtier.keys import KEY_BYTES, Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.tiers.aligned import round_up
from kvtier.tiers.arena_mapping import ArenaMapping
from tests.support.arena import temp_arena

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                  tokens_per_block=16)   # 256-byte blocks
BLOCK = LAYOUT.block_bytes
SLOT = round_up(BLOCK)   # the arena hands out whole pages
NS = Namespace("test/ops", LAYOUT)
Reply = Callable[[dict[str, Any]], dict[str, Any]]


class ScriptedDaemon:
    """Answers requests like the daemon: slots i*SLOT for a prepare, per-op overrides."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail: dict[str, str] = {}          # op -> error code to reply with
        self.sizes: dict[int, int] = {}          # lease -> blocks

    def __call__(self, req: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(dict(req))
        op = req["op"]
        if op in self.fail:
            code = self.fail[op]
            raise error_from_code(code, f"scripted {code}")
        if op == "register_layout":
            return {"ok": True, "ns": NS.digest}
        if op in ("put_prepare", "get_prepare"):
            lease = len(self.sizes) + 1
            self.sizes[lease] = n = len(req["keys"]) // KEY_BYTES
            return {"ok": True, "lease": lease, "offsets": [i * SLOT for i in range(n)]}
        if op == "put_commit":
            return {"ok": True, "stored": self.sizes[req["lease"]]}
        if op == "delete":
            return {"ok": True, "deleted": len(req["keys"]) // KEY_BYTES}
        return {"ok": True}

    def ops(self) -> list[str]:
        return [r["op"] for r in self.requests]


class SyncDriver:
    """``KVTierClient._run`` over the scripted daemon instead of a socket."""

    def __init__(self, daemon: ScriptedDaemon) -> None:
        self._call = daemon
        self.daemon = daemon

    def _settle(self) -> dict[str, Any]:
        self.daemon.requests.append({"op": "(settle)"})
        return {}

    def run(self, op: Op) -> Any:
        return KVTierClient._run(self, op)  # type: ignore[arg-type]


class AsyncDriver:
    """``AsyncKVTierClient._run`` over the scripted daemon instead of asyncio streams."""

    def __init__(self, daemon: ScriptedDaemon) -> None:
        self.daemon = daemon

    async def _call(self, req: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0)
        return self.daemon(req)

    async def _settle(self) -> dict[str, Any]:
        await asyncio.sleep(0)
        self.daemon.requests.append({"op": "(settle)"})
        return {}

    def run(self, op: Op) -> Any:
        return asyncio.run(AsyncKVTierClient._run(self, op))  # type: ignore[arg-type]


@pytest.fixture(params=["sync", "async"])
def driver(request: pytest.FixtureRequest) -> type[SyncDriver] | type[AsyncDriver]:
    return SyncDriver if request.param == "sync" else AsyncDriver


@pytest.fixture
def ops() -> Iterator[Ops]:
    with temp_arena(1 << 20, 1 << 20) as arena:
        o = Ops()
        o.arena = ArenaMapping(str(arena.path), arena.size)
        o._registered.add(NS.digest)
        yield o
        o.close()


def keys(n: int) -> list[bytes]:
    return block_keys(NS, range(n * LAYOUT.tokens_per_block))


def blocks(n: int) -> list[np.ndarray]:
    return [np.full(BLOCK, i + 1, np.uint8) for i in range(n)]


def test_put_batches_copies_and_commits(ops: Ops, driver: Any) -> None:
    daemon = ScriptedDaemon()
    n = PUT_BATCH + 3
    stored = driver(daemon).run(ops.op_put(NS, keys(n), blocks(n), True, 42))
    assert stored == n
    assert daemon.ops() == ["put_prepare", "put_commit", "put_prepare", "put_commit"]
    second = daemon.requests[2]
    assert second["parent"] == keys(n)[PUT_BATCH - 1] and second["depth"] == PUT_BATCH
    commits = [r for r in daemon.requests if r["op"] == "put_commit"]
    assert [c["output_tokens"] for c in commits] == [None, 42]
    assert all(c["durable"] for c in commits)
    # the second batch's 3 blocks were the last copied into slots 0..2
    assert ops.arena is not None
    assert bytes(ops.arena.view(0, BLOCK, writable=False)) == bytes([PUT_BATCH + 1]) * BLOCK


def test_a_failed_copy_aborts_the_lease_and_raises_the_copy_error(
        ops: Ops, driver: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = ScriptedDaemon()
    daemon.fail["put_abort"] = "unavailable"           # the abort's own failure is ignored
    fine = [blocks(1)[0]]

    def copy_fails(buf: Any) -> np.ndarray:
        if buf is fine[0]:
            return np.asarray(buf)
        raise MemoryError("copy failed")

    monkeypatch.setattr("kvtier.client.ops.as_bytes", copy_fails)
    with pytest.raises(MemoryError, match="copy failed"):
        driver(daemon).run(ops.op_put(NS, keys(2), [fine[0], blocks(2)[1]], False, None))
    assert daemon.ops() == ["put_prepare", "put_abort"]


def test_lease_expired_at_commit_surfaces_from_put(ops: Ops, driver: Any) -> None:
    daemon = ScriptedDaemon()
    daemon.fail["put_commit"] = LeaseExpired.code
    with pytest.raises(LeaseExpired):
        driver(daemon).run(ops.op_put(NS, keys(2), blocks(2), False, None))
    assert daemon.ops() == ["put_prepare", "put_commit"]


def test_get_copies_then_releases(ops: Ops, driver: Any) -> None:
    daemon = ScriptedDaemon()
    assert ops.arena is not None
    ops.arena.view(SLOT, BLOCK, writable=True)[:] = 9
    out = [np.zeros(BLOCK, np.uint8) for _ in range(2)]
    assert driver(daemon).run(ops.op_get(NS, keys(2), out)) == 2
    assert daemon.ops() == ["get_prepare", "get_release"]
    assert (out[1] == 9).all()


def test_lease_expired_at_release_surfaces_from_get(ops: Ops, driver: Any) -> None:
    daemon = ScriptedDaemon()
    daemon.fail["get_release"] = LeaseExpired.code
    with pytest.raises(LeaseExpired):
        driver(daemon).run(ops.op_get(NS, keys(1), [np.zeros(BLOCK, np.uint8)]))


def test_a_failed_get_copy_releases_quietly(ops: Ops, driver: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that fails after the lease was granted (here: the arena view cannot be read)
    releases the lease, and the copy's error, not the release's, reaches the caller."""
    daemon = ScriptedDaemon()
    daemon.fail["get_release"] = DaemonUnavailable.code

    def broken_copy(dst: Any, src: Any) -> None:
        raise OSError("arena page lost")

    monkeypatch.setattr(np, "copyto", broken_copy)
    with pytest.raises(OSError, match="arena page lost"):
        driver(daemon).run(ops.op_get(NS, keys(1), [np.zeros(BLOCK, np.uint8)]))
    assert daemon.ops() == ["get_prepare", "get_release"]


def test_wrong_buffers_fail_before_any_request(ops: Ops, driver: Any) -> None:
    daemon = ScriptedDaemon()
    with pytest.raises(BufferSizeError):
        driver(daemon).run(ops.op_put(NS, keys(2), blocks(1), False, None))
    with pytest.raises(BufferSizeError):
        driver(daemon).run(ops.op_get(NS, keys(1), [np.zeros(7, np.uint8)]))
    assert daemon.requests == []


def strided_buffers() -> list[Any]:
    """Block-sized buffers with no flat view (numpy would copy them): each refused."""
    return [np.zeros((16, BLOCK // 16), np.uint8, order="F"),       # Fortran order
            np.zeros((BLOCK // 16, 16), np.uint8).T,                  # a transposed view
            np.zeros((16, 2 * BLOCK // 16), np.uint8)[:, : BLOCK // 16],   # a column slice
            np.zeros((BLOCK // 2 // 8, 8), np.float16).T,             # another dtype
            np.zeros(2 * BLOCK, np.uint8).data[::2]]                  # a strided memoryview


@pytest.mark.parametrize("index", range(5))
def test_buffers_that_are_not_c_contiguous_fail_before_any_request(
        ops: Ops, driver: Any, index: int) -> None:
    daemon = ScriptedDaemon()
    assert ops.arena is not None
    ops.arena.view(0, BLOCK, writable=True)[:] = 9
    for op in (ops.op_get(NS, keys(2), [np.zeros(BLOCK, np.uint8), strided_buffers()[index]]),
               ops.op_put(NS, keys(2), [blocks(1)[0], strided_buffers()[index]], False, None)):
        with pytest.raises(BufferSizeError, match="buffer 1 is not C-contiguous"):
            driver(daemon).run(op)
    assert daemon.requests == []


def test_a_delete_settles_the_releases_sent_without_waiting_first(
        ops: Ops, driver: Any) -> None:
    daemon = ScriptedDaemon()
    assert driver(daemon).run(ops.op_delete(NS, keys(2))) == 2
    assert daemon.ops() == ["(settle)", "delete"]


def test_a_forgotten_namespace_is_registered_again(ops: Ops, driver: Any) -> None:
    daemon = ScriptedDaemon()
    answer = daemon.__call__
    forgot = [True]

    def once_unknown(req: dict[str, Any]) -> dict[str, Any]:
        if req["op"] == "lookup" and forgot[0]:
            forgot[0] = False
            daemon.requests.append(dict(req))
            raise error_from_code("unknown_namespace", "forgot it")
        if req["op"] == "lookup":
            daemon.requests.append(dict(req))
            return {"ok": True, "hits": 1, "tiers": ["cpu"]}
        return answer(req)

    res = driver(once_unknown).run(ops.op_lookup(NS, keys(1), True))
    assert (res.hits, res.tiers) == (1, ["cpu"])
    assert daemon.ops() == ["lookup", "register_layout", "lookup"]


# -- lease rules: one implementation, both transports -------------------------------------------
class _Client:
    """What a lease needs of its client: the ops and a ``_run`` (sync or asyncio)."""

    def __init__(self, ops: Ops, daemon: ScriptedDaemon, is_async: bool) -> None:
        self._ops = ops
        driver = AsyncDriver(daemon)
        self._run = ((lambda op: AsyncKVTierClient._run(driver, op)) if is_async  # type: ignore[arg-type]
                     else SyncDriver(daemon).run)


def put_lease_exit(ops: Ops, daemon: ScriptedDaemon, is_async: bool, *, fail: bool,
                   commit_inside: bool = False) -> None:
    """Open a put lease as a context manager and leave it normally or by an exception."""
    client = _Client(ops, daemon, is_async)
    if not is_async:
        with PutLease(client, 7, []) as lease:  # type: ignore[arg-type]
            if commit_inside:
                lease.commit()
            if fail:
                raise KeyError("body")
        return

    async def body() -> None:
        async with AsyncPutLease(client, 7, []) as lease:  # type: ignore[arg-type]
            if commit_inside:
                await lease.commit()
            if fail:
                raise KeyError("body")

    asyncio.run(body())


@pytest.mark.parametrize("is_async", [False, True])
def test_put_lease_context_commits_aborts_and_guards(ops: Ops, is_async: bool) -> None:
    daemon = ScriptedDaemon()
    daemon.sizes[7] = 0
    put_lease_exit(ops, daemon, is_async, fail=False)
    assert daemon.ops() == ["put_commit"]
    daemon.requests.clear()
    daemon.fail["put_abort"] = "unavailable"
    with pytest.raises(KeyError):             # the body's error, not the abort's
        put_lease_exit(ops, daemon, is_async, fail=True)
    assert daemon.ops() == ["put_abort"]
    daemon.requests.clear()
    with pytest.raises(KeyError):
        put_lease_exit(ops, daemon, is_async, fail=True, commit_inside=True)
    assert daemon.ops() == ["put_commit"]     # committed already: no abort after it


@pytest.mark.parametrize("is_async", [False, True])
def test_get_lease_context_lets_lease_expired_through_only_on_normal_exit(
        ops: Ops, is_async: bool) -> None:
    daemon = ScriptedDaemon()
    daemon.fail["get_release"] = LeaseExpired.code
    client = _Client(ops, daemon, is_async)

    def leave(fail: bool) -> None:
        if not is_async:
            with GetLease(client, 3, []):  # type: ignore[arg-type]
                if fail:
                    raise KeyError("body")
            return

        async def body() -> None:
            async with AsyncGetLease(client, 3, []):  # type: ignore[arg-type]
                if fail:
                    raise KeyError("body")

        asyncio.run(body())

    with pytest.raises(LeaseExpired):
        leave(fail=False)
    with pytest.raises(KeyError):
        leave(fail=True)
    assert daemon.ops() == ["get_release", "get_release"]


def test_a_release_skips_its_reply_only_within_the_safe_share_of_the_ttl() -> None:
    now = time.monotonic()
    assert release_safe_until(now, 30.0) == pytest.approx(now + RELEASE_SAFE_SHARE * 30.0)
    for said in (None, 0, -1.0, True, "30"):   # an old daemon, or nonsense: always wait
        assert release_safe_until(now, said) is None
    (req,) = list(Ops.op_release(7, 0.25, safe_until=time.monotonic() + 60))
    assert isinstance(req, NoWait)
    assert req.req == {"op": "get_release", "lease": 7, "copy_s": 0.25}
    for safe_until in (None, time.monotonic() - 1e-3):
        (req,) = list(Ops.op_release(7, safe_until=safe_until))
        assert req == {"op": "get_release", "lease": 7}
