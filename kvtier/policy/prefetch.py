"""Prefetch wait policies: how long a get waits for blocks still being promoted.

A lookup starts promoting matched blocks from nvme/redis toward the cpu tier at once; the
get that follows decides how long to wait for them (after SGLang's named stop policies):

- ``best_effort``: return the prefix that is ready now; the rest is recomputed.
- ``wait``: wait until every promoted block has landed.
- ``timeout``: wait up to a deadline that grows with the number of blocks, then return
  the ready prefix.

Everything here is pure: times are arguments, so a fake clock drives the tests and the
replay simulator uses the same code and the same ``timeout`` grace as the daemon. Outcome
counts (issued, hit before use, late, wasted, failed) are the store's: a flag on each block
(``BlockMeta.prefetched``) and ``kvtier.store.stats.PrefetchCounters``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

TIMEOUT_BASE_S = 0.05
"""The fixed grace of a ``timeout`` wait before its per-block part (daemon and simulator)."""


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
