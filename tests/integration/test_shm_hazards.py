"""The shared-memory directory is shared with every local user and every other process:
what they do there must not stop, hang or kill the daemon.

- a tmpfs too small for the arena's companions (presence filter, journal): they are
  allocated up front, so the daemon serves without them (one warning each) instead of
  dying of SIGBUS on the first write into an untouched page, start after start;
- a FIFO planted by another user under a name the daemon opens at start (another data
  directory's stable arena, this one's journal): skipped, never a start blocked forever;
- a SIGTERM while a client holds a put lease: a clean stop, no traceback.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from kvtier.tiers.arena import journal_path, stable_arena_name
from tests.support.daemon import SHM, DaemonProcess
from tests.support.small_fs import small_tmpfs

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16",
                  tokens_per_block=16)   # 8 KiB blocks


def content(key: bytes) -> np.ndarray:
    return np.frombuffer((key * (LAYOUT.block_bytes // 16)), dtype=np.uint8)


def store_and_check(d: DaemonProcess, first_chain: int, chains: int) -> int:
    """Store ``chains`` chains of 8 blocks (far more than the 4 MiB arena holds, so it
    evicts and reuses every slot) and read the last one back exactly; blocks stored."""
    with connect(d.socket, timeout=10) as c:
        ns = c.register_layout(LAYOUT, "m")
        stored = 0
        for ch in range(first_chain, first_chain + chains):
            tokens = np.arange(ch * 1000, ch * 1000 + 8 * 16, dtype=np.uint32)
            keys = block_keys(ns, tokens)
            stored += c.put(ns, keys, [content(k) for k in keys])
        out = [np.empty(LAYOUT.block_bytes, np.uint8) for _ in keys]
        assert c.get(ns, keys, out) == len(keys)
        assert [o.tobytes() for o in out] == [content(k).tobytes() for k in keys]
    return stored


def test_a_tmpfs_too_small_for_the_presence_filter_and_journal_costs_them_not_the_daemon(
        tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "shm", 6 * 2**20) as shm:
        d = DaemonProcess(tmp_path / "d", cpu_bytes="4MiB", nvme_bytes="0",
                          extra_args=["--cpu-shm-dir", str(shm)])
        try:
            for attempt in range(2):   # a restart on the same directory serves as well
                d.start()
                assert store_and_check(d, 5000 * attempt, 200) > 1000
                assert d.proc is not None and d.proc.poll() is None
                d.crash()
            log = d.log()
            assert "no presence filter" in log and "No space left on device" in log
            assert "Traceback" not in log
        finally:
            d.kill()
            for f in shm.iterdir():
                f.unlink()


@pytest.mark.parametrize("where", ["another data dir's arena", "this data dir's journal"])
def test_a_fifo_planted_in_shm_does_not_block_the_start(tmp_path: Path, where: str) -> None:
    d = DaemonProcess(tmp_path / "d", cpu_bytes="4MiB", nvme_bytes="0")
    if where.endswith("arena"):
        fifo = SHM / f"kvtier-{os.getuid()}-d{os.urandom(8).hex()}.arena"
    else:
        fifo = journal_path(SHM / stable_arena_name(d.data_dir))
    os.mkfifo(fifo, 0o600)
    try:
        if os.getuid() == 0:
            os.chown(fifo, 65534, 65534)   # another user's
        t0 = time.monotonic()
        d.start(timeout=20)
        assert time.monotonic() - t0 < 20
        assert store_and_check(d, 0, 2) == 16
        assert fifo.exists()   # another user's file: left alone
    finally:
        d.kill()
        fifo.unlink(missing_ok=True)


def test_a_stop_while_a_put_lease_is_open_is_clean(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d", cpu_bytes="4MiB", nvme_bytes="0")
    d.start()
    try:
        with connect(d.socket, timeout=10) as c:
            ns = c.register_layout(LAYOUT, "m")
            keys = block_keys(ns, np.arange(4 * 16, dtype=np.uint32))
            lease = c.prepare_put(ns, keys)
            assert len(lease.views) == 4
            assert d.terminate() == 0
        log = d.log()
        assert "Traceback" not in log and "Unhandled exception" not in log, log[-3000:]
    finally:
        d.kill()
