"""Fixtures shared by unit test modules; they live in tests/support (this only registers
them): the TieredStore bench (``clock``, ``arena``, ``nvme``, ``store``, ``client``)."""

from tests.support.store import arena, client, clock, nvme, store  # noqa: F401
