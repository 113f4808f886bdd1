"""Admission policies: may this block be written into that tier?

- :class:`AlwaysAdmit`: every block (the cpu tier's default: it is the staging tier).
- :class:`SecondHitAdmission`: only blocks already seen recently (a ghost list of keys),
  so one-off blocks do not cost an nvme or redis write.
- :class:`WriteBudget`: a token bucket of bytes per second with a burst, protecting flash
  endurance; composes with another policy (both must agree).
- :class:`TierAdmission`: one policy per tier name, for a store with several tiers.

All are O(1) per call and pure: time is an argument.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from kvtier.policy.base import AdmissionPolicy, Key

__all__ = [
    "AdmissionPolicy",
    "AlwaysAdmit",
    "SecondHitAdmission",
    "TierAdmission",
    "WriteBudget",
]


class AlwaysAdmit:
    """Admits everything."""

    __slots__ = ()

    def admit(self, key: Key, *, tier: str, nbytes: int, now: float) -> bool:
        return True


class SecondHitAdmission:
    """Admits a key on its second sighting within the last ``ghost`` distinct keys.

    The first ``admit`` of a key records it in a bounded ghost list and says no; a later
    one says yes. The store may also call :meth:`seen` on lookups, so a block that was
    asked for twice is admitted on its first write.
    """

    __slots__ = ("_ghost", "_size")

    def __init__(self, ghost: int = 65536) -> None:
        if ghost <= 0:
            raise ValueError("ghost list size must be positive")
        self._size = ghost
        self._ghost: OrderedDict[Key, int] = OrderedDict()

    def seen(self, key: Key) -> int:
        """Record a sighting of ``key``; returns how many times it was seen (bounded)."""
        n = self._ghost.get(key, 0) + 1
        self._ghost[key] = n
        self._ghost.move_to_end(key)
        if len(self._ghost) > self._size:
            self._ghost.popitem(last=False)
        return n

    def admit(self, key: Key, *, tier: str, nbytes: int, now: float) -> bool:
        return self.seen(key) >= 2


DEFAULT_BURST_BYTES = 2**26   # a budget's burst when not given: one second, at least 64 MiB


class WriteBudget:
    """A token bucket of ``bytes_per_s`` with ``burst_bytes``; optional inner policy.

    A write is admitted when the inner policy agrees and the bucket holds ``nbytes``, or,
    for a write larger than the whole burst, when the bucket is full: it then runs into
    debt that the refill pays back first, so the long-run rate holds and a block bigger
    than the burst (a 512-token block of a 70B model is 160 MiB) is not refused forever.
    Only admitted writes spend budget. ``now`` must not go backward. ``rejected`` counts
    every refusal; ``refused_bytes`` only those of the budget itself (what the write-budget
    alert reads: the inner policy's refusals are its normal work).
    """

    __slots__ = ("_burst", "_inner", "_level", "_rate", "_t", "refused_bytes", "rejected")

    def __init__(
        self, bytes_per_s: float, burst_bytes: float, *, inner: AdmissionPolicy | None = None
    ) -> None:
        if bytes_per_s < 0 or burst_bytes <= 0:
            raise ValueError("write budget needs bytes_per_s >= 0 and burst_bytes > 0")
        self._rate = float(bytes_per_s)
        self._burst = float(burst_bytes)
        self._level = float(burst_bytes)
        self._t: float | None = None
        self._inner = inner
        self.rejected = 0
        self.refused_bytes = 0

    @classmethod
    def per_second(cls, bytes_per_s: float, *,
                   inner: AdmissionPolicy | None = None) -> WriteBudget:
        """A budget whose burst is one second of it, at least ``DEFAULT_BURST_BYTES``: the
        daemon's (``nvme.write_budget_bytes_per_s``) and ``kvtier replay``'s alike."""
        return cls(bytes_per_s, max(float(bytes_per_s), DEFAULT_BURST_BYTES), inner=inner)

    def admit(self, key: Key, *, tier: str, nbytes: int, now: float) -> bool:
        self._level = self.available_at(now)
        self._t = now if self._t is None else max(self._t, now)
        if self._level < min(nbytes, self._burst):
            self.rejected += 1
            self.refused_bytes += nbytes
            return False
        if self._inner is not None and not self._inner.admit(key, tier=tier, nbytes=nbytes,
                                                             now=now):
            self.rejected += 1
            return False
        self._level -= nbytes
        return True

    def available_at(self, now: float) -> float:
        """Budget it could admit at ``now`` (refilled since the last write; spends nothing;
        below 0 while a write larger than the burst is paid back): what the
        ``available_bytes`` gauge shows (at 0 or more), also on an idle daemon."""
        if self._t is None or now <= self._t:
            return self._level
        return min(self._burst, self._level + (now - self._t) * self._rate)

    @property
    def available_bytes(self) -> float:
        """Budget left at the last call."""
        return self._level


class TierAdmission:
    """Dispatches to one policy per tier name; tiers not listed admit everything."""

    __slots__ = ("_by_tier",)

    def __init__(self, by_tier: Mapping[str, AdmissionPolicy]) -> None:
        self._by_tier = dict(by_tier)

    def admit(self, key: Key, *, tier: str, nbytes: int, now: float) -> bool:
        pol = self._by_tier.get(tier)
        return True if pol is None else pol.admit(key, tier=tier, nbytes=nbytes, now=now)
