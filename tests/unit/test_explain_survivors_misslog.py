"""MissLog (``kvtier explain``'s record) pinned where a mutation review found it unwatched:
the reason a miss is given, the per-tier hit split, ages, bounds and hints of each row."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.explain import MissLog, MissReason, Removal

NS = b"n" * 16
OTHER = b"o" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


class Clock:
    """A settable wall clock for the record's ``clock``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Meta:
    """What the store's Index maps a key to (only its namespace is read)."""

    def __init__(self, namespace: bytes | None) -> None:
        self.namespace = namespace


class Index(dict[bytes, Meta]):
    """An index that tells the namespace a key is held for, as the store's does."""


def miss(log: MissLog, k: bytes, **names: Any) -> dict[str, Any]:
    """The row of a lookup whose first block ``k`` missed (nothing hit)."""
    log.lookup(NS, [k], 0, 0, 0, set(), False)
    return log.recent(1, namespaces=names.get("namespaces"))[0]


@pytest.mark.parametrize(("why", "reason"), [
    ("capacity", "evicted"), ("expired", "evicted"), ("deleted", "deleted"),
    ("corrupt", "checksum_failure"), ("orphan", "orphaned"), ("lease", "lease_lost")])
def test_each_removal_reason_gives_its_own_miss_reason(why: str, reason: str) -> None:
    """A removal read as the wrong reason sends the operator after the wrong cause
    (an orphan or a redis TTL expiry shown as something else)."""
    log = MissLog()
    log.removed(key(1), why, "redis" if why == "expired" else "cpu")
    assert miss(log, key(1))["reason"] == reason


def test_a_deleted_block_that_admission_refused_is_deleted_not_dropped() -> None:
    """Only an eviction is final after a refusal below: a client's delete stays 'deleted'."""
    log = MissLog()
    log.refused(key(1), "nvme")
    log.removed(key(1), "deleted", "cpu")
    assert miss(log, key(1))["reason"] == "deleted"


def test_a_block_dropped_by_admission_names_the_evicting_policy() -> None:
    """The admission row says which policy of the tier above chose the block."""
    log = MissLog(policies={"cpu": "lru", "nvme": "s3fifo"})
    log.refused(key(1), "nvme")
    log.removed(key(1), "capacity", "cpu")
    row = miss(log, key(1))
    assert row["reason"] == "dropped_by_admission"
    assert row["removed"]["tier"] == "cpu" and row["removed"]["policy"] == "lru"


def test_an_eviction_names_the_policy_of_the_tier_it_left() -> None:
    """The policy shown is that of the tier the block left, not another tier's."""
    log = MissLog(policies={"cpu": "lru", "nvme": "s3fifo"})
    log.removed(key(1), "capacity", "nvme")
    assert miss(log, key(1))["removed"]["policy"] == "s3fifo"


def test_the_age_of_a_removal_is_the_time_since_it() -> None:
    """age_s is lookup time minus removal time, and never negative when the wall clock
    stepped back between the two."""
    clock = Clock(1000.0)
    log = MissLog(clock=clock)
    log.removed(key(1), "capacity", "cpu")
    clock.now = 1030.0
    row = miss(log, key(1))
    assert row["removed"]["at"] == 1000.0 and row["removed"]["age_s"] == 30.0
    log.removed(key(2), "capacity", "cpu")   # at 1030
    clock.now = 1010.0                        # the wall clock stepped back
    assert miss(log, key(2))["removed"]["age_s"] == 0.0


def test_hits_are_split_per_tier_and_the_first_miss_counts_redis_hits() -> None:
    """n_cpu, n_local (cpu + nvme) and hits (all) become cpu / nvme / redis counts; the
    first missing block's index is after every hit, redis ones included."""
    log = MissLog()
    keys = [key(i) for i in range(7)]
    log.lookup(NS, keys, 6, 1, 3, set(), False)   # 1 cpu, 2 nvme, 3 redis, then a miss
    row = log.recent(1)[0]
    assert row["hits"] == {"cpu": 1, "nvme": 2, "redis": 3}
    assert row["hit_blocks"] == 6 and row["first_miss"] == 6 and row["blocks"] == 7
    log.lookup(NS, keys[:3], 3, 1, 2, set(), False)   # a full hit, split the same way
    row = log.recent(1)[0]
    assert row["hits"] == {"cpu": 1, "nvme": 1, "redis": 1} and row["first_miss"] is None


def test_a_key_in_an_index_without_owners_is_in_flight() -> None:
    """A plain set of keys tells no namespace: the key is being written, not a mismatch."""
    log = MissLog()
    log.lookup(NS, [key(1)], 0, 0, 0, {key(1)}, False)
    assert log.recent(1)[0]["reason"] == "in_flight"
    index = Index({key(1): Meta(NS), key(2): Meta(None)})
    log.lookup(NS, [key(1)], 0, 0, 0, index, False)   # held for this very namespace
    assert log.recent(1)[0]["reason"] == "in_flight"
    log.lookup(NS, [key(2)], 0, 0, 0, index, False)   # owner unknown
    assert log.recent(1)[0]["reason"] == "in_flight"
    index[key(3)] = Meta(OTHER)
    log.lookup(NS, [key(3)], 0, 0, 0, index, False)
    assert log.recent(1)[0]["reason"] == "namespace_mismatch"


def test_a_refused_lookup_is_counted_and_told_to_register_its_layout() -> None:
    """rejected(): counted as a namespace mismatch, and its hint is register_layout (not
    'stored under another namespace', which is for a block held for another one)."""
    log = MissLog()
    log.rejected(NS, 4, "unknown_namespace")
    row = log.recent(1)[0]
    assert row["reason"] == "namespace_mismatch" and row["error"] == "unknown_namespace"
    assert "register_layout" in row["hint"] and "another namespace" not in row["hint"]
    assert log.stats()["first_miss"]["namespace_mismatch"] == 1


def test_stats_count_the_removal_record() -> None:
    """stats()['removals'] is the removal record's fill, not the refusal record's."""
    log = MissLog(ring=4)
    log.refused(key(9), "nvme")
    for i in range(3):
        log.removed(key(i), "capacity", "cpu")
    assert log.stats() == {"first_miss": log.stats()["first_miss"], "ring": 0,
                           "ring_size": 4, "removals": 3}


def test_the_removal_record_keeps_exactly_its_size_newest_first() -> None:
    """removals=N keeps N keys; a key removed again is the newest, so an older one goes."""
    log = MissLog(removals=2, clock=Clock())
    log.removed(key(1), "capacity", "cpu")
    log.removed(key(2), "capacity", "cpu")
    assert log.removal(key(1)) is not None and log.removal(key(2)) is not None
    log.removed(key(1), "capacity", "nvme")   # key 1 left another tier later
    log.removed(key(3), "capacity", "cpu")
    assert log.removal(key(2)) is None
    assert log.removal(key(1)) == Removal("evicted", "nvme", "", 1000.0)
    with pytest.raises(ValueError):
        MissLog(removals=0)


def test_the_refusal_record_keeps_the_newest_1024() -> None:
    """A refusal is remembered until the eviction above (1024 at most, oldest forgotten)."""
    log = MissLog()
    for i in range(1025):
        log.refused(key(i), "nvme")
    log.removed(key(1024), "capacity", "cpu")   # the newest refusal is kept
    log.removed(key(1), "capacity", "cpu")      # the second oldest too
    log.removed(key(0), "capacity", "cpu")      # the oldest was forgotten
    assert [log.removal(key(i)).reason for i in (1024, 1, 0)] == [  # type: ignore[union-attr]
        "dropped_by_admission", "dropped_by_admission", "evicted"]


def test_recent_returns_exactly_limit_rows() -> None:
    log = MissLog()
    for _ in range(5):
        log.lookup(NS, [key(1)], 1, 1, 1, set(), False)
    assert len(log.recent(2)) == 2


def test_a_full_hit_has_no_hint_and_rows_carry_the_namespace_fields() -> None:
    """A hit row carries no hint; model_id, salt_id and tp_rank come from ``namespaces``."""
    log = MissLog()
    log.lookup(NS, [key(1)], 1, 1, 1, set(), False)
    names = {NS: {"model_id": "m", "salt_id": "ab12cd34", "tp_rank": 3}}
    row = log.recent(1, namespaces=names)[0]
    assert "hint" not in row and "error" not in row and "removed" not in row
    assert (row["model_id"], row["salt_id"], row["tp_rank"]) == ("m", "ab12cd34", 3)


def test_a_never_stored_key_of_an_unknown_namespace_claims_no_siblings() -> None:
    """With nothing known about the lookup's namespace, the hint must not count other
    namespaces 'of model None' as its siblings."""
    log = MissLog()
    names: dict[bytes, dict[str, Any]] = {b"a" * 16: {}, b"b" * 16: {}}
    row = miss(log, key(1), namespaces=names)
    assert row["reason"] == "never_stored" and "other namespace" not in row.get("hint", "")


@pytest.mark.parametrize(("why", "tier", "words"), [
    ("orphan", "cpu", "parent block left every tier"),
    ("corrupt", "nvme", "corrupt and dropped"),
    ("lease", "cpu", "never committed"),
])
def test_each_miss_reason_has_its_hint(why: str, tier: str, words: str) -> None:
    """The hint is what an operator acts on: each reason keeps its own."""
    log = MissLog()
    log.removed(key(1), why, tier)
    assert words in miss(log, key(1))["hint"]


def test_a_down_tier_has_its_hint() -> None:
    log = MissLog()
    log.lookup(NS, [key(1)], 0, 0, 0, set(), True)
    row = log.recent(1)[0]
    assert row["reason"] == MissReason.TIER_DOWN.value and "kvtier_tier_up" in row["hint"]


def test_admission_from_nvme_with_redis_keeps_the_admission_hint() -> None:
    """Only an eviction from nvme is blamed on redis; a refusal keeps its own advice."""
    log = MissLog(redis_tier=True)
    log.refused(key(1), "redis")
    log.removed(key(1), "capacity", "nvme")
    row = miss(log, key(1))
    assert row["reason"] == "dropped_by_admission" and "write budget" in row["hint"]
