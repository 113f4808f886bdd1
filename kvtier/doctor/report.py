"""Render doctor's result as text for people or as JSON for machines."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

from kvtier.doctor.collect import Collected
from kvtier.doctor.patterns import Finding, Pattern
from kvtier.doctor.signals import Signals

WIDTH = 100


def _observed(s: Signals) -> list[str]:
    """One line of the headline numbers, whatever was available."""
    parts = []
    if s.kv_usage_last is not None:
        parts.append(f"KV usage {s.kv_usage_last:.0%}")
    if s.running_last is not None:
        parts.append(f"running {s.running_last:.0f}")
    if s.waiting_last is not None:
        parts.append(f"waiting {s.waiting_last:.0f}")
    if s.preemptions is not None:
        parts.append(f"preemptions +{s.preemptions:.0f}")
    if s.ttft_mean is not None:
        parts.append(f"TTFT mean {s.ttft_mean:.2f} s")
    if s.itl_mean is not None:
        parts.append(f"ITL mean {s.itl_mean * 1e3:.0f} ms")
    if s.generation_tps:
        parts.append(f"{s.generation_tps[-1]:,.0f} tokens/s")
    if s.prefix_hit_rate is not None:
        parts.append(f"prefix hit rate {s.prefix_hit_rate:.0%}")
    for t in s.tiers:
        if t.used_share is not None:
            parts.append(f"kvtier {t.name} {t.used_share:.0%} used")
    return textwrap.wrap("observed: " + ", ".join(parts), WIDTH,
                         subsequent_indent="  ") if parts else []


def _sources(got: Collected) -> list[str]:
    lines = []
    if got.engine:
        lines.append("engine metrics: " + ", ".join(e.source for e in got.engine))
    if got.stats:
        lines.append("kvtier stats: " + ", ".join(s.source for s in got.stats))
    return [textwrap.shorten(x, WIDTH, placeholder=" ...") for x in lines]


def _block(label: str, text: str) -> list[str]:
    hang = 16 if text.startswith("- ") else 14
    return textwrap.wrap(text, WIDTH, initial_indent=f"    {label:<9} ",
                         subsequent_indent=" " * hang)


def _finding(f: Finding) -> list[str]:
    lines = [f"[{f.pattern.number}] {f.title} ({f.pattern.value})"]
    lines += _block("symptom", f.symptom)
    for i, e in enumerate(f.evidence):
        lines += _block("evidence" if i == 0 else "", f"- {e}")
    lines += _block("cause", f.cause)
    for i, a in enumerate(f.actions):
        lines += _block("change" if i == 0 else "", f"- {a}")
    return lines


def render_text(findings: list[Finding], signals: Signals, got: Collected) -> str:
    """The default output of ``kvtier doctor``."""
    span = (f"{signals.samples} samples {signals.interval_s:g} s apart"
            if signals.interval_s else f"{signals.samples} sample")
    if findings:
        head = (f"kvtier doctor: {len(findings)} finding{'s' if len(findings) > 1 else ''} "
                f"({span})")
    else:
        head = f"kvtier doctor: healthy: none of the {len(Pattern)} KV patterns found ({span})"
    lines = [head, *_sources(got), *_observed(signals)]
    for f in findings:
        lines += ["", *_finding(f)]
    notes = [*got.notes, *signals.notes]
    if notes:
        lines.append("")
        for n in notes:
            lines += textwrap.wrap(f"note: {n}", WIDTH, subsequent_indent="      ")
    return "\n".join(lines)


def to_json(findings: list[Finding], signals: Signals, got: Collected) -> dict[str, Any]:
    """The ``--json`` document."""
    sig = dataclasses.asdict(signals)
    sig.pop("notes", None)
    return {
        "status": "findings" if findings else "healthy",
        "findings": [{"pattern": f.pattern.value, "number": f.pattern.number,
                      "title": f.title, "symptom": f.symptom, "evidence": list(f.evidence),
                      "cause": f.cause, "actions": list(f.actions)} for f in findings],
        "signals": sig,
        "sources": {"engine": [e.source for e in got.engine],
                    "stats": [s.source for s in got.stats]},
        "notes": [*got.notes, *signals.notes],
    }
