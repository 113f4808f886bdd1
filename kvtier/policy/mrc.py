"""Reading the live miss-ratio curve: what a tier of another size would hit.

The curve comes from the adaptive policy's shadow caches (:mod:`kvtier.policy.shadow`) and
is exported in ``/v1/stats`` under ``policy.tiers.<tier>.mrc`` as ``(scale, hit_rate)``
points at 0.25x .. 4x of the tier's size. These functions are what ``kvtier stats``,
``kvtier plan --live-stats`` and ``kvtier doctor`` call; they take the stats document (a
plain dict) and never contact a daemon themselves.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import KVTierError
from kvtier.statsdoc import MalformedStats, clean, kind, number, section
from kvtier.units import format_bytes


class LiveStatsError(KVTierError):
    """A daemon's /v1/stats could not be read for its miss-ratio curve."""

    code = "live_stats"

TOO_SMALL_GAIN = 0.05
"""Doubling a tier that would raise its token hit rate by this much (absolute): too small."""
TOO_LARGE_LOSS = 0.01
"""Halving a tier that would lose less than this (absolute): larger than its hits need."""


MAX_SCALE = 1024.0
"""Largest curve point (x the tier's size) read: the daemon exports 0.25x .. 4x."""
MAX_CAPACITY_BYTES = float(2**64)
"""Largest tier capacity read (16 EiB): more is a forged answer, whose sizes would print
as absurd figures or overflow a float (found by review)."""


def policy_tiers(stats: Mapping[str, Any]) -> dict[str, Any]:
    """``policy.tiers`` of a stats document; MalformedStats when it is not an object."""
    return section(section(stats, "policy", ""), "tiers", "policy.")


def curve_of(stats: Mapping[str, Any], tier: str) -> list[tuple[float, float]]:
    """The ``(scale, hit rate)`` points of ``tier`` in a stats document (empty if none).
    MalformedStats naming the field for a point that is not a finite scale in
    (0, MAX_SCALE] with a hit rate in [0, 1]: a scale of 0 ended in log2(0) (found by
    review)."""
    where = f"policy.tiers.{clean(str(tier))}.mrc"
    pts = section(policy_tiers(stats), tier, "policy.tiers.").get("mrc", [])
    if not isinstance(pts, list) or not all(isinstance(p, dict) for p in pts):
        raise MalformedStats(f"{where} is not a list of points")
    out = []
    for p in pts:
        for key in ("scale", "hit_rate"):
            if key not in p:
                raise MalformedStats(f"{where} has a point without {key}")
        scale, hit = number(p, "scale", where + "."), number(p, "hit_rate", where + ".")
        if not 0 < scale <= MAX_SCALE:
            raise MalformedStats(f"{where}.scale is {scale:g}, not in (0, {MAX_SCALE:g}]")
        if hit > 1:
            raise MalformedStats(f"{where}.hit_rate is {hit:g}, not in [0, 1]")
        out.append((scale, hit))
    return sorted(out)


def capacity_of(stats: Mapping[str, Any], tier: str) -> float:
    """``tiers.<tier>.capacity_bytes`` (0 when absent or null); MalformedStats naming the
    field for a non-number, a negative one or one above MAX_CAPACITY_BYTES ("lots" or 400
    digits ended in a ValueError or an OverflowError; found by review)."""
    t = section(section(stats, "tiers", ""), tier, "tiers.")
    if t.get("capacity_bytes") is None:
        return 0.0
    where = f"tiers.{clean(str(tier))}."
    cap = number(t, "capacity_bytes", where)
    if cap > MAX_CAPACITY_BYTES:
        raise MalformedStats(f"{where}capacity_bytes is {cap:g}, above {MAX_CAPACITY_BYTES:g}")
    return cap


def predict(curve: Sequence[tuple[float, float]], scale: float) -> float | None:
    """The hit rate at ``scale`` x the tier's size, interpolated in log2(scale) between
    measured points; ``None`` outside the measured range or without a curve."""
    if not curve or scale <= 0:
        return None
    for (s0, h0), (s1, h1) in itertools.pairwise(curve):
        if s0 <= 0:   # no log2 of 0 (curve_of refuses such points; found by review)
            continue
        if s0 <= scale <= s1:
            if s1 == s0:
                return h0
            w = (math.log2(scale) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
            return h0 + w * (h1 - h0)
    if len(curve) == 1 and curve[0][0] == scale:
        return curve[0][1]
    return None


@dataclass(frozen=True, slots=True)
class SizeOption:
    """One point of a tier's curve turned into a size an operator can buy."""

    tier: str
    scale: float
    capacity_bytes: float
    hit_rate: float
    current_hit_rate: float


def size_options(stats: Mapping[str, Any], tier: str) -> list[SizeOption]:
    """Every measured size of ``tier`` with the hit rate it would have."""
    curve = curve_of(stats, tier)
    cap = capacity_of(stats, tier)
    now = predict(curve, 1.0)
    if now is None:
        return []
    return [SizeOption(tier, s, s * cap, h, now) for s, h in curve]


def plan_lines(stats: Mapping[str, Any]) -> list[str]:
    """``kvtier plan --live-stats``: per tier and size, the token hit rate it would give.
    Tier names are shown through clean() (found by review: they reached the terminal raw)."""
    lines: list[str] = []
    for tier in policy_tiers(stats):
        for o in size_options(stats, tier):
            if o.scale == 1.0:
                continue
            lines.append(f"a {clean(str(tier))} tier of {format_bytes(o.capacity_bytes)} "
                         f"({o.scale:g}x) would {_change(o)} on this node's live workload")
    return lines


def _change(o: SizeOption) -> str:
    """What the size would do to the hit rate, as shown (0.1%): raise it, lower it, or
    keep it (found by review: "raise its token hit rate from 13.4% to 13.4%")."""
    now, then = f"{o.current_hit_rate:.1%}", f"{o.hit_rate:.1%}"
    if now == then:
        return f"keep its token hit rate at {now}"
    verb = "raise" if o.hit_rate > o.current_hit_rate else "lower"
    return f"{verb} its token hit rate from {now} to {then}"


def sizing_notes(stats: Mapping[str, Any]) -> list[str]:
    """``kvtier doctor``: a tier too small (doubling it gains much) or larger than its hit
    rate needs (halving it loses almost nothing), from its live curve. MalformedStats for
    a field of the wrong type (curve_of, capacity_of)."""
    notes: list[str] = []
    for tier in policy_tiers(stats):
        curve = curve_of(stats, tier)
        now, twice, half = predict(curve, 1.0), predict(curve, 2.0), predict(curve, 0.5)
        if now is None:
            continue
        cap, name = capacity_of(stats, tier), clean(str(tier))  # (found by review)
        if twice is not None and twice - now >= TOO_SMALL_GAIN:
            notes.append(f"{name} tier too small for this workload: at {format_bytes(2 * cap)} its "
                         f"token hit rate would be {twice:.1%} instead of {now:.1%} (live "
                         "miss-ratio curve); give it more memory if the node has it")
        elif half is not None and now - half < TOO_LARGE_LOSS and now > 0:
            notes.append(f"{name} tier larger than its hit rate needs: at {format_bytes(cap / 2)} "
                         f"it would still hit {half:.1%} of tokens (now {now:.1%}); the "
                         "memory could go elsewhere")
    return notes


def _cell(t: dict[str, Any], key: str, default: str, where: str) -> str:
    """``t[key]`` as clean text, ``default`` for null or absent; MalformedStats for an
    object or a list (a null ``switches`` or ``mode`` ended in a TypeError; found by
    review)."""
    v = t.get(key)
    if v is None:
        return default
    if isinstance(v, dict | list):
        raise MalformedStats(f"{where}{key} is a {kind(v)}, not a value")
    return clean(str(v))


def render_table(stats: Mapping[str, Any]) -> str:
    """The small table of ``kvtier stats``: per tier, mode and hit rate at each size.
    MalformedStats (a ValueError) naming the field when one cannot be shown."""
    rows = []
    for tier, t in policy_tiers(stats).items():
        pts = dict(curve_of(stats, tier))
        if not pts:
            continue
        cells = [f"{pts[s]:6.1%}" if s in pts else "     -" for s in (0.25, 0.5, 1.0, 2.0, 4.0)]
        name = clean(str(tier))
        where = f"policy.tiers.{name}."
        rows.append(f"{name:<6} {_cell(t, 'mode', '?', where):<5} "
                    f"{_cell(t, 'switches', '-', where):>8}  " + "  ".join(cells))
    if not rows:
        return ""
    head = ("policy adaptive: token hit rate at x tier size (live miss-ratio curve)\n"
            "tier   mode  switches   0.25x    0.5x      1x      2x      4x")
    return "\n".join([head, *rows])


def load_stats(source: str, timeout: float | None = None) -> dict[str, Any]:
    """A /v1/stats document from a daemon URL (``http://host:port`` or the full path) or
    a saved JSON file, read as ``kvtier stats`` and ``doctor`` read theirs (kvtier.httpget:
    at most ``httpget.MAX_BODY_BYTES``, within ``timeout`` seconds in all, default
    ``httpget.DEFAULT_DEADLINE_S``; a regular file only, never a FIFO or a device)."""
    from kvtier import httpget, jsonin

    try:
        if source.startswith(("http://", "https://")):
            url = source if source.rstrip("/").endswith("/v1/stats") else (
                source.rstrip("/") + "/v1/stats")
            body = httpget.get(url, deadline_s=timeout or httpget.DEFAULT_DEADLINE_S)
        else:
            body = httpget.read_file(source)
        doc = jsonin.loads(body)
    except (httpget.FetchError, ValueError) as exc:
        raise LiveStatsError(f"cannot read kvtier stats from {source} ({exc}); give a "
                             "running daemon's http address or a saved /v1/stats file") from None
    if not isinstance(doc, dict):
        raise LiveStatsError(f"{source} is not a /v1/stats document (expected an object)")
    return doc


def live_plan(source: str) -> str:
    """``kvtier plan --live-stats``: the sizing lines of a live daemon (or a note why none)."""
    from kvtier.statsdoc import check_policy

    stats = load_stats(source)
    try:
        check_policy(stats)   # the shape plan_lines reads, each number a float
        lines = plan_lines(stats)   # and what it reads beyond (tiers; found by review)
    except MalformedStats as exc:
        raise LiveStatsError(f"{source} is not kvtier stats: {exc}") from None
    if not lines:
        return (f"{source}: no live miss-ratio curve yet (the daemon needs the adaptive "
                "policy and a full tier: its shadows start at the first eviction)")
    return "\n".join([f"live workload of {source}:", *("  " + ln for ln in lines)])
