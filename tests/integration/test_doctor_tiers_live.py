"""`kvtier doctor` on a real daemon's /v1/stats: a full cpu tier pinned by get leases, on
which every put fails to allocate, is pattern 9, and a Redis tier whose server was killed
is pattern 10. Doctor called both "healthy" (exit 0) before: pattern 5 looks only below
80% used, and no rule read a tier's ``up``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvtier.client import connect
from kvtier.doctor.rules import Pattern
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import RedisServer

LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=64, dtype="float16",
                  tokens_per_block=64)                      # 1 MiB blocks
ARENA_BLOCKS = 8


def snapshot(daemon: DaemonProcess, path: Path) -> str:
    path.write_text(json.dumps(daemon.stats()))
    return str(path)


def doctor(*stats: str) -> tuple[int, list[str]]:
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "doctor", "--stats", *stats,
                          "--interval", "5", "--json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode in (0, 1), out.stderr
    return out.returncode, [f["pattern"] for f in json.loads(out.stdout)["findings"]]


def test_doctor_names_a_pinned_full_tier_and_a_tier_that_is_down(
        tmp_path: Path, redis_server: RedisServer) -> None:
    daemon = DaemonProcess(tmp_path / "kvd", cpu_bytes=f"{ARENA_BLOCKS}MiB", nvme_bytes="0",
                           extra_args=["--redis-url", redis_server.url],
                           env={"KVTIER_DAEMON_CLIENT_GET_SHARE": "0",
                                "KVTIER_DAEMON_CLIENT_PUT_SHARE": "0"}).start()
    try:
        with connect(daemon.socket) as c:
            ns = c.register_layout(LAYOUT, "pinned-model")
            buf = np.full(LAYOUT.block_bytes, 3, np.uint8)
            held = block_keys(ns, np.arange(ARENA_BLOCKS * 64))
            assert c.put(ns, held, [buf] * len(held)) == ARENA_BLOCKS
            before = snapshot(daemon, tmp_path / "stats-0.json")
            assert doctor(before, snapshot(daemon, tmp_path / "idle.json")) == (0, [])
            lease = c.prepare_get(ns, held)                  # every block pinned
            try:
                for i in range(1, 6):
                    more = block_keys(ns, np.arange(10**6 * i, 10**6 * i + 64))
                    assert c.put(ns, more, [buf]) == 0       # no room: nothing can go
            finally:
                lease.release()
            pinned = snapshot(daemon, tmp_path / "stats-1.json")
        stats = json.loads(Path(pinned).read_text())["tiers"]["cpu"]
        assert stats["allocation_failures"] >= 5 and stats["used_bytes"] == stats[
            "capacity_bytes"]
        assert doctor(before, pinned) == (1, [Pattern.TIER_PINNED.value])

        redis_server.kill()
        deadline = time.monotonic() + 30
        while daemon.stats()["tiers"]["redis"]["up"] and time.monotonic() < deadline:
            time.sleep(0.2)
        down = snapshot(daemon, tmp_path / "stats-2.json")
        assert doctor(pinned, down) == (1, [Pattern.TIER_DOWN.value])
    finally:
        daemon.terminate()
