"""Reservations of running prepares (kvtier.daemon.inflight): held for the block's length,
given back however it ends, kept per process."""

from __future__ import annotations

import pytest

from kvtier.daemon.inflight import InFlight, Reserved


def test_a_reservation_is_held_while_its_prepare_runs_and_given_back_after() -> None:
    f = InFlight()
    with f.reserve(7, put_bytes=100):
        with f.reserve(7, get_bytes=30):
            assert f.of(7) == Reserved(put_bytes=100, get_bytes=30, leases=2)
            assert f.of(8) == Reserved()   # per process
        assert f.of(7) == Reserved(put_bytes=100, leases=1)
    assert f.of(7) == Reserved()
    assert not f._by_process   # nothing kept for a process with no prepare running


def test_a_failed_prepare_gives_its_reservation_back() -> None:
    f = InFlight()
    with pytest.raises(RuntimeError), f.reserve(3, put_bytes=5):
        raise RuntimeError("the store refused")
    assert f.of(3) == Reserved()
    f.of(3).put_bytes = 99   # a copy: the caller cannot change what is reserved
    assert f.of(3) == Reserved()
