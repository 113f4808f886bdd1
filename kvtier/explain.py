"""Why did this request miss? A bounded ring of recent lookups and of recent removals.

The store calls two hooks: :meth:`MissLog.removed` from its drop paths (a block leaving a
tier, with the reason) and :meth:`MissLog.lookup` once per lookup. A lookup costs one
tuple appended to a ``deque`` plus, when it missed, one dict probe for the first missing
key; everything readable (dicts, namespace names, hints) is built only when someone asks
(``/v1/lookups/recent``, ``kvtier explain``). Both records are bounded, so memory stays
flat however long the daemon runs: ``ring`` lookups (default 512) and ``removals`` keys
(default 16,384, about 4 MiB).

The first miss of a lookup gets one reason (:class:`MissReason`): the key was never
stored (or aged out of the removal record), evicted (by which tier's policy, when),
refused by admission on its way down (e.g. the nvme write budget), dropped after a failed
checksum, deleted, orphaned (its parent left every tier), its put never committed (lease
expired or the client left), the tier that may hold it is down, still being written, or
the lookup named a namespace/layout the daemon does not know (or the block is stored
under another namespace than the lookup's).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Container
from dataclasses import dataclass
from enum import Enum
from typing import Any

BlockKey = bytes


class MissReason(str, Enum):
    """Why the first missing block of a lookup was not found (stable strings: metrics)."""

    NONE = "none"                        # every block asked was found
    NEVER_STORED = "never_stored"        # no record of this key (or it aged out)
    EVICTED = "evicted"                  # a tier's eviction policy chose it
    ADMISSION = "dropped_by_admission"   # evicted above, refused by the tier below
    CHECKSUM = "checksum_failure"        # a frame failed its check and was dropped
    DELETED = "deleted"                  # a client deleted it
    ORPHAN = "orphaned"                  # its parent left every tier
    LEASE = "lease_lost"                 # the put's lease expired / client left uncommitted
    TIER_DOWN = "tier_down"              # a lower tier that may hold it is unreachable
    IN_FLIGHT = "in_flight"              # being written right now (not committed yet)
    NAMESPACE = "namespace_mismatch"     # unknown namespace or layout fingerprint, or the
    #                                      block is stored under another namespace


# The hot path keeps plain strings (the enum's values): hashing and comparing them is
# cheaper than an Enum member's Python-level __hash__.
_NONE, _NEVER_STORED = MissReason.NONE.value, MissReason.NEVER_STORED.value
_IN_FLIGHT, _TIER_DOWN = MissReason.IN_FLIGHT.value, MissReason.TIER_DOWN.value
_NAMESPACE = MissReason.NAMESPACE.value
_EVICTED, _ADMISSION = MissReason.EVICTED.value, MissReason.ADMISSION.value
_FROM_EVICTION = {
    "capacity": _EVICTED, "expired": _EVICTED, "deleted": MissReason.DELETED.value,
    "corrupt": MissReason.CHECKSUM.value, "orphan": MissReason.ORPHAN.value,
    "lease": MissReason.LEASE.value,
}
_BY_POLICY = (_EVICTED, _ADMISSION)   # reasons an eviction policy chose


@dataclass(slots=True, frozen=True)
class Removal:
    """The last time a key left a tier."""

    reason: str          # a MissReason value
    tier: str
    policy: str
    at: float            # wall clock (time.time())


def _owner(index: Container[BlockKey], key: BlockKey) -> bytes | None:
    """The namespace digest ``key`` is stored under, when ``index`` tells it (the store's
    Index maps a key to its BlockMeta; a plain set of keys does not): a key held for
    another namespace is no write in flight for this one. Read on a miss only."""
    get = getattr(index, "get", None)
    namespace = getattr(get(key), "namespace", None) if callable(get) else None
    return namespace if isinstance(namespace, bytes) else None


# (wall time, namespace digest, blocks asked, cpu hits, cpu+nvme hits, all hits, reason,
#  removal or None, error code) -- a tuple, not an object: the hot path appends one.
_Row = tuple[float, bytes, int, int, int, int, str, Removal | None, str]


class MissLog:
    """Recent lookups with the reason of their first miss; bounded in both records."""

    def __init__(self, *, ring: int = 512, removals: int = 16384,
                 policies: dict[str, str] | None = None, redis_tier: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        """``policies``: the eviction policy's name per tier; ``redis_tier``: blocks leaving
        nvme are handed to redis (a later miss there means redis dropped them)."""
        if ring < 1 or removals < 1:
            raise ValueError("the lookup ring and the removal record need a size >= 1")
        self._ring: deque[_Row] = deque(maxlen=ring)
        self._append = self._ring.append
        self._removals: OrderedDict[BlockKey, Removal] = OrderedDict()
        self._max_removals = removals
        self._refused: OrderedDict[BlockKey, str] = OrderedDict()
        self.policies = dict(policies or {})
        self.redis_tier = redis_tier
        self.clock = clock
        self._first_miss: dict[str, int] = {r.value: 0 for r in MissReason}

    # -- hooks (hot path) ----------------------------------------------------------------
    def removed(self, key: BlockKey, reason: str, tier: str) -> None:
        """A block left ``tier`` for ``reason`` (an EvictionReason value or "lease")."""
        why = _FROM_EVICTION.get(reason, _EVICTED)
        if why == _EVICTED and self._refused.pop(key, None) is not None:
            why = _ADMISSION
        rec = self._removals
        policy = self.policies.get(tier, "") if why in _BY_POLICY else ""
        rec[key] = Removal(why, tier, policy, self.clock())
        rec.move_to_end(key)
        if len(rec) > self._max_removals:
            rec.popitem(last=False)

    def refused(self, key: BlockKey, tier: str) -> None:
        """Admission refused ``key`` for ``tier``: its next eviction above is final."""
        self._refused[key] = tier
        if len(self._refused) > 1024:
            self._refused.popitem(last=False)

    def lookup(self, digest: bytes, keys: list[BlockKey], hits: int, n_cpu: int,
               n_local: int, index: Container[BlockKey], lower_tier_down: bool) -> None:
        """Record one lookup: ``hits`` leading blocks found, ``n_cpu`` of them in cpu and
        ``n_local`` in cpu or nvme (the rest in redis). Kept to a few operations: it runs
        on every lookup."""
        n = len(keys)
        if hits >= n:
            self._append((self.clock(), digest, n, n_cpu, n_local, hits, _NONE, None, ""))
            self._first_miss[_NONE] += 1
            return
        removal: Removal | None = None
        if keys[hits] in index:
            owner = _owner(index, keys[hits])
            reason = _NAMESPACE if owner is not None and owner != digest else _IN_FLIGHT
        else:
            removal = self._removals.get(keys[hits])
            if removal is not None:
                reason = removal.reason
            else:
                reason = _TIER_DOWN if lower_tier_down else _NEVER_STORED
        self._append((self.clock(), digest, n, n_cpu, n_local, hits, reason, removal, ""))
        self._first_miss[reason] += 1

    def rejected(self, digest: bytes, n_keys: int, code: str) -> None:
        """A lookup failed before any tier was asked (unknown namespace, layout)."""
        self._append((self.clock(), digest, n_keys, 0, 0, 0, MissReason.NAMESPACE.value, None,
                      code))
        self._first_miss[MissReason.NAMESPACE.value] += 1

    # -- readers (off the hot path) ------------------------------------------------------
    def __len__(self) -> int:
        return len(self._ring)

    def removal(self, key: BlockKey) -> Removal | None:
        return self._removals.get(key)

    def recent(self, limit: int = 50, *, misses_only: bool = False,
               namespaces: dict[bytes, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The newest ``limit`` lookups, newest first, as JSON-ready dicts.

        ``namespaces`` maps a digest to what is known about it (model_id, salt_id,
        tp_rank): it names the namespace and backs the never-stored hint. A tenant's
        cache_salt itself is never shown (the endpoint has no auth): only ``salt_id``, a
        short hash that tells tenants apart. Nor is the digest: ``namespace`` is
        :func:`namespace_id`, which tells namespaces apart but names none in a request;
        both ids are keyed per process, so neither lets a salt be tested offline.
        """
        names = namespaces or {}
        per_model: dict[Any, int] = {}   # namespaces per model (the hint's siblings), once
        for v in names.values():
            per_model[v.get("model_id")] = per_model.get(v.get("model_id"), 0) + 1
        out: list[dict[str, Any]] = []
        for row in reversed(self._ring):
            if len(out) >= limit:
                break
            at, digest, n, cpu, n_local, hits, value, removal, code = row
            nvme, redis = n_local - cpu, hits - n_local
            reason = MissReason(value)
            if misses_only and reason is MissReason.NONE:
                continue
            ns = names.get(digest, {})
            item: dict[str, Any] = {
                "at": round(at, 3), "namespace": namespace_id(digest),
                "model_id": ns.get("model_id"),
                "salt_id": ns.get("salt_id"), "tp_rank": ns.get("tp_rank"), "blocks": n,
                "hits": {"cpu": cpu, "nvme": nvme, "redis": redis},
                "hit_blocks": cpu + nvme + redis,
                "first_miss": None if reason is MissReason.NONE else cpu + nvme + redis,
                "reason": reason.value,
            }
            if removal is not None:
                item["removed"] = {"tier": removal.tier, "policy": removal.policy,
                                   "at": round(removal.at, 3),
                                   "age_s": round(max(at - removal.at, 0.0), 3)}
            if code:
                item["error"] = code
            hint = _hint(reason, ns, per_model)
            if reason is MissReason.NAMESPACE and not code:   # not a refused lookup
                hint = ("the block is stored under another namespace (another model, "
                        "cache_salt, tp rank or layout): keys of one never match another")
            if self.redis_tier and removal is not None and removal.tier == "nvme" \
                    and reason is MissReason.EVICTED:
                hint = ("evicted from nvme and handed to redis (when it was up), which no "
                        "longer has it: its TTL or maxmemory dropped it")
            if hint:
                item["hint"] = hint
            out.append(item)
        return out

    def stats(self) -> dict[str, Any]:
        """The /v1/stats section: first-miss reason counts and the records' fill."""
        return {"first_miss": dict(self._first_miss), "ring": len(self._ring),
                "ring_size": self._ring.maxlen, "removals": len(self._removals)}


_SALT_ID_KEY = secrets.token_bytes(16)
_NAMESPACE_ID_KEY = secrets.token_bytes(16)


def namespace_id(digest: bytes) -> str:
    """A public id of a namespace (16 hex digits), stable for this process's life: what
    operators read, never the digest, which a client could otherwise name. Keyed with a
    secret of the process (blake2b), as ``salt_id`` is: an unkeyed hash of the digest let
    anyone test cache_salt guesses offline (model id, layout and tp are guessable)."""
    return hashlib.blake2b(digest, key=_NAMESPACE_ID_KEY, digest_size=8).hexdigest()


def salt_id(cache_salt: str | None) -> str | None:
    """A short id of a tenant's cache_salt, stable for this process's life: keyed with a
    secret of the process (blake2b), so that a salt cannot be guessed offline from it."""
    if cache_salt is None:
        return None
    return hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), key=_SALT_ID_KEY,
                           digest_size=4).hexdigest()


def _hint(reason: MissReason, ns: dict[str, Any], per_model: dict[Any, int]) -> str:
    """One line on what to look at next (built only when the ring is read; ``per_model``:
    registered namespaces per model id, counted once per read)."""
    if reason is MissReason.NEVER_STORED and ns:
        siblings = per_model.get(ns.get("model_id"), 1) - 1
        if siblings > 0:
            return (f"{siblings} other namespace(s) of model {ns.get('model_id')!r} are "
                    "registered (different cache_salt, tp rank or layout): keys of one never "
                    "match another")
        return "first time this prefix was asked for (or it aged out of the removal record)"
    return {
        MissReason.EVICTED: "the tier was full: enlarge it (kvtier plan) or check the policy",
        MissReason.ADMISSION: "refused by the tier below (nvme write budget or admission "
                              "policy): raise nvme.write_budget_bytes_per_s if flash allows",
        MissReason.CHECKSUM: "a stored frame was corrupt and dropped: check the disk / redis",
        MissReason.LEASE: "the put was never committed: its lease expired or the client left",
        MissReason.TIER_DOWN: "a lower tier is unreachable: see kvtier_tier_up",
        MissReason.NAMESPACE: "register_layout first; the daemon may have restarted",
        MissReason.ORPHAN: "its parent block left every tier, so the prefix cannot reach it",
    }.get(reason, "")
