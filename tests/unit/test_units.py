"""kvtier.units: the one byte formatter and the size type of the config tree."""

from __future__ import annotations

import pytest

from kvtier.units import ByteSize, format_bytes, parse_size


@pytest.mark.parametrize(("n", "kw", "text"), [
    (0, {}, "0 B"), (1023, {}, "1023 B"), (1024, {}, "1.0 KiB"), (1536 * 2**20, {}, "1.5 GiB"),
    (2**40, {}, "1.0 TiB"), (2**50, {}, "1024.0 TiB"), (2**20, {"digits": 2}, "1.00 MiB"),
    (3 * 2**30, {"digits": 2, "exact": True}, "3.00 GiB (3221225472 bytes)"),
])
def test_format_bytes(n: int, kw: dict[str, object], text: str) -> None:
    assert format_bytes(n, **kw) == text  # type: ignore[arg-type]


def test_byte_size_is_an_int() -> None:
    size = ByteSize(parse_size("4KiB"))
    assert size == 4096 and isinstance(size, int) and size + 1 == 4097
