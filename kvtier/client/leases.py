"""Put and get leases: arena slots locked for one client between prepare and commit/release.

The rules (when a lease is open, what ends it, which errors a context manager lets through)
are written once, in ``_PutLeaseRules`` and ``_GetLeaseRules``, as ops; the sync and asyncio
leases only run those ops on their client's transport. See docs/client-api.md ("Leases and
their TTL") for what ``LeaseExpired`` means for each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.client.ops import Op, Ops, done, quietly

if TYPE_CHECKING:
    from kvtier.client.aio import AsyncKVTierClient
    from kvtier.client.sync import KVTierClient


class _PutLeaseRules:
    """A put lease's state and the ops that end it (commit, abort, context exit)."""

    def __init__(self, ops: Ops, lease: int, views: list[np.ndarray | None]) -> None:
        self._ops, self.lease, self.views = ops, lease, views
        self._open = True
        self.redis_visible: int | None = None   # after a commit with redis_sync_s
        self.redis_synced: bool | None = None
        self.redis_sync_reason: str | None = None   # why not synced ("off": no Redis tier)

    def _commit_op(self, durable: bool, output_tokens: int | None,
                   redis_sync_s: float | None = None) -> Op:
        self._open = False
        if redis_sync_s is None:
            return self._ops.op_commit(self.lease, durable, output_tokens, len(self.views))
        return self._commit_sync_op(durable, output_tokens, redis_sync_s)

    def _commit_sync_op(self, durable: bool, output_tokens: int | None, wait: float) -> Op:
        stored, self.redis_visible, self.redis_synced, self.redis_sync_reason = \
            yield from self._ops.op_commit_sync(self.lease, durable, output_tokens, wait,
                                                len(self.views))
        return stored

    def _abort_op(self) -> Op:
        if not self._open:
            return done()
        self._open = False
        return self._ops.op_abort(self.lease)

    def _exit_op(self, exc_type: Any) -> Op:
        """Commit on normal exit (its errors propagate); abort quietly on an exception (the
        body's exception propagates); nothing if the body already ended the lease."""
        if not self._open:
            return done()
        if exc_type is None:
            return self._commit_op(False, None)
        return quietly(self._abort_op())


class _GetLeaseRules:
    """A get lease's state and the ops that end it (release, context exit)."""

    def __init__(self, ops: Ops, lease: int, views: list[Any],
                 devices: list[str] | None = None, safe_until: float | None = None) -> None:
        self._ops, self.lease, self.views = ops, lease, views
        self.devices: list[str] = devices if devices is not None else ["cpu"] * len(views)
        self._safe_until = safe_until   # see Ops.op_release
        self._open = True

    def _release_op(self, copy_s: float | None = None) -> Op:
        if not self._open:
            return done()
        self._open = False
        return self._ops.op_release(self.lease, copy_s, self._safe_until)

    def _exit_op(self, exc_type: Any) -> Op:
        """Release on normal exit and let its errors propagate (a reader must learn that its
        bytes are not valid); on an exception release quietly (the body's propagates)."""
        if exc_type is None:
            return self._release_op()
        return quietly(self._release_op())


class PutLease(_PutLeaseRules):
    """Write-locked arena slots; ``views[i]`` is None where key i needs no write.

    ``commit`` raises ``LeaseExpired`` (nothing stored) when the lease outlived the daemon's
    TTL; writes made after the expiry land in quarantined slots and harm no one. As a
    context manager: commit on normal exit (its errors propagate), abort on an exception
    (abort errors suppressed, the body's exception propagates).
    """

    def __init__(self, client: KVTierClient, lease: int, views: list[np.ndarray | None]):
        super().__init__(client._ops, lease, views)
        self._client = client

    def commit(self, *, durable: bool = False, output_tokens: int | None = None,
               redis_sync_s: float | None = None) -> int:
        """Publish the written blocks; ``durable`` waits until they are on nvme.

        ``output_tokens``: how many tokens the engine generated after this prompt, when
        known; the daemon's cost policy learns reuse per kind of request from it.
        ``redis_sync_s``: answer only once every block of the put (new or stored before) is
        visible in the shared Redis, or that many seconds passed (at most 90% of the
        client's timeout); ``redis_visible`` and ``redis_synced`` then say how it went.
        """
        return self._client._run(self._commit_op(
            durable, output_tokens, _sync_wait(redis_sync_s, self._client)))

    def abort(self) -> None:
        self._client._run(self._abort_op())

    def __enter__(self) -> PutLease:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self._client._run(self._exit_op(exc_type))


class GetLease(_GetLeaseRules):
    """Read-locked slots of the leading available blocks.

    ``views[i]`` is a read-only numpy array over the arena when ``devices[i] == "cpu"`` (always,
    unless the get asked for device placement), and a uint8 cupy array over the daemon's
    HBM pool when ``devices[i] == "hbm"`` (read it, never write it).

    What was read through the views is valid only if ``release`` succeeds: it raises
    ``LeaseExpired`` when the lease outlived the daemon's TTL (the slots may have been
    reused by another client meanwhile, so discard everything read), and any other error
    when the daemon could not confirm the lease. As a context manager: on normal exit it
    releases and lets those errors propagate (a reader must learn that its bytes are not
    valid); on an exception it releases quietly and the body's exception propagates.
    """

    def __init__(self, client: KVTierClient, lease: int, views: list[Any],
                 devices: list[str] | None = None, safe_until: float | None = None):
        super().__init__(client._ops, lease, views, devices, safe_until)
        self._client = client

    def release(self, *, copy_s: float | None = None) -> None:
        """Give the slots back; ``LeaseExpired`` when what was read may be wrong.
        ``copy_s``: how long reading them took, when measured (it feeds the daemon's
        reload-bandwidth estimate, see ``LookupResult.bandwidth``)."""
        self._client._run(self._release_op(copy_s))

    def __enter__(self) -> GetLease:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self._client._run(self._exit_op(exc_type))


class AsyncPutLease(_PutLeaseRules):
    """``PutLease`` for the asyncio client (same ``views``, same expiry rules; ``async with``
    commits on normal exit and aborts on an exception)."""

    def __init__(self, client: AsyncKVTierClient, lease: int,
                 views: list[np.ndarray | None]):
        super().__init__(client._ops, lease, views)
        self._client = client

    async def commit(self, *, durable: bool = False, output_tokens: int | None = None,
                     redis_sync_s: float | None = None) -> int:
        """Publish the written blocks; ``LeaseExpired`` (nothing stored) past the TTL
        (``redis_sync_s``: see ``PutLease.commit``)."""
        return await self._client._run(self._commit_op(
            durable, output_tokens, _sync_wait(redis_sync_s, self._client)))

    async def abort(self) -> None:
        await self._client._run(self._abort_op())

    async def __aenter__(self) -> AsyncPutLease:
        return self

    async def __aexit__(self, exc_type: Any, *_: Any) -> None:
        await self._client._run(self._exit_op(exc_type))


class AsyncGetLease(_GetLeaseRules):
    """``GetLease`` for the asyncio client (same ``views``, ``devices`` and expiry rules:
    ``release`` raises ``LeaseExpired`` when what was read may be wrong)."""

    def __init__(self, client: AsyncKVTierClient, lease: int, views: list[Any],
                 devices: list[str] | None = None, safe_until: float | None = None):
        super().__init__(client._ops, lease, views, devices, safe_until)
        self._client = client

    async def release(self, *, copy_s: float | None = None) -> None:
        await self._client._run(self._release_op(copy_s))

    async def __aenter__(self) -> AsyncGetLease:
        return self

    async def __aexit__(self, exc_type: Any, *_: Any) -> None:
        await self._client._run(self._exit_op(exc_type))


def _sync_wait(redis_sync_s: float | None, client: Any) -> float | None:
    """How long a synchronous commit may wait: within the client's own timeout, so the
    reply always arrives before the client gives up on the connection."""
    return None if redis_sync_s is None else min(redis_sync_s, 0.9 * client._timeout)
