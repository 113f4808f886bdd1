"""``kvtier explain``: recent lookups and why their first block missed.

Reads the daemon's ``/v1/lookups/recent``; prints a table (rich) or, with ``--json``, the
endpoint's JSON. Exit status: 0 shown, 2 no daemon answered or its answer is not
recent lookups (one line saying why).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.table import Table

from kvtier import httpget, jsonin
from kvtier.argtypes import http_url, int_in

MAX_LIMIT = 100_000
"""Most lookups one answer holds: the daemon refuses more (HTTP 400)."""


def add_parser(sub: Any) -> None:
    """Register ``explain`` on the ``kvtier`` command line."""
    p = sub.add_parser("explain", help="why recent lookups missed (per request)",
                       description="Recent lookups (newest first): blocks asked, hits per "
                       "tier, and for the first missing block why it was not there: never "
                       "stored, evicted (by which policy, when), dropped by admission, "
                       "checksum failure, tier down, lease lost, namespace mismatch.")
    p.add_argument("--url", default=None, type=http_url,
                   help="daemon HTTP base URL (default http://127.0.0.1:PORT from config)")
    p.add_argument("--config", metavar="FILE")
    p.add_argument("--limit", type=int_in(1, MAX_LIMIT), default=20,
                   help=f"lookups to show, 1 to {MAX_LIMIT} (default 20)")
    p.add_argument("--misses", action="store_true", help="only lookups that missed")
    p.add_argument("--json", action="store_true", help="print the endpoint's JSON")
    p.set_defaults(func=run)


FETCH_DEADLINE_S = httpget.DEFAULT_DEADLINE_S
"""Seconds one fetch may take in all (a slow or stuck peer ends in one line)."""


def fetch_recent(url: str, limit: int, misses: bool,
                 timeout: float = FETCH_DEADLINE_S) -> list[dict[str, Any]]:
    """The daemon's recent lookups, fetched within ``timeout`` seconds in all and at most
    httpget.MAX_BODY_BYTES; httpget.FetchError when no usable reply came, ValueError when
    it is not ``{"lookups": [..]}`` of objects."""
    q = f"/v1/lookups/recent?limit={limit}&misses={int(misses)}"
    doc = jsonin.loads(httpget.get(url.rstrip("/") + q, deadline_s=timeout))
    rows = doc.get("lookups") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError("the answer is not a list of lookups")
    return rows


class MalformedLookup(ValueError):
    """A lookup row lacks a field the table shows, or has it with the wrong type; the
    message names the row and the field."""


def _field(r: dict[str, Any], key: str, kinds: tuple[type, ...], where: str,
           default: Any = ...) -> Any:
    """``r[key]`` if it is one of ``kinds`` (a bool is none of them); ``default`` when absent
    and one is given; MalformedLookup otherwise."""
    if key not in r:
        if default is ...:
            raise MalformedLookup(f"{where} has no {key}")
        return default
    v = r[key]
    if isinstance(v, bool) or not isinstance(v, kinds):
        raise MalformedLookup(f"{where}: {key} is {json.dumps(v)[:40]} (wrong type)")
    return v


MAX_HINT_CHARS = 2048
"""A hint longer than this is not the daemon's (its own are a few hundred characters)."""


def _printable(v: object, most: int = MAX_HINT_CHARS) -> str:
    """A peer's text made safe for a table cell: every unprintable character a ``?``, at
    most ``most`` characters."""
    return "".join(c if c.isprintable() else "?" for c in str(v)[:most])


def _text(v: object) -> str:
    """A peer's value for one table cell: printable, at most 80 characters."""
    return _printable(v, 80)


def _seconds(r: dict[str, Any], key: str, where: str) -> float:
    """``r[key]`` as a finite float; MalformedLookup for an integer too large for a float
    (``removed.age_s`` was an OverflowError traceback; found by review), NaN or infinity."""
    try:
        v = float(_field(r, key, _NUM, where))
    except OverflowError:
        v = math.nan
    if not math.isfinite(v):
        raise MalformedLookup(f"{where}: {key} is out of range")
    return v


def _ago(now: float, at: float) -> str:
    s = max(now - at, 0.0)
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.0f}m"


_NUM = (int, float)
_VALUE = (str, int, float)


def _cells(i: int, r: dict[str, Any], now: float) -> tuple[str, ...]:
    """One lookup's cells (ago, model / ns, asked, cpu, nvme, redis, first miss, detail);
    MalformedLookup when the row is not what /v1/lookups/recent sends."""
    w = f"lookup {i}"
    ns = (f"{_text(_field(r, 'model_id', (*_VALUE, type(None)), w, None) or '?')} "
          f"{_text(_field(r, 'namespace', (str,), w)[:8])}")
    if salt := _field(r, "salt_id", (*_VALUE, type(None)), w, None):
        ns += f" salt#{_text(salt)}"
    reason = _text(_field(r, "reason", (str,), w))
    detail = ""
    if "removed" in r:
        rm = _field(r, "removed", (dict,), w)
        policy = _field(rm, "policy", (*_VALUE, type(None)), w + " removed", None)
        by = f" ({_text(policy)})" if policy else ""
        age = _seconds(rm, "age_s", w + " removed")
        detail = f"left {_text(_field(rm, 'tier', _VALUE, w + ' removed'))}{by} {age:.1f}s before"
    # the hint whole: cut at 80 characters it lost its advice ("raise nvme.wr"; found by
    # review); it is the daemon's own text (with a model id of 1024 characters at most)
    if hint := _printable(_field(r, "hint", (str, type(None)), w, None) or ""):
        detail = f"{detail}; {hint}" if detail else hint
    style = "green" if reason == "none" else "yellow"
    first = ("-" if reason == "none" else
             f"block {_text(_field(r, 'first_miss', _VALUE, w))}: {reason}")
    h = _field(r, "hits", (dict,), w)
    ago = _ago(now, _seconds(r, "at", w))
    # every cell escaped: "[/x]" as a count was a rich MarkupError (found by review)
    return (ago, escape(ns), escape(_text(_field(r, "blocks", _VALUE, w))),
            *(escape(_text(_field(h, t, _VALUE, w + " hits"))) for t in ("cpu", "nvme", "redis")),
            f"[{style}]{escape(first)}[/{style}]", escape(detail))


def render(rows: list[dict[str, Any]], console: Console, now: float | None = None) -> None:
    """The human table: one row per lookup, the reason and a hint for misses.
    MalformedLookup (before anything is printed) when a row cannot be shown."""
    now = time.time() if now is None else now
    cells = [_cells(i, r, now) for i, r in enumerate(rows, 1)]
    table = Table(title="recent lookups (newest first)", title_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("ago", "right"), ("model / ns", "left"), ("asked", "right"), ("cpu", "right"),
        ("nvme", "right"), ("redis", "right"), ("first miss", "left"), ("detail", "left"))
    for col, just in columns:
        table.add_column(col, justify=just)
    for row in cells:
        table.add_row(*row)
    console.print(table)


def _fail(args: argparse.Namespace, line: str) -> int:
    """Say why in one line (stderr, or ``{"error"}`` on stdout with --json); exit 2."""
    if args.json:
        print(json.dumps({"error": line}))
    else:
        print(f"kvtier explain: {line}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from kvtier.config import daemon_url

    url = daemon_url(args.url, args.config)
    try:
        rows = fetch_recent(url, args.limit, args.misses, timeout=FETCH_DEADLINE_S)
    except httpget.Unreachable as exc:
        return _fail(args, f"no daemon answered at {url} ({exc}); start it or pass --url")
    except (httpget.FetchError, ValueError) as exc:
        return _fail(args, f"the answer from {url} is not kvtier's recent lookups ({exc}); "
                     "is --url the daemon's HTTP port?")
    if args.json:
        print(json.dumps({"lookups": rows}, indent=2))
        return 0
    try:
        render(rows, Console(width=max(Console().width, 140)))
    except MalformedLookup as exc:
        return _fail(args, f"the answer from {url} is not kvtier's recent lookups ({exc}); "
                     "is --url the daemon's HTTP port?")
    return 0
