"""Every client operation, written once as a sans-I/O generator.

An op yields request dicts and receives the daemon's replies (or, thrown in, the typed
error a request failed with); it never touches a socket. ``KVTierClient`` drives ops with a
blocking socket and ``AsyncKVTierClient`` with asyncio streams (each one's ``_run``), so the
two clients share every rule: re-registering a forgotten namespace, the batching and the
memcpy of ``put`` and ``get``, aborting or releasing a lease when a copy fails, and
``LeaseExpired`` surfacing from the commit or release that ends a lease.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.client.buffers import as_bytes, check_buffers
from kvtier.client.hello import mapped
from kvtier.client.op_protocol import HANGUP as HANGUP  # (re-exported)
from kvtier.client.op_protocol import SETTLE, NoWait, Op, quietly
from kvtier.client.op_protocol import Settle as Settle  # (re-exported)
from kvtier.client.op_protocol import done as done  # (re-exported)
from kvtier.client.replies import MAX_REPLY as MAX_REPLY  # (re-exported)
from kvtier.client.replies import (
    LookupResult,
    count_of,
    get_slots,
    lease_of,
    prefix_results,
    reads_reply,
    slot_offsets,
    stats_of,
)
from kvtier.errors import (
    HandshakeError,
    LimitExceeded,
    ProtocolError,
    UnknownNamespace,
    error_from_code,
)
from kvtier.handshake import hello_request
from kvtier.keys import KEY_SCHEME, BlockKey, Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.presence import PresenceView
from kvtier.tiers.arena_mapping import ArenaMapping

PUT_BATCH = 64
"""Blocks per put round trip in ``put``: amortises the control round trip without pinning
a large share of the arena at once."""
RELEASE_SAFE_SHARE = 0.5
"""A get lease's release need not wait for the daemon's word while less than this share
of its TTL has passed since the get was asked: the daemon cannot have taken its slots back
(the TTL runs from later than that) and, its connection still up, it has not restarted.
Past it, the release waits and ``LeaseExpired`` tells a copy that came too late."""
log = logging.getLogger("kvtier.client")


def release_safe_until(asked: float, ttl_s: Any) -> float | None:
    """When a get lease asked at ``asked`` (``time.monotonic()``, before the request went
    out) stops being provably held; None when the daemon did not say its TTL."""
    if not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool) or not ttl_s > 0:
        return None
    return asked + RELEASE_SAFE_SHARE * float(ttl_s)


class Ops:
    """The sans-I/O request logic of one connection (both clients hold one)."""

    def __init__(self, device: bool = False) -> None:
        self._registered: set[bytes] = set()
        self._max_keys: dict[bytes, int] = {}    # per namespace, from its registration
        self.arena: ArenaMapping | None = None
        self.arena_path: str | None = None        # from the hello (engines share one map)
        self.device = device                      # default of prepare_get's prefer_device
        self.hbm_info: dict[str, Any] | None = None   # the daemon's pool, from the hello
        self.put_bytes = 0   # arena bytes this process may hold in open puts (0: unknown)
        self.hbm: Any = None                      # HbmMapping, opened at first device get
        self.hbm_error: str | None = None         # why the pool could not be mapped here
        self.presence: PresenceView | None = None   # the daemon's presence filter, read-only

    def _device_mapping(self, prefer_device: bool | None) -> Any:
        """The HBM mapping to read device views through, or None for a cpu-only get.

        Opened lazily, once, and only for a get that asked for device placement on a daemon
        that has a pool, so cpu-only clients never import cupy. A pool this process cannot
        map (no GPU visible, CUDA refuses the handle) is logged once and the client falls
        back to cpu views for good.
        """
        if not (self.device if prefer_device is None else prefer_device):
            return None
        if self.hbm is not None or self.hbm_info is None or self.hbm_error is not None:
            return self.hbm
        from kvtier.tiers import hbm as hbm_mod

        info = self.hbm_info
        try:   # (a malformed device in the hello is one logged fallback, found by review)
            device, bus = int(info.get("device", 0)), str(info.get("pci_bus_id", "")) or None
            if not hbm_mod.HbmMapping.on_current_device(device, pci_bus_id=bus):
                # (a tensor-parallel worker on another GPU: its cpu views copy straight
                # to its own GPU, found by review)
                self.hbm_error = "the pool is on another GPU than this process's"
                log.info("the daemon's HBM pool is on GPU %s, not this process's current "
                         "device: reading from cpu", bus or device)
                return None
            self.hbm = hbm_mod.HbmMapping.open(info["handle"], int(info["size"]), device,
                                               pci_bus_id=bus)
        except Exception as exc:  # ImportError (no cupy), ConfigError, CUDARuntimeError
            self.hbm_error = f"{type(exc).__name__}: {exc}"
            log.warning("cannot map the daemon's HBM pool (%s); reading from cpu instead",
                        self.hbm_error)
        return self.hbm

    def close(self) -> None:
        """Unmap the arena and drop this client's reference to the HBM mapping."""
        if self.arena is not None:
            self.arena.close()
        if self.presence is not None:
            self.presence.close()
            self.presence = None
        if self.hbm is not None:
            hbm, self.hbm = self.hbm, None
            with contextlib.suppress(Exception):
                hbm.close()

    def _ensure(self, ns: Namespace) -> Op:
        if ns.digest not in self._registered:
            yield from self._register(ns)

    def _ask(self, ns: Namespace, req: dict[str, Any]) -> Op:
        """Send a request about ``ns``; a daemon that does not know the namespace (it
        restarted, or forgot it as the least recently used) gets it registered again and
        the request once more, so callers never see that."""
        yield from self._ensure(ns)
        try:
            return (yield req)
        except UnknownNamespace:
            self._registered.discard(ns.digest)
            yield from self._register(ns)
            return (yield req)

    @reads_reply
    def _register(self, ns: Namespace) -> Op:
        reply = yield {"op": "register_layout", "layout": ns.layout.to_dict(),
                       "model_id": ns.model_id, "tp_rank": ns.tp_rank, "tp_size": ns.tp_size,
                       "cache_salt": ns.cache_salt}
        if reply.get("ns") != ns.digest:
            raise HandshakeError("the daemon computed another namespace digest: it runs "
                                 "another kvtier version (key scheme) than this client "
                                 f"({KEY_SCHEME}); restart the daemon after upgrading kvtier")
        self._registered.add(ns.digest)
        max_keys = reply.get("max_keys")
        if type(max_keys) is int and max_keys > 0:
            self._max_keys[ns.digest] = max_keys
        return ns

    @staticmethod
    def _target(op: str, ns: Namespace, keys: Sequence[BlockKey]) -> dict[str, Any]:
        return {"op": op, "ns": ns.digest, "layout_fp": ns.layout.fingerprint,
                "keys": b"".join(keys)}

    def op_register(self, layout: KVLayout, model_id: str, tp_rank: int, tp_size: int,
                    cache_salt: str | None) -> Op:
        ns = Namespace(model_id, layout, tp_rank, tp_size, cache_salt)
        return (yield from self._register(ns))

    @reads_reply
    def op_lookup(self, ns: Namespace, keys: Sequence[BlockKey], prefetch: bool) -> Op:
        if not keys:
            return LookupResult.from_reply({"hits": 0, "tiers": []}, 0)
        req = self._target("lookup", ns, keys)
        req["prefetch"] = prefetch
        reply = yield from self._ask(ns, req)
        return LookupResult.from_reply(reply, len(keys))

    @reads_reply
    def op_prepare_put(self, ns: Namespace, keys: Sequence[BlockKey],
                       parent: BlockKey | None, start_depth: int) -> Op:
        req = self._target("put_prepare", ns, keys)
        if parent is not None or start_depth:
            req["parent"], req["depth"] = parent, start_depth
        reply = yield from self._ask(ns, req)
        assert self.arena is not None
        nbytes = ns.layout.block_bytes
        lease = lease_of(reply)   # (found by review: a missing lease was a KeyError)
        try:
            offsets = slot_offsets(reply.get("offsets"), len(keys), nbytes, self.arena.size,
                                   exact=True)
        except ProtocolError:   # nothing is written: the lease goes back at once
            yield from quietly(self.op_abort(lease))
            raise
        views = [None if off is None else self.arena.view(off, nbytes, writable=True)
                 for off in offsets]
        return lease, views

    @staticmethod
    @reads_reply
    def op_commit(lease: int, durable: bool, output_tokens: int | None,
                  n_keys: int | None = None) -> Op:
        """Commit a put lease of ``n_keys`` keys (None: unknown); how many were stored, an
        int in 0..n_keys (a count beyond was believed; found by review)."""
        reply = yield {"op": "put_commit", "lease": lease, "durable": durable,
                       "output_tokens": output_tokens}
        return count_of(reply, "stored", n_keys)

    @staticmethod
    @reads_reply
    def op_commit_sync(lease: int, durable: bool, output_tokens: int | None,
                       redis_sync_s: float, n_keys: int | None = None) -> Op:
        """A commit answered once the put's chain is in Redis (or ``redis_sync_s`` passed):
        (stored, leading blocks confirmed in Redis, whether that is the whole chain, the
        daemon's reason when not: "off" without a Redis tier, "" from a daemon that gives
        none), the counts checked as ``op_commit``'s."""
        reply = yield {"op": "put_commit", "lease": lease, "durable": durable,
                       "output_tokens": output_tokens, "redis_sync_s": redis_sync_s}
        synced = reply.get("redis_synced", False)
        if type(synced) is not bool:
            raise ProtocolError(f"daemon sent redis_synced={synced!r:.40}")
        reason = reply.get("redis_sync_reason", "")
        if type(reason) is not str or len(reason) > 32:
            raise ProtocolError(f"daemon sent redis_sync_reason={reason!r:.40}")
        return (count_of(reply, "stored", n_keys),
                count_of(reply, "redis_visible", n_keys, default=0), synced, reason)

    def op_abort(self, lease: int) -> Op:
        yield {"op": "put_abort", "lease": lease}

    @reads_reply
    def op_prepare_get(self, ns: Namespace, keys: Sequence[BlockKey],
                       prefer_device: bool | None = None) -> Op:
        mapping = self._device_mapping(prefer_device)
        req = self._target("get_prepare", ns, keys)
        if mapping is not None:
            req["device"] = True
        asked = time.monotonic()
        reply = yield from self._ask(ns, req)
        assert self.arena is not None
        nbytes = ns.layout.block_bytes
        lease = lease_of(reply)   # (found by review: a missing lease was a KeyError)
        try:   # checked before any view: a reply naming wrong slots is a ProtocolError
            offsets, devices = get_slots(reply, len(keys), nbytes, self.arena.size,
                                         None if mapping is None else mapping.size)
            views = [self.arena.view(off, nbytes, writable=False) if dev == "cpu"
                     else mapping.view(off, nbytes)
                     for off, dev in zip(offsets, devices, strict=True)]
        except BaseException:
            yield from quietly(self.op_release(lease))
            raise
        return lease, views, devices, release_safe_until(asked, reply.get("ttl_s"))

    @staticmethod
    def op_release(lease: int, copy_s: float | None = None,
                   safe_until: float | None = None) -> Op:
        """End a get lease. Before ``safe_until`` (``time.monotonic()``, see
        ``RELEASE_SAFE_SHARE``) what was read is known valid here, so the release is sent
        without waiting for its reply (a round trip off every load); after it, or without
        it, the release waits and its ``LeaseExpired`` reaches the caller."""
        req: dict[str, Any] = {"op": "get_release", "lease": lease}
        if copy_s is not None:
            req["copy_s"] = float(copy_s)
        if safe_until is not None and time.monotonic() < safe_until:
            yield NoWait(req)
            return
        yield req

    def op_put(self, ns: Namespace, keys: Sequence[BlockKey], buffers: Sequence[Any],
               durable: bool, output_tokens: int | None) -> Op:
        """Store blocks in bounded batches (never pin the whole arena): prepare, one memcpy
        per block into the arena, commit. A failed copy aborts its lease and its error
        propagates; a commit past the TTL raises ``LeaseExpired`` (that batch stored
        nothing). Returns how many blocks were stored. A chain longer than the daemon takes
        in one context is refused whole (``LimitExceeded``) before any batch is stored,
        as lookup, get and delete refuse it."""
        check_buffers(ns, keys, buffers)
        yield from self._ensure(ns)
        limit = self._max_keys.get(ns.digest)
        if limit is not None and len(keys) > limit:
            raise LimitExceeded(
                f"{len(keys)} blocks in one put; the daemon takes at most {limit} of this "
                f"namespace in one context (daemon.max_context_tokens): nothing was stored")
        stored = 0
        for i in range(0, len(keys), PUT_BATCH):
            lease, views = yield from self.op_prepare_put(
                ns, keys[i: i + PUT_BATCH], keys[i - 1] if i else None, i)
            try:
                for view, buf in zip(views, buffers[i: i + PUT_BATCH], strict=True):
                    if view is not None:
                        np.copyto(view, as_bytes(buf))
            except BaseException:
                yield from quietly(self.op_abort(lease))
                raise
            last = i + PUT_BATCH >= len(keys)
            stored += yield from self.op_commit(lease, durable,
                                                output_tokens if last else None, len(views))
        return stored

    def op_get(self, ns: Namespace, keys: Sequence[BlockKey],
               out_buffers: Sequence[Any]) -> Op:
        """Copy the leading available blocks into host ``out_buffers`` through cpu views;
        returns how many. The release that follows the copy raises ``LeaseExpired`` when
        the copy outlived the TTL (the bytes may be another block's); a failed copy
        releases quietly and its error propagates."""
        check_buffers(ns, keys, out_buffers, writable=True)
        lease, views, _, safe_until = yield from self.op_prepare_get(ns, keys,
                                                                     prefer_device=False)
        try:
            for view, out in zip(views, out_buffers, strict=False):
                np.copyto(as_bytes(out), view)
        except BaseException:
            yield from quietly(self.op_release(lease))
            raise
        yield from self.op_release(lease, safe_until=safe_until)
        return len(views)

    @reads_reply
    def op_delete(self, ns: Namespace, keys: Sequence[BlockKey]) -> Op:
        """Delete ``keys``; how many went. The releases this connection sent ``NoWait``
        (a ``get`` that just returned) are settled first: the daemon runs requests side by
        side, and would skip blocks still pinned by the caller's own finished get."""
        yield SETTLE
        reply = yield from self._ask(ns, self._target("delete", ns, keys))
        return count_of(reply, "deleted", len(keys))   # (found by review: was int())

    @staticmethod
    @reads_reply
    def op_prefix(ns: Namespace, prompts: Sequence[Sequence[int] | np.ndarray], redis: bool,
                  batch: bool) -> Op:
        """Prefix locality (kvtier.prefix). Keys are hashed here, so the daemon only walks
        them; the namespace is spelled out, so nothing is registered for a probe."""
        chains = [block_keys(ns, p) for p in prompts]
        req: dict[str, Any] = {
            "op": "prefix_locality", "model_id": ns.model_id, "layout": ns.layout.to_dict(),
            "tp_rank": ns.tp_rank, "tp_size": ns.tp_size, "cache_salt": ns.cache_salt,
            "keys": b"".join(k for chain in chains for k in chain), "redis": redis}
        if batch:
            req["lengths"] = [len(chain) for chain in chains]
        reply = yield req
        return prefix_results(reply, len(prompts))   # (found by review: was unchecked)

    @reads_reply
    def op_stats(self) -> Op:
        reply = yield {"op": "stats"}
        return stats_of(reply)

    def op_report(self, values: dict[str, float], engine_id: str | None = None) -> Op:
        yield {"op": "report_engine", **values,
               **({"engine_id": engine_id} if engine_id else {})}

    @staticmethod
    def check_reply(reply: dict[str, Any]) -> dict[str, Any]:
        if not reply.get("ok"):
            raise error_from_code(str(reply.get("code", "internal")),
                                  str(reply.get("error", "daemon reported an error")))
        return reply

    @staticmethod
    def hello() -> dict[str, Any]:
        """The first request (kvtier.handshake.hello_request)."""
        return hello_request()

    def on_hello(self, reply: dict[str, Any], arena_fd: int | None = None,
                 daemon_uid: int | None = None, presence_fd: int | None = None) -> None:
        """Take what the hello announced (kvtier.client.hello.mapped)."""
        m = mapped(reply, arena_fd, daemon_uid, presence_fd)
        self.arena, self.presence, self.arena_path, self.hbm_info = (
            m.arena, m.presence, m.arena_path, m.hbm_info)
        announced = reply["arena"].get("put_bytes")   # (daemons from before: absent)
        self.put_bytes = (min(announced, m.arena.size)   # (found by review: 2**63-1 was
                          if type(announced) is int and announced > 0 else 0)   # believed)

