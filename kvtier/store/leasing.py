"""Leases on arena slots: puts write-lock, gets read-lock, and every lease expires.

A crashed or stalled client never pins arena memory: get leases past their deadline are
released; put leases' slots are quarantined until the owner's connection closes (it may
still be writing into them), or its process exits when the daemon closed the connection,
see ``kvtier.leases``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.bandwidth import BandwidthTracker
from kvtier.errors import LeaseExpired
from kvtier.index import BlockMeta, SlotState
from kvtier.leases import Lease, LeaseKind, LeaseTable, Quarantine, expired_error
from kvtier.store.blocks import Blocks
from kvtier.store.cpu import CpuResidency
from kvtier.store.hbm import HbmPlacement
from kvtier.store.ports import MissLogPort
from kvtier.store.slices import Turn, slices
from kvtier.store.stats import RequestCounters

__all__ = ["LeaseKeeper"]


RELEASE_PIECE = 512   # blocks unpinned between two looks at the turn (kvtier.store.slices)


@dataclass(slots=True, eq=False)
class LeaseKeeper:
    leases: LeaseTable
    quarantine: Quarantine
    blocks: Blocks
    cpu: CpuResidency
    requests: RequestCounters
    clock: Callable[[], float]
    bandwidth: BandwidthTracker
    hbm: HbmPlacement | None = None
    explain: MissLogPort | None = None

    def open(self, kind: LeaseKind, owner: int, metas: list[BlockMeta]) -> Lease:
        return self.leases.open(kind, owner, metas)

    def take(self, owner: int, lease_id: int, kind: LeaseKind) -> Lease:
        """The lease a commit/abort/release names; ``LeaseExpired`` once past its deadline,
        whether or not the sweeper has reached it yet (the outcome never depends on it).

        A late commit or abort of a put is its owner saying it stopped writing into the
        lease's slots (a client sends either only after its copy): they go back to the
        allocator then, instead of staying quarantined until the connection closes."""
        try:
            lease = self.leases.take(owner, lease_id, kind)
        except LeaseExpired:
            if kind is LeaseKind.PUT:   # swept already: its slots are quarantined
                for off in self.quarantine.take_lease(owner, lease_id):
                    self.cpu.arena.free(off)
            raise
        if lease.deadline <= self.clock():
            if kind is LeaseKind.PUT:
                self.abort_put(lease)
            else:
                self.release_get(lease)
            self.requests.lease_expired += 1
            raise expired_error(kind, lease_id, self.leases.ttl_s)
        return lease

    def expire(self) -> int:
        """Take back leases past their deadline: get leases are released, put leases'
        slots are quarantined."""
        expired = self.leases.take_expired()
        for lease in expired:
            self._expire(lease)
        self.requests.lease_expired += len(expired)
        return len(expired)

    def release_owner(self, owner: int, *, may_write: bool = False) -> int:
        """A client connection closed: release its reads; abort its puts and free its
        quarantined slots, it can no longer write into them. ``may_write``: the daemon
        closed it, so the client may still be writing: its puts' slots join its quarantine
        instead, kept until ``free_quarantine`` (its process exited)."""
        mine = self.leases.take_owner(owner)
        for lease in mine:
            self.bandwidth.get_abandoned(lease.id)
            if lease.kind is LeaseKind.GET:
                self.release_get(lease)
            elif may_write:
                self._quarantine_put(lease)
            else:
                self.abort_put(lease)
        if not may_write:
            self.free_quarantine(owner)
        return len(mine)

    def free_quarantine(self, owner: int) -> int:
        """Return ``owner``'s quarantined slots to the allocator; how many."""
        offsets = self.quarantine.take_owner(owner)
        for off in offsets:
            self.cpu.arena.free(off)
        return len(offsets)

    def held_put_bytes(self, owner: int) -> int:
        """Arena bytes ``owner`` holds for writing: open put leases and quarantine."""
        return self.leases.put_bytes(owner) + self.quarantine.owner_bytes(owner)

    def held_get_bytes(self, owner: int) -> int:
        """Bytes of the blocks ``owner``'s open get leases pin."""
        return self.leases.get_bytes(owner)

    def abort_put(self, lease: Lease) -> None:
        for meta in lease.metas:
            if meta.cpu_state is SlotState.WRITING and self.blocks.index.get(meta.key) is meta:
                self.cpu.drop(meta)
                if self.explain is not None:
                    self.explain.removed(meta.key, "lease", "cpu")
                self.blocks.forget_if_gone(meta)

    def release_get(self, lease: Lease) -> None:
        self._release_hbm(lease)
        self.cpu.unpin(lease.metas)

    async def release_get_in_turns(self, lease: Lease) -> None:
        """``release_get`` of a client's release (taken off the table already), its blocks
        unpinned a piece at a time (kvtier.store.slices): still pinned during a pause."""
        self._release_hbm(lease)
        turn = Turn()
        for part in reversed(list(slices(lease.metas, RELEASE_PIECE))):   # tail first
            if turn.over():
                await turn.pause()
            self.cpu.unpin(list(part))

    def _release_hbm(self, lease: Lease) -> None:
        if lease.hbm and self.hbm is not None:
            self.hbm.release(lease.hbm)
            lease.hbm = []

    def _expire(self, lease: Lease) -> None:
        if lease.kind is LeaseKind.PUT:
            self._quarantine_put(lease)
        else:
            self.release_get(lease)

    def _quarantine_put(self, lease: Lease) -> None:
        """Forget a put's blocks but keep their slots allocated (quarantined) until its
        owner can no longer write into them."""
        for meta in lease.metas:
            if meta.cpu_state is not SlotState.WRITING or meta.cpu is None:
                continue
            self.quarantine.add(lease.owner, lease.id, meta.cpu,
                                self.cpu.arena.slots.slot_size(meta.cpu))
            meta.cpu = None
            meta.set_cpu_state(SlotState.NONE)
            self.blocks.forget_if_gone(meta)
