"""Leases: arena (and hbm) slots lent to one client connection, each with a deadline.

A put lease holds write-locked slots until the client commits or aborts; a get lease holds
read-locked slots until it releases them. A lease that outlives its TTL (a hung or crashed
client) is taken back by the store's sweeper, and every lease of a closed connection is
taken back at once, so no client can pin memory forever.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvtier.errors import LeaseError
from kvtier.index import BlockMeta


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
    hbm: list[Any] = field(default_factory=list)      # hbm read-locks of a device get


class LeaseTable(dict[int, Lease]):
    """lease id -> Lease; ids are never reused within a daemon's life."""

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        super().__init__()
        self.ttl_s = ttl_s
        self.clock = clock
        self._ids = itertools.count(1)

    def open(self, kind: LeaseKind, owner: int, metas: list[BlockMeta]) -> Lease:
        lease = Lease(next(self._ids), kind, owner, metas, self.clock() + self.ttl_s)
        self[lease.id] = lease
        return lease

    def take(self, owner: int, lease_id: int, kind: LeaseKind) -> Lease:
        """Remove and return a lease this owner holds; LeaseError for anything else."""
        lease = self.get(lease_id)
        if lease is None or lease.owner != owner or lease.kind is not kind:
            raise LeaseError(f"{kind.value} lease {lease_id} was never handed to this "
                             "connection, or was already used or expired")
        del self[lease_id]
        return lease

    def take_expired(self) -> list[Lease]:
        now = self.clock()
        return self._take_where(lambda lease: lease.deadline <= now)

    def take_owner(self, owner: int) -> list[Lease]:
        return self._take_where(lambda lease: lease.owner == owner)

    def _take_where(self, pred: Callable[[Lease], bool]) -> list[Lease]:
        out = [lease for lease in self.values() if pred(lease)]
        for lease in out:
            del self[lease.id]
        return out
