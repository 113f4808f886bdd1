"""What prepares still running will hold, per client process, for the per-process caps.

A prepare checks its process's share (``client_put_share``, ``client_get_share``,
``max_leases_per_client``) and then awaits the store, which opens the lease only at its
end (after evicting, promoting, taking turns). The store's counts see only leases
already open, so prepares pipelined on one connection (or sent on several) all saw the
whole share: one process held every slot of a full arena in open puts, pinned all of it in
gets, and opened four times its lease cap (found by review). A prepare therefore reserves
what it may take before its first ``await`` and gives the reservation back once its lease
is open (counted by the store from then on) or it failed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(slots=True)
class Reserved:
    """One process's running prepares: the arena bytes they may take and their leases."""

    put_bytes: int = 0
    get_bytes: int = 0
    leases: int = 0


class InFlight:
    """Reservations of the prepares in flight, by client process."""

    def __init__(self) -> None:
        self._by_process: dict[int, Reserved] = {}

    def of(self, process: int) -> Reserved:
        """What ``process``'s running prepares reserved (a copy: zeros when none)."""
        r = self._by_process.get(process)
        return Reserved() if r is None else Reserved(r.put_bytes, r.get_bytes, r.leases)

    @contextmanager
    def reserve(self, process: int, *, put_bytes: int = 0,
                get_bytes: int = 0) -> Iterator[None]:
        """Hold one lease and these bytes against ``process`` for the block's length."""
        r = self._by_process.setdefault(process, Reserved())
        r.put_bytes += put_bytes
        r.get_bytes += get_bytes
        r.leases += 1
        try:
            yield
        finally:
            r.put_bytes -= put_bytes
            r.get_bytes -= get_bytes
            r.leases -= 1
            if r.leases == 0:
                del self._by_process[process]
