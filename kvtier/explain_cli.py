"""``kvtier explain``: recent lookups and why their first block missed.

Reads the daemon's ``/v1/lookups/recent``; prints a table (rich) or, with ``--json``, the
endpoint's JSON. Exit status: 0 shown, 2 no daemon answered.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.table import Table

from kvtier import jsonin
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


def fetch_recent(url: str, limit: int, misses: bool, timeout: float = 3.0) -> list[dict[str, Any]]:
    """The daemon's recent lookups; ValueError when its answer is not ``{"lookups": [..]}``
    of objects."""
    q = f"/v1/lookups/recent?limit={limit}&misses={int(misses)}"
    with urllib.request.urlopen(url.rstrip("/") + q, timeout=timeout) as resp:
        doc = jsonin.loads(resp.read())   # ValueError: what is wrong with it
    rows = doc.get("lookups") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError("the answer is not a list of lookups")
    return rows


def _ago(now: float, at: float) -> str:
    s = max(now - at, 0.0)
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.0f}m"


def render(rows: list[dict[str, Any]], console: Console, now: float | None = None) -> None:
    """The human table: one row per lookup, the reason and a hint for misses."""
    now = time.time() if now is None else now
    table = Table(title="recent lookups (newest first)", title_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("ago", "right"), ("model / ns", "left"), ("asked", "right"), ("cpu", "right"),
        ("nvme", "right"), ("redis", "right"), ("first miss", "left"), ("detail", "left"))
    for col, just in columns:
        table.add_column(col, justify=just)
    for r in rows:
        ns = f"{r.get('model_id') or '?'} {r['namespace'][:8]}"
        if r.get("salt_id"):
            ns += f" salt#{r['salt_id']}"
        reason = r["reason"]
        detail = ""
        if "removed" in r:
            rm = r["removed"]
            by = f" ({rm['policy']})" if rm["policy"] else ""
            detail = f"left {rm['tier']}{by} {rm['age_s']:.1f}s before"
        if r.get("hint"):
            detail = f"{detail}; {r['hint']}" if detail else r["hint"]
        style = "green" if reason == "none" else "yellow"
        first = "-" if reason == "none" else f"block {r['first_miss']}: {reason}"
        h = r["hits"]
        table.add_row(_ago(now, r["at"]), escape(ns), str(r["blocks"]), str(h["cpu"]),
                      str(h["nvme"]), str(h["redis"]), f"[{style}]{first}[/{style}]",
                      escape(detail))
    console.print(table)


def run(args: argparse.Namespace) -> int:
    url = args.url
    if url is None:
        from kvtier.config import load_config

        cfg = load_config(args.config)
        url = f"http://{cfg.http.host}:{cfg.http.port}"
    try:
        rows = fetch_recent(url, args.limit, args.misses)
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        reason = getattr(exc, "reason", exc)
        if args.json:
            print(json.dumps({"error": f"no daemon answered at {url} ({reason})"}))
        else:
            print(f"kvtier explain: no daemon answered at {url} ({reason}); start it or "
                  "pass --url", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"lookups": rows}, indent=2))
    else:
        render(rows, Console(width=max(Console().width, 140)))
    return 0
