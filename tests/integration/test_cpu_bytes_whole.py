"""A daemon's cpu tier serves the cpu.bytes it was given, not whole slabs of it: 127MiB
with 64 MiB slabs reported (and held) 64 MiB, with nothing in the log."""

from __future__ import annotations

from pathlib import Path

from tests.support.daemon import DaemonProcess


def test_cpu_bytes_not_a_multiple_of_the_slab_is_served_whole(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "kvd", cpu_bytes="127MiB", nvme_bytes="0") as d:
        cpu = d.stats()["tiers"]["cpu"]
    assert cpu["capacity_bytes"] == 127 * 2**20
