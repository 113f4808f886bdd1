"""kvtier's own ``/v1/stats`` JSON, read tolerantly.

Every key may be missing (an older daemon, a partial snapshot): absent numbers are
``None`` and the checks that need them are skipped, with a note saying which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier import jsonin
from kvtier.doctor.errors import DoctorError
from kvtier.statsdoc import MalformedStats, check_policy, clean, number

SUPPORTED_VERSION = 1


def _num(obj: Any, *path: str, where: str = "") -> float | None:
    """The number at ``path``, None when it is missing or not a number; MalformedStats
    (statsdoc.number, naming ``where`` and the path) for an integer too large for a
    float, NaN, an infinity or a negative number (as the engine metrics reader refuses
    them: a "-200% used" or a healthy-looking infinite tier is no diagnosis)."""
    parent: Any = None
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return None
        parent, obj = obj, obj[key]
    if isinstance(obj, bool) or not isinstance(obj, int | float):
        return None
    return number(parent, path[-1], where + "".join(f"{k}." for k in path[:-1]))


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier's counters as the daemon reports them."""

    name: str
    up: bool | None
    capacity_bytes: float | None
    used_bytes: float | None
    allocation_failures: float | None
    evictions_capacity: float | None
    hit_tokens: float | None
    miss_tokens: float | None
    errors: float | None

    @property
    def used_share(self) -> float | None:
        """Used bytes over capacity (None when either is unknown or capacity is 0)."""
        if self.used_bytes is None or not self.capacity_bytes:
            return None
        return self.used_bytes / self.capacity_bytes


@dataclass(frozen=True, slots=True)
class KVTierStats:
    """One ``/v1/stats`` snapshot."""

    source: str
    version: int | None
    uptime_s: float | None
    tiers: dict[str, TierStats] = field(default_factory=dict)
    lookup_tokens: float | None = None
    hit_tokens: float | None = None
    prefix_hit_rate: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions: float | None = None
    context_p50: float | None = None
    context_p99: float | None = None
    missing: tuple[str, ...] = ()
    policy: dict[str, Any] = field(default_factory=dict)  # /v1/stats "policy" (live MRC)


def parse_stats(text: str, source: str) -> KVTierStats:
    """Parse a ``/v1/stats`` document; DoctorError only when it is not a JSON object."""
    try:
        doc = jsonin.loads(text)
    except ValueError as exc:
        raise DoctorError(f"{source} is not kvtier stats JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise DoctorError(f"{source} is not kvtier stats: expected a JSON object")
    missing = tuple(k for k in ("daemon", "tiers", "requests", "connector")
                    if not isinstance(doc.get(k), dict))
    if len(missing) == 4:
        raise DoctorError(f"{source} holds none of kvtier's stats sections "
                          "(daemon, tiers, requests, connector): is this /v1/stats?")
    try:
        return _parse(doc, source, missing)
    except MalformedStats as exc:
        raise DoctorError(f"{source} is not kvtier stats: {exc}") from None


def _parse(doc: dict[str, Any], source: str, missing: tuple[str, ...]) -> KVTierStats:
    tiers: dict[str, TierStats] = {}
    raw_tiers = doc.get("tiers")
    for name, t in (raw_tiers.items() if isinstance(raw_tiers, dict) else ()):
        if not isinstance(t, dict):
            continue
        up = t.get("up")
        w = f"tiers.{clean(str(name))}."
        tiers[str(name)] = TierStats(  # the name shown: clean (found by review: raw ESC)
            name=clean(str(t.get("name", name))), up=up if isinstance(up, bool) else None,
            capacity_bytes=_num(t, "capacity_bytes", where=w),
            used_bytes=_num(t, "used_bytes", where=w),
            allocation_failures=_num(t, "allocation_failures", where=w),
            evictions_capacity=_num(t, "evictions", "capacity", where=w),
            hit_tokens=_num(t, "hit_tokens", where=w), miss_tokens=_num(t, "miss_tokens", where=w),
            errors=_num(t, "errors", where=w))
    version = doc.get("version")
    return KVTierStats(
        source=source, version=version if isinstance(version, int) else None,
        uptime_s=_num(doc, "daemon", "uptime_s"), tiers=tiers,
        lookup_tokens=_num(doc, "requests", "lookup_tokens"),
        hit_tokens=_num(doc, "requests", "hit_tokens"),
        prefix_hit_rate=_num(doc, "requests", "prefix_hit_rate"),
        running=_num(doc, "connector", "running"), waiting=_num(doc, "connector", "waiting"),
        preemptions=_num(doc, "connector", "preemptions"),
        context_p50=_num(doc, "connector", "context_tokens_p50"),
        context_p99=_num(doc, "connector", "context_tokens_p99"),
        missing=missing,
        policy=_policy(doc))


def _policy(doc: dict[str, Any]) -> dict[str, Any]:
    """The ``policy`` section when the live miss-ratio curve in it is well formed, else {}
    (the sizing notes are skipped rather than crashing on a point without a scale)."""
    try:
        check_policy(doc)
    except MalformedStats:
        return {}
    policy = doc.get("policy", {})
    return policy if isinstance(policy, dict) else {}
