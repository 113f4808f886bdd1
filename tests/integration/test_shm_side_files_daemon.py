"""A real daemon and ``kvtier doctor --env`` on a tmpfs sized for cpu.bytes only: the
presence filter and journal do not fit. The start says so up front, the presence warning
names the fix for a full tmpfs, doctor warns, and a graceful stop leaves nothing in the
tmpfs (the failed ``.presence`` file used to stay)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.daemon import DaemonProcess
from tests.support.serve import serve_env
from tests.support.small_fs import small_tmpfs

MiB = 2**20


def test_a_tmpfs_sized_for_cpu_bytes_only(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "shm", 64 * MiB) as shm:
        (tmp_path / "k.toml").write_text(
            f'[daemon]\ndata_dir = "{tmp_path / "d" / "data"}"\n'
            f'socket = "{tmp_path / "d" / "s.sock"}"\n'
            f'[cpu]\nbytes = "63MiB"\nshm_dir = "{shm}"\n[nvme]\nbytes = "0"\n')
        doc = subprocess.run([sys.executable, "-m", "kvtier.cli", "doctor", "--env",
                              "--no-daemon", "--json", "--config", str(tmp_path / "k.toml")],
                             env=serve_env(), capture_output=True, text=True, timeout=60)
        row = next(c for c in json.loads(doc.stdout)["checks"] if c["name"] == "shm size")
        assert row["verdict"].lower() == "warn", row
        assert "presence filter and journal" in row["detail"]
        d = DaemonProcess(tmp_path / "d", cpu_bytes="63MiB", nvme_bytes="0",
                          extra_args=["--cpu-shm-dir", str(shm)])
        try:
            d.start()
            assert d.terminate() == 0
        finally:
            if d.proc is not None and d.proc.poll() is None:
                d.kill()
        log = d.log()
        assert "room for the cpu tier's arena (cpu.bytes 63" in log, log
        assert "no presence filter" in log and "free space in the shared-memory" in log
        assert "remove that file" not in log
        assert sorted(p.name for p in shm.iterdir()) == []
