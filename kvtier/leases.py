"""Leases: arena (and hbm) slots lent to one client connection, each with a deadline.

A put lease holds write-locked slots until the client commits or aborts; a get lease holds
read-locked slots until it releases them. A lease that outlives its TTL (a hung, stalled or
crashed client) is taken back by the store's sweeper, and every lease of a closed
connection is taken back at once, so no client can pin memory forever.

Expiry must never produce wrong bytes, because the client still maps the slots:
- a get lease's slots go back to the cache; the client learns at release (``LeaseExpired``)
  that what it read may have been overwritten, and the client API discards it;
- a put lease's slots are *quarantined*: out of the index, but not returned to the
  allocator until the owning connection closes, so a slow writer that keeps writing into
  them never touches another client's blocks. Its commit fails with ``LeaseExpired``.
  When the daemon closes the connection itself (idle, not reading its replies, a broken
  limit), that proves nothing about the writer: its slots stay quarantined until its
  process exits (``kvtier.daemon.exits``).
The table remembers which ids expired per connection (bounded), so that a late commit or
release gets ``LeaseExpired`` rather than "unknown lease".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvtier.errors import LeaseError, LeaseExpired
from kvtier.index import BlockMeta

EXPIRED_IDS_PER_OWNER = 4096
"""Expired lease ids remembered per connection (oldest forgotten first); a late commit or
release of a forgotten one gets a plain LeaseError, which the client treats the same way."""


class LeaseKind(str, Enum):
    PUT = "put"
    GET = "get"


@dataclass(slots=True)
class Lease:
    """Slots handed to one client connection, valid until ``deadline``."""

    id: int
    kind: LeaseKind
    owner: int
    metas: list[BlockMeta]
    deadline: float
    chain: list[bytes] = field(default_factory=list)  # a put's whole key chain
    namespace: bytes = b""                             # a put's namespace digest
    hbm: list[Any] = field(default_factory=list)      # hbm read-locks of a device get
    nbytes: int = 0                                    # its slots' bytes (at open)


class LeaseTable(dict[int, Lease]):
    """lease id -> Lease; ids are never reused within a daemon's life."""

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        super().__init__()
        self._ttl_s = ttl_s
        # deadlines rise with ids while the TTL never shrinks: the expired leases are then
        # the table's oldest, and a sweep stops at the first one still valid
        self._in_deadline_order = True
        self.clock = clock
        self._ids = itertools.count(1)
        self._expired: dict[int, dict[int, LeaseKind]] = {}  # owner -> expired ids (ordered)
        self._owned: dict[int, dict[int, None]] = {}         # owner -> its open lease ids
        # kind -> owner -> bytes of its open leases of that kind
        self._bytes: dict[LeaseKind, dict[int, int]] = {kind: {} for kind in LeaseKind}

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    @ttl_s.setter
    def ttl_s(self, value: float) -> None:
        if value < self._ttl_s:
            self._in_deadline_order = False
        self._ttl_s = value

    def open(self, kind: LeaseKind, owner: int, metas: list[BlockMeta]) -> Lease:
        lease = Lease(next(self._ids), kind, owner, metas, self.clock() + self._ttl_s)
        lease.nbytes = sum(meta.nbytes for meta in metas)
        if lease.nbytes:
            held = self._bytes[kind]
            held[owner] = held.get(owner, 0) + lease.nbytes
        self[lease.id] = lease
        self._owned.setdefault(owner, {})[lease.id] = None
        return lease

    def count(self, owner: int) -> int:
        """Leases ``owner`` holds open."""
        return len(self._owned.get(owner, ()))

    def put_bytes(self, owner: int) -> int:
        """Bytes of the put leases ``owner`` holds open."""
        return self._bytes[LeaseKind.PUT].get(owner, 0)

    def get_bytes(self, owner: int) -> int:
        """Bytes of the blocks ``owner``'s open get leases pin."""
        return self._bytes[LeaseKind.GET].get(owner, 0)

    def _forget(self, lease: Lease) -> None:
        del self[lease.id]
        mine = self._owned.get(lease.owner)
        if mine is not None:
            mine.pop(lease.id, None)
            if not mine:
                del self._owned[lease.owner]
        if lease.nbytes:
            held = self._bytes[lease.kind]
            left = held.get(lease.owner, 0) - lease.nbytes
            if left > 0:
                held[lease.owner] = left
            else:
                held.pop(lease.owner, None)

    def take(self, owner: int, lease_id: int, kind: LeaseKind) -> Lease:
        """Remove and return a lease this owner holds.

        ``LeaseExpired`` when the sweeper took it back, ``LeaseError`` for anything else. A
        lease past its deadline that the sweeper has not reached yet is returned: the caller
        decides (the store treats it as expired).
        """
        lease = self.get(lease_id)
        if lease is None or lease.owner != owner or lease.kind is not kind:
            mine = self._expired.get(owner)
            if mine is not None and mine.get(lease_id) is kind:
                del mine[lease_id]
                raise expired_error(kind, lease_id, self.ttl_s)
            raise LeaseError(f"{kind.value} lease {lease_id} was never handed to this "
                             "connection, or was already used or expired")
        self._forget(lease)
        return lease

    def take_expired(self) -> list[Lease]:
        """Leases past their deadline, removed and remembered as expired for their owner."""
        now = self.clock()
        if self._in_deadline_order:
            out = []
            for lease in self.values():   # oldest first
                if lease.deadline > now:
                    break
                out.append(lease)
            for lease in out:
                self._forget(lease)
        else:
            out = self._take_where(lambda lease: lease.deadline <= now)
        for lease in out:
            mine = self._expired.setdefault(lease.owner, {})
            mine[lease.id] = lease.kind
            if len(mine) > EXPIRED_IDS_PER_OWNER:
                del mine[next(iter(mine))]
        return out

    def take_owner(self, owner: int) -> list[Lease]:
        """Every lease of a closed connection (and forget its expired ids)."""
        self._expired.pop(owner, None)
        out = [self[i] for i in self._owned.get(owner, ())]
        for lease in out:
            self._forget(lease)
        return out

    def _take_where(self, pred: Callable[[Lease], bool]) -> list[Lease]:
        out = [lease for lease in self.values() if pred(lease)]
        for lease in out:
            self._forget(lease)
        return out


def expired_error(kind: LeaseKind, lease_id: int, ttl_s: float) -> LeaseExpired:
    """The error a late commit or release gets, saying what it means for the caller."""
    if kind is LeaseKind.GET:
        return LeaseExpired(f"get lease {lease_id} expired (TTL {ttl_s:g} s) before it was "
                            "released: the bytes read under it may belong to another block "
                            "and must be discarded; release leases sooner or raise "
                            "daemon.lease_ttl_s")
    return LeaseExpired(f"put lease {lease_id} expired (TTL {ttl_s:g} s) before commit: "
                        "nothing was stored (its slots were quarantined until this commit or "
                        "abort); commit sooner or raise daemon.lease_ttl_s")


@dataclass(slots=True)
class Quarantine:
    """Arena slots of expired put leases, held until their owner says it stopped writing.

    The owner may still be writing into them (it maps the arena), so they must not go
    back to the allocator while it can. Proof that it stopped: its late commit or abort of
    that lease (a client sends either only once its copy is over), or its connection
    closing. ``bytes``/``slots`` are what the stats report.
    """

    # owner -> lease id -> the lease's (offset, slot bytes)
    by_owner: dict[int, dict[int, list[tuple[int, int]]]] = field(default_factory=dict)
    bytes: int = 0
    slots: int = 0
    total_slots: int = 0   # quarantined since start (a counter)

    def add(self, owner: int, lease_id: int, offset: int, nbytes: int) -> None:
        self.by_owner.setdefault(owner, {}).setdefault(lease_id, []).append((offset, nbytes))
        self.bytes += nbytes
        self.slots += 1
        self.total_slots += 1

    def owner_bytes(self, owner: int) -> int:
        """Bytes held for ``owner``."""
        return sum(n for held in self.by_owner.get(owner, {}).values() for _, n in held)

    def take_owner(self, owner: int) -> list[int]:
        """The offsets held for ``owner`` (now safe to free: it can no longer write)."""
        leases = self.by_owner.pop(owner, {})
        return [off for held in leases.values() for off in self._taken(held)]

    def take_lease(self, owner: int, lease_id: int) -> list[int]:
        """The offsets held for one lease of ``owner`` (safe to free: it said it stopped
        writing into them)."""
        leases = self.by_owner.get(owner)
        held = leases.pop(lease_id, []) if leases is not None else []
        if leases is not None and not leases:
            del self.by_owner[owner]
        return self._taken(held)

    def _taken(self, held: list[tuple[int, int]]) -> list[int]:
        self.bytes -= sum(n for _, n in held)
        self.slots -= len(held)
        return [off for off, _ in held]
