"""Byte sizes: parsing (``4GiB``, ``512MB``, ``1e9``) and the one formatter of the package.

``ByteSize`` is the config tree's type for sizes: the converter parses a field by its type
(never by its name), so a new size setting needs only the annotation.
"""

from __future__ import annotations

import math
import re

from kvtier.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "ki": 2**10, "kib": 2**10,
          "m": 10**6, "mb": 10**6, "mi": 2**20, "mib": 2**20, "g": 10**9, "gb": 10**9,
          "gi": 2**30, "gib": 2**30, "t": 10**12, "tb": 10**12, "ti": 2**40, "tib": 2**40}
_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


class ByteSize(int):
    """A number of bytes (>= 0); written in config as an int or ``4GiB`` / ``512MB`` / ``1e9``."""

    __slots__ = ()


def parse_size(value: object) -> int:
    """Parse ``4GiB`` / ``512MB`` / ``1e9`` / an int into bytes (ConfigError otherwise)."""
    if isinstance(value, bool):
        raise ConfigError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"size must be >= 0, got {value}")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"not a size: {value!r}")
        if not value.is_integer():
            raise ConfigError(_fraction(value))
        return parse_size(int(value))
    m = _SIZE_RE.match(str(value))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ConfigError(f"not a size: {value!r} (examples: 4GiB, 512MiB, 1e9; units go up "
                          "to TiB and TB, so 1PiB is 1024TiB)")
    scale = _UNITS[(m.group(2) or "").lower()]
    number = float(m.group(1)) * scale
    if not math.isfinite(number):  # "1e999": int(inf) would raise OverflowError
        raise ConfigError(f"size out of range: {value!r}")
    if scale == 1 and not number.is_integer():   # "1.5" was read as 1 byte ("1.5GiB" is fine)
        raise ConfigError(_fraction(value))
    return int(number)


def _fraction(value: object) -> str:
    return (f"not a size: {value!r} is a fraction of a byte; give whole bytes or a unit "
            "(1.5GiB, 512MiB)")


def format_bytes(n: float, *, digits: int = 1, exact: bool = False) -> str:
    """``n`` bytes in the largest binary unit it reaches (``1.5 GiB``, ``512 B``).

    ``digits``: decimals for units above bytes; ``exact``: append ``(N bytes)`` for messages
    where the precise number matters (a startup error that compares two sizes).
    """
    text = f"{n:.0f} B"
    for unit, scale in _BINARY:
        if abs(n) >= scale:
            text = f"{n / scale:.{digits}f} {unit}"
            break
    return f"{text} ({int(n)} bytes)" if exact else text
