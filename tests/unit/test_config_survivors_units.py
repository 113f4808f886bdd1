"""Mutation-review pins for kvtier.units and kvtier.argtypes: every size unit's scale, the
formatter's edge cases, and the inclusive/exclusive bounds of the CLI's number and URL types."""

from __future__ import annotations

import argparse
import math

import pytest

from kvtier.argtypes import float_in, http_url, int_in
from kvtier.errors import ConfigError
from kvtier.units import format_bytes, parse_size


@pytest.mark.parametrize(("unit", "scale"), [
    ("", 1), ("b", 1),
    ("k", 10**3), ("kb", 10**3), ("ki", 2**10), ("kib", 2**10),
    ("m", 10**6), ("mb", 10**6), ("mi", 2**20), ("mib", 2**20),
    ("g", 10**9), ("gb", 10**9), ("gi", 2**30), ("gib", 2**30),
    ("t", 10**12), ("tb", 10**12), ("ti", 2**40), ("tib", 2**40),
])
def test_every_size_unit_has_its_own_scale(unit: str, scale: int) -> None:
    """A unit mapped to the wrong scale (``Mi`` read as KiB, ``T`` as TiB) sizes a tier
    1024x (or 10%) off what the operator wrote, and nothing else would notice."""
    assert parse_size(f"3{unit}") == 3 * scale
    assert parse_size(f"3{unit.upper()}") == 3 * scale


def test_a_fractional_size_rounds_down_to_whole_bytes() -> None:
    """``0.1KiB`` is 102.4 bytes: the parser keeps whole bytes by truncating, never
    asking for more than was written (a ceiling would round every size up)."""
    assert parse_size("0.1KiB") == 102
    assert parse_size("1.9999KiB") == 2047


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_float_size_is_not_called_a_fraction(value: float) -> None:
    """An infinite or NaN size is refused as "not a size"; without the finiteness check it
    is still refused, but as "a fraction of a byte", which sends the operator the wrong way."""
    with pytest.raises(ConfigError) as info:
        parse_size(value)
    assert "fraction" not in str(info.value)


@pytest.mark.parametrize(("n", "kw", "text"), [
    (-(2**30), {}, "-1.0 GiB"),
    (-1536, {}, "-1.5 KiB"),
    (1.5 * 2**30, {"exact": True}, "1.5 GiB (1610612736 bytes)"),
    (2**30 - 1, {"digits": 0}, "1024 MiB"),
])
def test_format_bytes_negative_and_float_inputs(n: float, kw: dict[str, object],
                                                text: str) -> None:
    """A negative delta is shown in its unit (not as "-1073741824 B"), and the exact byte
    count of a float is a whole number (not "1610612736.0 bytes")."""
    assert format_bytes(n, **kw) == text  # type: ignore[arg-type]


# -- argtypes ---------------------------------------------------------------------------------
def test_int_in_includes_both_bounds() -> None:
    """``int_in(1, 10)`` means 1 to 10 inclusive: refusing the top value makes the
    documented maximum a usage error."""
    check = int_in(1, 10)
    assert check("1") == 1 and check(" 10 ") == 10
    for bad in ("0", "11", "1.5", "ten", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            check(bad)
    assert int_in(0)(str(2**40)) == 2**40    # no upper bound


def test_int_in_message_names_the_range() -> None:
    """The usage error says which range is wanted and what was given."""
    with pytest.raises(argparse.ArgumentTypeError, match=r"from 1 to 10, got '11'"):
        int_in(1, 10)("11")
    with pytest.raises(argparse.ArgumentTypeError, match=r"at least 2, got '1'"):
        int_in(2)("1")


def test_float_in_bounds_inclusive_and_exclusive() -> None:
    """``high`` is allowed, ``low`` only without ``above``; NaN and infinity never (a
    ``--watch inf`` would sleep forever)."""
    closed = float_in(0, 5)
    assert closed("0") == 0 and closed("5") == 5
    opened = float_in(0, 5, above=True)
    assert opened("5") == 5 and opened("0.001") == 0.001
    for check, bad in ((closed, "5.0001"), (closed, "-0.1"), (opened, "0"),
                       (opened, "nan"), (float_in(0), "inf"), (closed, "x")):
        with pytest.raises(argparse.ArgumentTypeError):
            check(bad)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8470", "https://node7:443",
                                 "http://[::1]:8470", "https://example.org"])
def test_http_url_accepts_http_and_https(url: str) -> None:
    """A TLS front (``https://``) is a daemon address like any other."""
    assert http_url(url) == url


@pytest.mark.parametrize("url", ["http://:8470", "https://", "ftp://host:21", "host:8470",
                                 "http://host:0", "http://host:99999"])
def test_http_url_refuses_no_host_bad_scheme_or_port(url: str) -> None:
    """A URL without a host would be dialled as nothing and reported as "no daemon
    answered"; it must be a usage error instead."""
    with pytest.raises(argparse.ArgumentTypeError):
        http_url(url)
