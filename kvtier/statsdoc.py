"""Reading a ``/v1/stats`` answer for display: typed accessors that name the field whose
type is wrong, so that ``kvtier stats`` (and doctor, for the live miss-ratio curve) refuse a
malformed answer in one line instead of a TypeError or AttributeError deep in a format."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class MalformedStats(ValueError):
    """A field of a ``/v1/stats`` answer has a type the table cannot show; the message
    names the field (``daemon.uptime_s is a str, not a number``)."""


def kind(v: object) -> str:
    """A JSON value's type, as an error message names it."""
    return "null" if v is None else type(v).__name__


def section(doc: Mapping[str, Any], key: str, where: str = "") -> dict[str, Any]:
    """``doc[key]`` as an object ({} when absent); MalformedStats when it is another type
    (``key`` shown cleaned: tier names come from the peer)."""
    v = doc.get(key, {})
    if not isinstance(v, dict):
        raise MalformedStats(f"{where}{clean(str(key))} is a {kind(v)}, not an object")
    return v


def number(doc: dict[str, Any], key: str, where: str = "", *,
           negative_ok: bool = False) -> float:
    """``doc[key]`` as a float (0 when absent); MalformedStats for a non-number, an integer
    too large for a float, NaN or an infinity (JSON's 1e400 reads as one), or a negative
    number unless ``negative_ok``: the daemon's counts, sizes, rates and times are finite
    and >= 0, so anything else is a broken or forged answer, not a state to show."""
    v = doc.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise MalformedStats(f"{where}{key} is a {kind(v)}, not a number")
    try:
        f = float(v)
    except OverflowError:
        raise MalformedStats(f"{where}{key} is a number too large to show") from None
    if not math.isfinite(f) or (f < 0 and not negative_ok):
        floor = "" if negative_ok else " >= 0"
        raise MalformedStats(f"{where}{key} is {v}, not a finite number{floor}")
    return f


def scalar(doc: dict[str, Any], key: str, default: str, where: str = "") -> str:
    """``doc[key]`` shown as text; MalformedStats for an object or list (not a value)."""
    v = doc.get(key, default)
    if isinstance(v, dict | list):
        raise MalformedStats(f"{where}{key} is a {kind(v)}, not a value")
    return clean(str(v))


def clean(text: str, limit: int = 80) -> str:
    """A peer's text made safe for a terminal: printable (ESC and the like become ``?``),
    at most ``limit`` characters."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def check_policy(s: dict[str, Any]) -> None:
    """The shape mrc.render_table reads: policy.tiers.<tier>.mrc = [{scale, hit_rate}]."""
    tiers = section(section(s, "policy"), "tiers", "policy.")
    for name, t in tiers.items():
        where = f"policy.tiers.{clean(name)}"
        if not isinstance(t, dict):
            raise MalformedStats(f"{where} is a {kind(t)}, not an object")
        scalar(t, "mode", "?", where + ".")
        scalar(t, "switches", "0", where + ".")
        points = t.get("mrc", [])
        if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
            raise MalformedStats(f"{where}.mrc is not a list of points")
        for p in points:
            for key in ("scale", "hit_rate"):
                if key not in p:
                    raise MalformedStats(f"{where}.mrc has a point without {key}")
                number(p, key, where + ".mrc.")
