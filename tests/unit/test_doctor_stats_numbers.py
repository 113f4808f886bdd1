"""Numbers of a ``/v1/stats`` answer (kvtier.statsdoc.number, read by ``kvtier doctor
--stats`` and ``kvtier stats``): NaN, an infinity (JSON's 1e400) or a negative count is a
broken or forged answer, refused naming the field, as the engine metrics reader refuses
them. A capacity of -5 used to give a "-200% used" finding, 1e400 a healthy tier."""

from __future__ import annotations

import json

import pytest

from kvtier.cli import render_stats
from kvtier.doctor.errors import DoctorError
from kvtier.doctor.stats import parse_stats
from kvtier.statsdoc import MalformedStats, number


@pytest.mark.parametrize(("text", "said"), [
    ('{"tiers": {"cpu": {"capacity_bytes": -5, "used_bytes": 10}}}',
     "tiers.cpu.capacity_bytes is -5, not a finite number >= 0"),
    ('{"tiers": {"cpu": {"capacity_bytes": 1e400, "used_bytes": 1e400, "up": true}}}',
     "tiers.cpu.capacity_bytes is inf"),
    ('{"tiers": {"cpu": {"capacity_bytes": 10, "used_bytes": NaN}}}',
     "tiers.cpu.used_bytes is nan"),
    ('{"daemon": {"uptime_s": -Infinity}}', "daemon.uptime_s is -inf"),
    ('{"connector": {"running": -3}}', "connector.running is -3"),
    ('{"tiers": {"cpu": {"evictions": {"capacity": -1}}}}',
     "tiers.cpu.evictions.capacity is -1"),
])
def test_doctor_refuses_numbers_that_are_not_finite_and_not_negative(text: str,
                                                                     said: str) -> None:
    with pytest.raises(DoctorError, match="is not kvtier stats") as err:
        parse_stats(text, "s.json")
    assert said in str(err.value)


def test_finite_non_negative_numbers_are_read() -> None:
    s = parse_stats('{"tiers": {"cpu": {"capacity_bytes": 100, "used_bytes": 0}}}', "s.json")
    assert s.tiers["cpu"].capacity_bytes == 100 and s.tiers["cpu"].used_share == 0


def test_number_and_the_stats_table() -> None:
    assert number({"x": 0}, "x") == 0 and number({}, "x") == 0
    assert number({"x": -2}, "x", negative_ok=True) == -2
    with pytest.raises(MalformedStats, match="x is inf"):
        number({"x": float("inf")}, "x", negative_ok=True)
    doc = json.loads('{"tiers": {"cpu": {"capacity_bytes": 1e400}}}')
    with pytest.raises(MalformedStats, match=r"tiers\.cpu\.capacity_bytes is inf"):
        render_stats(doc)
