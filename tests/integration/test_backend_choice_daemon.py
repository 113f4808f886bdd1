"""A real daemon process reports the hardware backends it chose, or refuses to start with the
reason: the nvme I/O backend in stats and ``kvtier stats``, a forced kvikio or an enabled HBM
pool on a host without the library or the device. (Moved from the unit tests: these start
processes.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.tiers.hbm import hbm_available
from kvtier.tiers.nvme.backends import select_nvme_backend
from tests.support.daemon import DaemonProcess


def test_real_daemon_shows_the_backend_in_stats_and_refuses_forced_kvikio(
        tmp_path: Path) -> None:
    here = select_nvme_backend("auto")
    d = DaemonProcess(tmp_path / "a").start()
    try:
        nvme = d.stats()["tiers"]["nvme"]
        assert nvme["io_backend"] == here.name
        assert nvme["io_backend_reason"] == here.reason
        table = subprocess.run([sys.executable, "-m", "kvtier.cli", "stats", "--url",
                                d.http_url], capture_output=True, text=True, timeout=30)
        assert table.returncode == 0 and nvme["backend"] in table.stdout
    finally:
        d.kill()
    if here.name == "kvikio":
        pytest.skip("this host can run kvikio: forcing it would succeed")
    bad = DaemonProcess(tmp_path / "b", env={"KVTIER_NVME_BACKEND": "kvikio"})
    with pytest.raises(RuntimeError):
        bad.start(timeout=20)
    assert "nvme.backend = kvikio but" in bad.log()


def test_real_daemon_with_hbm_enabled_fails_with_the_reason(tmp_path: Path) -> None:
    ok, why = hbm_available(0)
    if ok:
        pytest.skip("this host has a usable GPU: the daemon would start")
    d = DaemonProcess(tmp_path, env={"KVTIER_HBM_ENABLED": "1", "KVTIER_HBM_BYTES": "1GiB"})
    with pytest.raises(RuntimeError):
        d.start(timeout=20)
    assert f"kvtier: hbm.enabled needs a CUDA device: {why}" in d.log()
