"""What connected engines report (``report_engine``): the live engines' gauges, and their
counters kept for the daemon's life.

An engine reports cumulative counters (blocks loaded and saved, saves dropped,
preemptions...). Summed over the engines connected at a scrape, they fell whenever an
engine disconnected and were exported as gauges, so no ``rate()`` could be taken of them.
Each report now adds what a counter grew by since that engine's last report (all of it
after an engine restart) to a total that only grows: ``kvtier_engine_<name>_total``. An
engine names itself (``engine_id``, fixed for its life), so a connection it opens again
after a timeout does not count its whole history twice; one that does not is counted
per connection.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["COUNTERS", "GAUGES", "EngineReports"]

GAUGES = ("running", "waiting", "context_tokens_p50", "context_tokens_p99",
          "saves_in_flight_bytes", "prefill_tokens_per_s")
"""Values of the moment: summed over the live engines (percentiles: their maximum)."""
COUNTERS = ("preemptions", "requests_finished", "load_errors",
            "skipped_slower_than_recompute", "skipped_tokens_slower_than_recompute",
            "dropped_saves", "dropped_save_bytes", "loaded_blocks", "saved_blocks",
            "redis_sync_gave_up", "producer_save_waits_timed_out", "withdrawn_saves",
            "lookups_without_round_trip", "lookups_prefix_read_off")
"""Cumulative per engine: kept as daemon-lifetime totals."""
_MAXED = frozenset(("context_tokens_p50", "context_tokens_p99"))
_LIMIT = 1e18
MAX_ENGINES = 4096     # engines whose last counts are remembered past their connection
MAX_ENGINE_ID = 64


@dataclass(slots=True)
class EngineReports:
    totals: dict[str, float] = field(default_factory=dict)
    _last: OrderedDict[str, dict[str, float]] = field(default_factory=OrderedDict)

    def report(self, engine: dict[str, float], msg: Mapping[str, Any]) -> None:
        """Take one report of a connection (``engine``: what it reported last)."""
        counted = engine
        engine_id = msg.get("engine_id")
        named = False
        if isinstance(engine_id, str) and 0 < len(engine_id) <= MAX_ENGINE_ID:
            named = True
            counted = self._last.pop(engine_id, {})
            self._last[engine_id] = counted          # the most recent last
            if len(self._last) > MAX_ENGINES:
                self._last.popitem(last=False)
        for name in (*GAUGES, *COUNTERS):   # finite numbers only: /v1/stats stays JSON
            value = msg.get(name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or \
                    not math.isfinite(value) or abs(value) >= _LIMIT:
                continue
            value = float(value)
            if name in COUNTERS and value >= 0:
                before = counted.get(name, 0.0)
                # a fall: a restarted engine, unless it is named (a new one has a new id:
                # then it is a stale report, read late)
                grew = value - before if value >= before else (0.0 if named else value)
                self.totals[name] = min(self.totals.get(name, 0.0) + grew, _LIMIT)
                counted[name] = max(value, before) if named else value
            engine[name] = value

    def summary(self, engines: Iterable[dict[str, float]]) -> dict[str, float]:
        """The /v1/stats ``connector`` section: engines reporting, gauges, totals."""
        out: dict[str, float] = {"engines": 0}
        for engine in engines:
            if not engine:
                continue
            out["engines"] += 1
            for name in GAUGES:
                if name in engine:
                    value = engine[name]
                    out[name] = max(out.get(name, 0.0), value) if name in _MAXED else (
                        out.get(name, 0.0) + value)
        out.update(self.totals)
        return out
