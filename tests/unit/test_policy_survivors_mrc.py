"""Reading the live miss-ratio curve: refusals, interpolation edges, the sizes offered and
the doctor's thresholds (mutation review of kvtier.policy.mrc)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier import httpget
from kvtier.policy.mrc import (
    MAX_CAPACITY_BYTES,
    MAX_SCALE,
    LiveStatsError,
    capacity_of,
    curve_of,
    load_stats,
    plan_lines,
    predict,
    size_options,
    sizing_notes,
)
from kvtier.statsdoc import MalformedStats


def _doc(points: list[tuple[float, float]], cap: float = 2**30) -> dict[str, Any]:
    return {"tiers": {"cpu": {"capacity_bytes": cap}},
            "policy": {"tiers": {"cpu": {"mode": "lru", "switches": 0, "mrc": [
                {"scale": s, "hit_rate": h} for s, h in points]}}}}


def test_curve_of_sorts_the_points_by_scale() -> None:
    doc = _doc([(2.0, 0.4), (0.5, 0.2), (1.0, 0.3)])
    assert curve_of(doc, "cpu") == [(0.5, 0.2), (1.0, 0.3), (2.0, 0.4)]


@pytest.mark.parametrize("point, field", [
    ((0.0, 0.1), "scale"), ((-1.0, 0.1), "scale"), ((MAX_SCALE * 2, 0.1), "scale"),
    ((1.0, 1.2), "hit_rate"),
])
def test_curve_of_refuses_a_point_out_of_range(point: tuple[float, float], field: str) -> None:
    with pytest.raises(MalformedStats, match=f"mrc.{field}"):
        curve_of(_doc([point]), "cpu")


def test_curve_of_accepts_the_range_s_edges() -> None:
    assert curve_of(_doc([(MAX_SCALE, 1.0)]), "cpu") == [(MAX_SCALE, 1.0)]


def test_capacity_of_refuses_more_than_the_largest_capacity() -> None:
    with pytest.raises(MalformedStats, match="capacity_bytes"):
        capacity_of(_doc([], cap=MAX_CAPACITY_BYTES * 2), "cpu")
    assert capacity_of(_doc([], cap=MAX_CAPACITY_BYTES), "cpu") == MAX_CAPACITY_BYTES


def test_predict_at_a_repeated_scale_and_at_a_single_point() -> None:
    """A forged curve may repeat a scale (no division by a zero log-distance); a curve of
    the 1x point alone still says the hit rate now."""
    assert predict([(1.0, 0.3), (1.0, 0.3), (2.0, 0.5)], 1.0) == pytest.approx(0.3)
    assert predict([(1.0, 0.4)], 1.0) == 0.4
    assert predict([(1.0, 0.4)], 2.0) is None


def test_size_options_price_each_scale_at_its_bytes() -> None:
    opts = size_options(_doc([(0.5, 0.2), (1.0, 0.3), (4.0, 0.6)], cap=1000.0), "cpu")
    assert [(o.scale, o.capacity_bytes, o.hit_rate, o.current_hit_rate) for o in opts] == [
        (0.5, 500.0, 0.2, 0.3), (1.0, 1000.0, 0.3, 0.3), (4.0, 4000.0, 0.6, 0.3)]
    assert size_options(_doc([(1.0, 0.4)]), "cpu")[0].hit_rate == 0.4


def test_plan_lines_offer_other_sizes_only() -> None:
    lines = plan_lines(_doc([(0.5, 0.2), (1.0, 0.3), (2.0, 0.4)]))
    assert len(lines) == 2 and not any("(1x)" in ln for ln in lines)
    assert "512.0 MiB (0.5x) would lower" in lines[0]


def test_a_gain_of_exactly_the_threshold_is_a_too_small_tier() -> None:
    notes = sizing_notes(_doc([(1.0, 0.0), (2.0, 0.05)]))
    assert len(notes) == 1 and notes[0].startswith("cpu tier too small")
    assert "at 2.0 GiB its token hit rate would be 5.0% instead of 0.0%" in notes[0]


def test_a_tier_too_small_is_not_also_called_too_large() -> None:
    notes = sizing_notes(_doc([(0.5, 0.3), (1.0, 0.3), (2.0, 0.4)]))
    assert len(notes) == 1 and notes[0].startswith("cpu tier too small")


def test_a_loss_of_exactly_the_threshold_is_not_a_too_large_tier() -> None:
    assert sizing_notes(_doc([(0.5, 0.0), (1.0, 0.01)])) == []
    notes = sizing_notes(_doc([(0.5, 0.0), (1.0, 0.005)]))
    assert len(notes) == 1 and "at 512.0 MiB it would still hit 0.0%" in notes[0]


def test_a_tier_that_hits_nothing_is_not_called_too_large() -> None:
    """Halving a tier that hits nothing loses nothing, and says nothing about its size."""
    assert sizing_notes(_doc([(0.5, 0.0), (1.0, 0.0), (2.0, 0.0)])) == []


def test_load_stats_does_not_append_the_path_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    urls: list[str] = []

    def fake_get(url: str, deadline_s: float) -> bytes:
        urls.append(url)
        return b"{}"

    monkeypatch.setattr(httpget, "get", fake_get)
    assert load_stats("http://h:1/v1/stats") == {}
    assert load_stats("http://h:1/") == {}
    assert urls == ["http://h:1/v1/stats", "http://h:1/v1/stats"]


def test_load_stats_refuses_a_document_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(LiveStatsError, match="not a /v1/stats document"):
        load_stats(str(path))
