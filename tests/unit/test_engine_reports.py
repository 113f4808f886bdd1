"""Engines' reports (kvtier.daemon.engines): gauges of the live engines, counters kept as
daemon-lifetime totals that never fall when an engine disconnects or restarts."""

from __future__ import annotations

from kvtier.daemon.engines import EngineReports
from kvtier.daemon.metrics import scheme_counts
from kvtier.keys import KEY_SCHEME


def test_counters_add_what_they_grew_by_and_never_fall() -> None:
    reports = EngineReports()
    a: dict[str, float] = {}
    b: dict[str, float] = {}
    reports.report(a, {"loaded_blocks": 10, "running": 3, "context_tokens_p99": 900})
    reports.report(b, {"loaded_blocks": 4, "running": 2, "context_tokens_p99": 4000})
    reports.report(a, {"loaded_blocks": 15, "running": 1})
    assert reports.summary([a, b]) == {"engines": 2, "running": 3.0, "loaded_blocks": 19.0,
                                       "context_tokens_p99": 4000.0}
    # engine b disconnects: its gauges go, its counts stay
    assert reports.summary([a]) == {"engines": 1, "running": 1.0, "loaded_blocks": 19.0,
                                    "context_tokens_p99": 900.0}
    # engine a restarted (its counter starts again): all of the new count is added
    reports.report(a, {"loaded_blocks": 2})
    assert reports.summary([a])["loaded_blocks"] == 21.0


def test_an_engine_that_names_itself_is_counted_once_across_reconnects() -> None:
    """The connector's link reconnects after a timeout without the engine restarting: on
    the new connection, its cumulative counts added its whole history again (found by
    review). With its ``engine_id`` only the growth counts."""
    reports = EngineReports()
    first: dict[str, float] = {}
    reports.report(first, {"engine_id": "e1", "loaded_blocks": 100})
    again: dict[str, float] = {}                     # a new connection, the same engine
    reports.report(again, {"engine_id": "e1", "loaded_blocks": 110})
    assert reports.totals["loaded_blocks"] == 110.0
    other: dict[str, float] = {}
    reports.report(other, {"engine_id": "e2", "loaded_blocks": 5})
    assert reports.totals["loaded_blocks"] == 115.0
    # the old connection's last report, read after the new one's: stale, not a restart
    reports.report(first, {"engine_id": "e1", "loaded_blocks": 105})
    reports.report(again, {"engine_id": "e1", "loaded_blocks": 120})
    assert reports.totals["loaded_blocks"] == 125.0


def test_reports_take_finite_known_numbers_only() -> None:
    reports = EngineReports()
    e: dict[str, float] = {}
    reports.report(e, {"loaded_blocks": float("nan"), "saved_blocks": True, "running": "3",
                       "preemptions": 1e30, "unknown_name": 5, "waiting": -1})
    assert e == {"waiting": -1.0} and reports.totals == {}


def test_key_scheme_labels_are_bounded() -> None:
    got = scheme_counts({KEY_SCHEME: 3, "unknown": 1, "a" * 64: 1, "evil/1": 2})
    assert got == {KEY_SCHEME: 3, "unknown": 1, "other": 3}


def test_a_connector_report_gives_counters_as_floats_and_context_percentiles() -> None:
    from kvtier.connectors.vllm.report import engine_report

    values = engine_report({"loaded_blocks": 7}, iter([100, 300, 200]), running=3,
                           waiting=1, preemptions=2, prefill_tokens_per_s=1234.56)
    assert values["loaded_blocks"] == 7.0 and values["prefill_tokens_per_s"] == 1234.6
    assert (values["running"], values["waiting"], values["preemptions"]) == (3, 1, 2)
    assert values["context_tokens_p50"] == 200.0
    assert 200.0 < values["context_tokens_p99"] <= 300.0
    idle = engine_report({}, iter(()), running=0, waiting=0, preemptions=0,
                         prefill_tokens_per_s=0.0)
    assert idle["context_tokens_p50"] == idle["context_tokens_p99"] == 0.0
