"""The small interfaces every kvtier policy implements, and the registry that builds them.

Policies are pure decision code, shared verbatim by the daemon's store and by
``kvtier replay``: no I/O, no threads, no wall clock of their own. Time always arrives as
an argument (``now``, seconds on any monotonic scale), so a test or the simulator can
drive them with a fake clock.

Three concerns, three interfaces (after CacheLib's Navy):

- :class:`EvictionPolicy`: which resident block of one tier leaves next. The store keeps
  one instance per tier and tells it about every insert, use, pin and removal.
- :class:`AdmissionPolicy`: whether a block may enter a tier at all (write budgets,
  second-hit admission).
- :class:`LookupObserver`: workload signals that are not tied to one tier (which blocks a
  request asked for, how deep its prefix matched) and, optionally
  (:class:`StoreObserver`), what a request was like when its KV is stored (how many tokens
  it generated). The ``cost`` policy reads them.

Keys are opaque :class:`~collections.abc.Hashable` values: 16-byte ``bytes`` in the
daemon, ints in the replay simulator.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

from kvtier.errors import ConfigError

Key = Hashable
"""A block key: ``bytes`` (BlockKey digest) in the daemon, ``int`` in replay."""

Clock = Callable[[], float]
"""A monotonic clock in seconds; injected wherever a component needs 'now'."""


class FakeClock:
    """A clock that only moves when told to: deterministic tests and simulation.

    Calling the instance returns the current time, like ``time.monotonic``.
    """

    __slots__ = ("_now",)

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds`` (never backward) and return the new time."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go backward (advance by {seconds})")
        self._now += seconds
        return self._now

    def set(self, now: float) -> None:
        """Jump to ``now``, which must not lie before the current time."""
        if now < self._now:
            raise ValueError(f"a clock cannot go backward ({now} < {self._now})")
        self._now = float(now)


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders the resident blocks of ONE tier for eviction.

    The store is the sole owner of residency; the policy only mirrors it. Contract:

    - ``insert`` is called once when a block becomes resident in the tier (``parent`` is
      the previous key of its prefix chain, ``None`` for the first chunk; ``depth`` is its
      0-based chunk index in the chain; ``block_tokens`` the tokens per block of its
      namespace's layout, 0 when unknown: with ``depth`` it gives the block's token
      position, which prices its recompute). Inserting a key already present is a ``touch``.
    - ``touch`` is called on every use of a resident block (a hit, a get, a re-put).
    - ``remove`` is called when the block leaves the tier for any reason (evicted,
      demoted, deleted, expired). Removing an absent key is a no-op.
    - ``victim`` names the next block to evict, or ``None`` when every resident block is
      pinned. It does NOT remove it: the store acts (demote or drop), then calls
      ``remove``. Calling ``victim`` twice without a change returns the same key.
    - ``set_pinned(key, True)`` hides a block from ``victim`` while it is under a read or
      write lease; pins are not counted (the store aggregates leases into one flag).

    Every call is O(1) or O(log n) amortised.
    """

    name: str

    def insert(
        self, key: Key, *, nbytes: int, parent: Key | None, depth: int, now: float,
        block_tokens: int = 0,
    ) -> None: ...

    def touch(self, key: Key, *, now: float) -> None: ...

    def remove(self, key: Key) -> None: ...

    def victim(self) -> Key | None: ...

    def set_pinned(self, key: Key, pinned: bool) -> None: ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...


@runtime_checkable
class AdmissionPolicy(Protocol):
    """Decides whether a block may be written into ``tier`` (e.g. "cpu", "nvme").

    Returning ``False`` is the normal way to say "not worth the write"; the store then
    drops the block (or keeps it only where it already is). An admission policy may keep
    state (budgets, a ghost list of recent keys); ``admit`` is O(1).
    """

    def admit(self, key: Key, *, tier: str, nbytes: int, now: float) -> bool: ...


@runtime_checkable
class LookupObserver(Protocol):
    """Receives the workload signals the store sees at lookup time.

    ``keys`` is the full prefix chain a request asked about (every full chunk of its
    prompt, hit or not) and ``hit_blocks`` how many leading keys were found in some tier.
    Called once per lookup, before the blocks are touched or inserted.
    """

    def on_lookup(self, keys: Sequence[Key], hit_blocks: int, *, now: float) -> None: ...


@runtime_checkable
class StoreObserver(Protocol):
    """The optional second method of a :class:`LookupObserver`: request features at store.

    ``on_stored`` is called once per request, after it ran and BEFORE the store inserts or
    touches its blocks, with the request's whole prefix chain (every full chunk of its
    prompt, in order, cached or not) and ``output_tokens``, the tokens it generated when
    the caller knows them (the vLLM connector does at ``request_finished``), else
    ``None``. A store calls it when its observer has it (``getattr(observer,
    "on_stored", None)``), so an observer with only ``on_lookup`` keeps working.
    """

    def on_stored(
        self, keys: Sequence[Key], *, output_tokens: int | None, now: float
    ) -> None: ...


@runtime_checkable
class SlicedStoreObserver(Protocol):
    """A :class:`StoreObserver` whose store report can be made a piece at a time, so that
    a store serving other clients between the pieces keeps the order: first every lookup
    it had queued before the store (``replay_until(queued_through())`` until True), then
    ``on_stored_range`` over consecutive slices of the chain."""

    def queued_through(self) -> int: ...

    def replay_until(self, mark: int) -> bool: ...

    def on_stored_range(self, keys: Sequence[Key], *, output_tokens: int | None,
                        now: float, start: int, stop: int) -> None: ...


# --------------------------------------------------------------------------- registry

EvictionFactory = Callable[..., EvictionPolicy]

_EVICTION: dict[str, EvictionFactory] = {}


def touch_chain(policy: EvictionPolicy, keys: Sequence[Key], now: float) -> None:
    """Touch a chain's resident ``keys`` (head first in ``keys``) tail first, so the head is
    touched last: a recency or frequency policy then holds a parent at least as recent as
    its children and shortens a chain from its tail (touched head first, the head was the
    least recent block of its chain, and evicting it lost the whole chain: its
    descendants are unreachable without it)."""
    for key in reversed(keys):
        policy.touch(key, now=now)


def register_eviction_policy(name: str) -> Callable[[EvictionFactory], EvictionFactory]:
    """Class decorator: make ``make_eviction_policy(name)`` build this policy."""

    def deco(factory: EvictionFactory) -> EvictionFactory:
        if name in _EVICTION:
            raise ValueError(f"eviction policy {name!r} registered twice")
        _EVICTION[name] = factory
        return factory

    return deco


def eviction_policy_names() -> list[str]:
    """Names ``make_eviction_policy`` accepts, sorted."""
    return sorted(_EVICTION)


def make_eviction_policy(name: str, **kwargs: Any) -> EvictionPolicy:
    """Build the eviction policy registered as ``name`` ("lru", "lfu", "cost").

    ``kwargs`` go to the policy's constructor (for ``cost``: ``tier``, ``costs``, ``stats``).
    An unknown name is a :class:`~kvtier.errors.ConfigError` that lists the known ones.
    """
    try:
        factory = _EVICTION[name]
    except KeyError:
        known = ", ".join(eviction_policy_names())
        raise ConfigError(f"unknown eviction policy {name!r}; choose one of: {known}") from None
    return factory(**kwargs)
