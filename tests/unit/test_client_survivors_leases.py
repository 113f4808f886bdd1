"""Survivors of the client mutation round, part three: the lease rules
(``kvtier.client.leases``), one implementation run by the sync and the asyncio leases over
the scripted daemon of test_client_ops (no socket, no process)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kvtier.client import AsyncGetLease, AsyncPutLease, GetLease, PutLease
from kvtier.client.ops import NoWait, Op, Ops
from kvtier.errors import LeaseExpired
from tests.unit.test_client_ops import ScriptedDaemon, _Client


@pytest.fixture
def ops() -> Ops:
    """The ops a lease's client holds (its requests carry no arena offsets here)."""
    return Ops()


@pytest.mark.parametrize("is_async", [False, True])
def test_a_put_lease_context_lets_its_commit_error_through(ops: Ops, is_async: bool) -> None:
    """Leaving a put lease's context normally commits it and lets the commit's error
    propagate: ``LeaseExpired`` (nothing stored) must reach the caller, who would believe
    the blocks stored otherwise. Mutant that survived: the exit's commit was run quietly."""
    daemon = ScriptedDaemon()
    daemon.fail["put_commit"] = LeaseExpired.code
    client = _Client(ops, daemon, is_async)
    with pytest.raises(LeaseExpired):
        if is_async:
            async def body() -> None:
                async with AsyncPutLease(client, 7, []):  # type: ignore[arg-type]
                    pass
            asyncio.run(body())
        else:
            with PutLease(client, 7, []):  # type: ignore[arg-type]
                pass
    assert [(r["op"], r["durable"]) for r in daemon.requests] == [("put_commit", False)]


class SyncedDaemon(ScriptedDaemon):
    """Answers a commit as one whose blocks are all in Redis."""

    def __call__(self, req: dict[str, Any]) -> dict[str, Any]:
        return {**super().__call__(req), "redis_visible": 0, "redis_synced": True}


@pytest.mark.parametrize("is_async", [False, True])
def test_a_put_lease_commit_sends_what_it_is_given(ops: Ops, is_async: bool) -> None:
    """``commit(output_tokens=..., redis_sync_s=...)`` sends the output tokens (the cost
    policy learns from them) and a Redis wait cut to 90% of the client's timeout (the reply
    must come before the client gives up). Mutants that survived: output_tokens dropped;
    the wait sent uncut."""
    daemon = SyncedDaemon()
    daemon.sizes[7] = 0
    client = _Client(ops, daemon, is_async)
    client._timeout = 2.0  # type: ignore[attr-defined]
    if is_async:
        lease: Any = AsyncPutLease(client, 7, [])  # type: ignore[arg-type]
        asyncio.run(lease.commit(output_tokens=33, redis_sync_s=60.0))
    else:
        lease = PutLease(client, 7, [])  # type: ignore[arg-type]
        lease.commit(output_tokens=33, redis_sync_s=60.0)
    (req,) = daemon.requests
    assert req["output_tokens"] == 33 and req["redis_sync_s"] == pytest.approx(1.8)
    assert (lease.redis_visible, lease.redis_synced) == (0, True)


class NoWaitRecorder:
    """A lease's client that records what each request was sent as."""

    def __init__(self, ops: Ops) -> None:
        self._ops = ops
        self.sent: list[Any] = []

    def _run(self, op: Op) -> Any:
        try:
            req = next(op)
            while True:
                self.sent.append(req)
                req = op.send({"ok": True})
        except StopIteration as stop:
            return stop.value

    async def _arun(self, op: Op) -> Any:
        return NoWaitRecorder._run(self, op)


@pytest.mark.parametrize("is_async", [False, True])
def test_a_get_lease_release_within_its_safe_window_skips_the_reply(
        ops: Ops, is_async: bool) -> None:
    """A get lease released within its safe window sends its release without waiting
    (``NoWait``), with the copy time it was given. Mutants that survived: the lease
    dropped its ``safe_until`` (every load waited a round trip) or its ``copy_s`` (the
    daemon's reload bandwidth was never measured)."""
    client = NoWaitRecorder(ops)
    safe_until = time.monotonic() + 60.0
    if is_async:
        client._run = client._arun  # type: ignore[method-assign]
        lease: Any = AsyncGetLease(client, 4, [], None, safe_until)  # type: ignore[arg-type]
        asyncio.run(lease.release(copy_s=0.125))
    else:
        lease = GetLease(client, 4, [], None, safe_until)  # type: ignore[arg-type]
        lease.release(copy_s=0.125)
    (sent,) = client.sent
    assert isinstance(sent, NoWait)
    assert sent.req == {"op": "get_release", "lease": 4, "copy_s": 0.125}


@pytest.mark.parametrize("is_async", [False, True])
def test_a_put_lease_committed_in_its_context_is_not_committed_again(
        ops: Ops, is_async: bool) -> None:
    """A put lease committed inside its ``with`` block sends nothing more when the block
    ends normally: the daemon has forgotten the lease, so a second commit would be a
    LeaseError out of a put that succeeded. Mutant that survived: the context's exit
    committed whatever the lease's state (only the exit by an exception was covered)."""
    daemon = ScriptedDaemon()
    daemon.sizes[7] = 0
    client = _Client(ops, daemon, is_async)
    if is_async:
        async def body() -> None:
            async with AsyncPutLease(client, 7, []) as lease:  # type: ignore[arg-type]
                await lease.commit()
        asyncio.run(body())
    else:
        with PutLease(client, 7, []) as lease:  # type: ignore[arg-type]
            lease.commit()
    assert daemon.ops() == ["put_commit"]
