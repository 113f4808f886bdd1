"""Prefetch wait policies: how long a get waits for blocks still being promoted.

A lookup starts promoting matched blocks from nvme/redis toward the cpu tier at once; the
get that follows decides how long to wait for them (after SGLang's named stop policies):

- ``best_effort``: return the prefix that is ready now; the rest is recomputed.
- ``wait``: wait until every promoted block has landed.
- ``timeout``: wait up to a deadline that grows with the number of blocks, then return
  the ready prefix.

Everything here is pure: times are arguments, so a fake clock drives the tests and the
replay simulator uses the same code as the daemon.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum

from kvtier.policy.base import Key


class PrefetchWait(str, Enum):
    """How a get waits for in-flight promotions."""

    BEST_EFFORT = "best_effort"
    WAIT = "wait"
    TIMEOUT = "timeout"


def prefetch_deadline(
    policy: PrefetchWait, n_blocks: int, per_block_s: float, now: float, *, base_s: float = 0.0
) -> float | None:
    """The latest time a get waits for ``n_blocks`` promotions; ``None`` means no limit.

    ``best_effort`` returns ``now`` (do not wait), ``wait`` returns ``None``, and ``timeout``
    returns ``now + base_s + n_blocks * per_block_s``: a long prefix gets a proportionally
    longer grace period, so big reloads are not cut short by a fixed timeout.
    """
    if policy is PrefetchWait.BEST_EFFORT:
        return now
    if policy is PrefetchWait.WAIT:
        return None
    return now + base_s + max(n_blocks, 0) * per_block_s


@dataclass(frozen=True, slots=True)
class WaitOutcome:
    """What a get returns under a wait policy: the usable prefix and when it returns."""

    ready_blocks: int     # leading blocks usable by the engine
    return_at: float      # when the get returns (>= now)
    late_blocks: int      # promoted blocks that missed the deadline


def wait_for_prefix(
    policy: PrefetchWait,
    ready_at: Sequence[float],
    now: float,
    *,
    per_block_s: float,
    base_s: float = 0.0,
) -> WaitOutcome:
    """Resolve a get whose i-th matched block lands at ``ready_at[i]``.

    Only a prefix is useful to an engine, so the usable part ends at the first block not
    ready by the deadline. Blocks already resident have ``ready_at <= now``.
    """
    deadline = prefetch_deadline(policy, len(ready_at), per_block_s, now, base_s=base_s)
    limit = float("inf") if deadline is None else deadline
    ready = 0
    last = now
    for t in ready_at:
        if t > limit:
            break
        ready += 1
        if t > last:
            last = t
    late = len(ready_at) - ready
    if late and deadline is not None:
        last = max(last, deadline)  # it waited the whole grace period in vain
    return WaitOutcome(ready_blocks=ready, return_at=last, late_blocks=late)


@dataclass(slots=True)
class PrefetchCounters:
    """Monotonic prefetch counters (exported as kvtier_prefetch_*_total)."""

    issued: int = 0           # promotions started at lookup time
    hit_before_use: int = 0   # landed before the get that wanted them
    late: int = 0             # still in flight when the get returned
    wasted: int = 0           # landed but never used before leaving the tier

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class PrefetchTracker:
    """Classifies each promotion as hit-before-use, late or wasted.

    ``issued`` when a promotion starts, ``used`` when a get resolves it (``in_time`` from
    :func:`wait_for_prefix`), ``dropped`` when a promoted block leaves the tier; one never
    used is counted as wasted. Not wired in yet: the store keeps the same counts inline
    (``kvtier.store.stats.PrefetchCounters``); giving this class its user is open work.
    """

    __slots__ = ("_pending", "counters")

    def __init__(self) -> None:
        self._pending: set[Key] = set()
        self.counters = PrefetchCounters()

    def issued(self, key: Key) -> None:
        """A promotion of ``key`` has started."""
        if key not in self._pending:
            self._pending.add(key)
            self.counters.issued += 1

    def used(self, key: Key, *, in_time: bool) -> None:
        """A get consumed (``in_time``) or gave up on (late) the promotion of ``key``."""
        if key in self._pending:
            self._pending.discard(key)
            if in_time:
                self.counters.hit_before_use += 1
            else:
                self.counters.late += 1

    def dropped(self, key: Key) -> None:
        """``key`` left the tier; if nobody used its promotion, it was wasted."""
        if key in self._pending:
            self._pending.discard(key)
            self.counters.wasted += 1

    def __len__(self) -> int:
        return len(self._pending)
