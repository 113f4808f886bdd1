"""Turn replay results into the table an operator reads and the JSON a script parses.

Belady (MIN) is compared on block hits only: it maximises the blocks found, which is a
bound with one tier (each block keeps its prefix, as chained hash ids do), but a block
saves as many tokens as it holds, so a policy that keeps fuller blocks can save more
tokens than Belady (partial last blocks). ``vs belady`` is therefore a ratio of block hits;
token hits are compared with LRU only. With several tiers, per-tier MIN with demotion and
late prefetches is no optimum: there the ratio is a reference, not a bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvtier.replay.simulator import REUSE_EDGES, ReplayResult


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[idx]


def _belady_of(results: Sequence[ReplayResult], r: ReplayResult) -> ReplayResult | None:
    for other in results:
        if other.policy == "belady" and other.capacity_fraction == r.capacity_fraction and [
            t.capacity_blocks for t in other.tiers
        ] == [t.capacity_blocks for t in r.tiers]:
            return other
    return None


def _lru_of(results: Sequence[ReplayResult], r: ReplayResult) -> ReplayResult | None:
    for other in results:
        if other.policy == "lru" and other.capacity_fraction == r.capacity_fraction and [
            t.capacity_blocks for t in other.tiers
        ] == [t.capacity_blocks for t in r.tiers]:
            return other
    return None


def to_record(r: ReplayResult, results: Sequence[ReplayResult] = ()) -> dict[str, Any]:
    """One JSON object per (policy, capacity): the keys ``--json`` prints. ``vs_belady``
    is the ratio of block hits (where Belady is a bound), ``vs_lru`` of tokens saved."""
    bel = _belady_of(results, r)
    lru = _lru_of(results, r)
    ttft = r.ttft_s
    rec: dict[str, Any] = {
        "policy": r.policy,
        "capacity_fraction": r.capacity_fraction,
        "order": r.order,
        "capacity_blocks": {t.name: t.capacity_blocks for t in r.tiers},
        "requests": r.requests,
        "block_references": r.references,
        "token_hit_rate": r.token_hit_rate,
        "block_hit_rate": r.block_hit_rate,
        "token_hit_rate_by_tier": {
            t.name: (t.hit_tokens / r.total_tokens if r.total_tokens else 0.0) for t in r.tiers
        },
        "prefill_tokens_saved": r.hit_tokens,
        "prefill_tokens_total": r.total_tokens,
        "bytes_read_by_tier": {t.name: t.bytes_read for t in r.tiers},
        "bytes_written_by_tier": {t.name: t.bytes_written for t in r.tiers},
        "evictions_by_tier": {t.name: t.evictions for t in r.tiers},
        "admission_rejects_by_tier": {t.name: t.rejected for t in r.tiers},
        "orphans_dropped": r.orphans_dropped,
        "prefetch_late_blocks": r.late_blocks,
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else 0.0,
        "ttft_p99_s": _percentile(ttft, 0.99),
        "vs_belady": (
            r.hit_blocks / bel.hit_blocks if bel is not None and bel.hit_blocks else None
        ),
        "vs_lru": r.hit_tokens / lru.hit_tokens if lru is not None and lru.hit_tokens else None,
        "refs_per_s": r.references / r.elapsed_s if r.elapsed_s > 0 else None,
    }
    if r.shadows:  # adaptive: the live mode, switches and miss-ratio curve of each tier
        rec["shadows"] = {t.name: sh for t, sh in zip(r.tiers, r.shadows, strict=False)}
    if r.reuses_by_distance:
        rec["reuse_distance"] = [
            {"max_capacities": edge, "reuses": n, "hits": h}
            for edge, n, h in zip(
                (*REUSE_EDGES, None), r.reuses_by_distance, r.hits_by_distance, strict=True
            )
        ]
    return rec


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f}"


def fraction_label(fraction: float) -> str:
    """A capacity fraction as a percentage with as many digits as it has (up to six
    significant): 0.015 and 0.02 must not both read "2%", nor 0.004 "0%"."""
    return f"{fraction * 100:.6g}%"


def _capacity_label(r: ReplayResult) -> str:
    if r.capacity_fraction is not None:
        return fraction_label(r.capacity_fraction)
    return "+".join(str(t.capacity_blocks) for t in r.tiers)


def _bucket_names() -> list[str]:
    names = [f"<={e:g}" for e in REUSE_EDGES]
    return [*names, f">{REUSE_EDGES[-1]:g}"]


def format_reuse_breakdown(results: Sequence[ReplayResult]) -> str:
    """Share of reuses hit, by reuse distance in capacities (one row per run), under a header
    row with how many reuses each bucket holds (the same for every policy of a capacity)."""
    runs = [r for r in results if r.reuses_by_distance]
    if not runs:
        return ""
    head = ["capacity", "policy", *_bucket_names()]
    rows: list[list[str]] = []
    last_cap: str | None = None
    for r in runs:
        cap = _capacity_label(r)
        if cap != last_cap:
            rows.append([cap, "reuses", *(f"{n:,}" for n in r.reuses_by_distance)])
            last_cap = cap
        rows.append([cap, r.policy, *(
            f"{h / n:.3f}" if n else "-"
            for h, n in zip(r.hits_by_distance, r.reuses_by_distance, strict=True)
        )])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    title = ("share of reuses hit, by reuse distance (block references since the previous "
             "use of the block, in capacities)")
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def _policy_label(r: ReplayResult) -> str:
    """``adaptive`` with each tier's final mode and its number of switches."""
    if not r.shadows:
        return r.policy
    modes = "/".join(f"{sh['mode']}" for sh in r.shadows)
    switches = sum(int(str(sh["switches"])) for sh in r.shadows)
    return f"{r.policy}({modes},{switches}sw)"


_MRC_SCALES = (0.25, 0.5, 1, 2, 4)


def format_mrc(results: Sequence[ReplayResult]) -> str:
    """The adaptive runs' live miss-ratio curves: per tier, the token hit rate the shadows
    predict at 0.25x .. 4x the tier's size under the final mode, after the share of block
    references the shadows sampled. That column was headed "rate" under a title about hit
    rates, and a ``--tier`` capacity overflowed its column (found by review)."""
    head = ["capacity", "tier", "mode", "sampled", *(f"{s:g}x" for s in _MRC_SCALES)]
    rows: list[list[str]] = []
    for r in results:
        for t, sh in zip(r.tiers, r.shadows, strict=False):
            # a shadow snapshot's "mrc" is a list of {"scale", "hit_rate"} dicts
            pts = {p["scale"]: p["hit_rate"] for p in sh["mrc"]}  # type: ignore[attr-defined]
            rows.append([_capacity_label(r), t.name, str(sh["mode"]),
                         f"{float(str(sh['sample_rate'])):.4f}",
                         *(f"{pts[s]:.4f}" if s in pts else "-" for s in _MRC_SCALES)])
    if not rows:
        return ""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    left = {1, 2}   # tier and mode names; the numbers right-aligned

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    title = ("live miss-ratio curve (adaptive shadows): the token hit rate each tier would "
             "have at 0.25x .. 4x its size, under its final mode; sampled: the share of "
             "block references the shadows follow")
    return "\n".join([title, line(head), *(line(row) for row in rows)])


def belady_note(results: Sequence[ReplayResult]) -> str:
    """What ``blk vs belady`` means for these results ("" without a Belady run)."""
    bel = [r for r in results if r.policy == "belady"]
    if not bel:
        return ""
    note = ("blk vs belady: block hits over Belady's (MIN); it bounds block hits, not tokens "
            "saved (blocks hold different numbers of tokens)")
    if any(len(r.tiers) > 1 for r in bel):
        note += ("; with several tiers it is a reference, not a bound (per-tier MIN with "
                 "demotion and late prefetches is no optimum)")
    return note


def format_table(results: Sequence[ReplayResult]) -> str:
    """A fixed-width table, one row per (capacity, policy), grouped by capacity."""
    head, rows = table_rows(results)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def table_rows(results: Sequence[ReplayResult]) -> tuple[list[str], list[list[str]]]:
    """The header and the cells of the results table (``kvtier replay`` renders them)."""
    tiers = [t.name for t in results[0].tiers] if results else []
    head = ["capacity", "policy", "tok hit", "blk hit"]
    head += [f"{n} hit" for n in tiers] if len(tiers) > 1 else []
    head += ["saved Mtok", *[f"{n} wr GB" for n in tiers], "TTFT mean", "TTFT p99",
             "blk vs belady", "tok vs lru"]
    rows: list[list[str]] = []
    for r in results:
        rec = to_record(r, results)
        cap = _capacity_label(r)
        row = [cap, _policy_label(r), f"{r.token_hit_rate:.4f}", f"{r.block_hit_rate:.4f}"]
        if len(tiers) > 1:
            row += [f"{v:.4f}" for v in rec["token_hit_rate_by_tier"].values()]
        row += [f"{r.hit_tokens / 1e6:.1f}"]
        row += [_gb(v) for v in rec["bytes_written_by_tier"].values()]
        row += [f"{rec['ttft_mean_s']:.3f}s", f"{rec['ttft_p99_s']:.3f}s"]
        row += ["-" if rec["vs_belady"] is None else f"{rec['vs_belady']:.2f}"]
        row += ["-" if rec["vs_lru"] is None else f"{rec['vs_lru']:.2f}"]
        rows.append(row)
    return head, rows
