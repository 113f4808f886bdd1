"""Pure decision code shared by the store and ``kvtier replay``: eviction, admission, prefetch.

Importing the package registers the built-in eviction policies, so
``make_eviction_policy("lru")`` works after ``import kvtier.policy``.
"""

from __future__ import annotations

from kvtier.policy import adaptive as _adaptive  # noqa: F401  (registers "adaptive")
from kvtier.policy import cost as _cost  # noqa: F401  (registers "cost")
from kvtier.policy import hindsight as _hindsight  # noqa: F401  (registers "hindsight")
from kvtier.policy import lfu as _lfu  # noqa: F401  (registers "lfu")
from kvtier.policy import lru as _lru  # noqa: F401  (registers "lru")
from kvtier.policy.base import (
    AdmissionPolicy,
    Clock,
    EvictionPolicy,
    FakeClock,
    Key,
    LookupObserver,
    StoreObserver,
    eviction_policy_names,
    make_eviction_policy,
    register_eviction_policy,
)
from kvtier.policy.prefetch import (
    TIMEOUT_BASE_S,
    PrefetchWait,
    WaitOutcome,
    prefetch_deadline,
    wait_for_prefix,
)

__all__ = [
    "TIMEOUT_BASE_S",
    "AdmissionPolicy",
    "Clock",
    "EvictionPolicy",
    "FakeClock",
    "Key",
    "LookupObserver",
    "PrefetchWait",
    "StoreObserver",
    "WaitOutcome",
    "eviction_policy_names",
    "make_eviction_policy",
    "prefetch_deadline",
    "register_eviction_policy",
    "wait_for_prefix",
]
