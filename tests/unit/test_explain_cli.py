"""``kvtier explain``'s table: the daemon's hint is shown whole, values stay bounded."""

from __future__ import annotations

import io

from rich.console import Console

from kvtier.explain import MissLog
from kvtier.explain_cli import render


def _table(rows: list[dict[str, object]]) -> str:
    buf = io.StringIO()
    render(rows, Console(file=buf, width=1000), now=10.0)
    return buf.getvalue()


def test_the_hint_is_shown_whole() -> None:
    """Cut at 80 characters, the admission hint lost its advice ('raise nvme.wr')."""
    log = MissLog(policies={"cpu": "lru"})
    key = b"k" * 16
    log.refused(key, "nvme")
    log.removed(key, "capacity", "cpu")
    log.lookup(b"n" * 16, [key], 0, 0, 0, set(), False)
    row = log.recent(1, namespaces={b"n" * 16: {"model_id": "m" * 200}})[0]
    assert row["reason"] == "dropped_by_admission" and len(row["hint"]) > 80
    out = _table([row])
    assert row["hint"] in out
    assert "raise nvme.write_budget_bytes_per_s if flash allows" in out
    assert "m" * 80 in out and "m" * 81 not in out   # a value column stays bounded
