"""Stalled, dropped and greedy writers against a real daemon: a client the daemon drops may
still be writing into the slots it leased, so they stay quarantined until its process exits;
one client process holds at most its share of the arena for writing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.client import connect
from kvtier.errors import LeaseExpired
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

LAYOUT = KVLayout(2, 2, 32, "float16", 64)
BB = LAYOUT.block_bytes

# A writer in its own process: leases ``n`` blocks and prints its lease's slot count; on
# "drop" it breaks the protocol (the daemon closes its connection), on "write" it writes
# 0xEE into the slots it leased (as a stalled writer resuming would), on "exit" it leaves.
WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from kvtier.client import connect
    from kvtier.keys import block_keys
    from kvtier.layout import KVLayout
    c = connect(sys.argv[1])
    ns = c.register_layout(KVLayout(2, 2, 32, "float16", 64), "m", cache_salt="writer")
    lease = c.prepare_put(ns, block_keys(ns, np.arange(int(sys.argv[2]) * 64)))
    views = [v for v in lease.views if v is not None]
    print(len(views), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "drop":
            c._sock.sendall(b"\\x00\\x00\\x00\\x05\\xc1\\xc1\\xc1\\xc1\\xc1")
        elif cmd == "write":
            for v in views:
                v[:] = 0xEE
        elif cmd == "exit":
            break
        print("done", flush=True)
""")


class Writer:
    """The writer process, driven a line at a time."""

    def __init__(self, socket: Path, blocks: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER, str(socket), str(blocks)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.slots = int(self.proc.stdout.readline())

    def do(self, cmd: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        if cmd != "exit":
            assert self.proc.stdout.readline().strip() == "done"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _daemon(tmp_path: Path, blocks: int, **env: str) -> DaemonProcess:
    return DaemonProcess(tmp_path / "d", cpu_bytes=str(blocks * BB), nvme_bytes="0",
                         env={f"KVTIER_DAEMON_{k.upper()}": v for k, v in env.items()}).start()


def _victim_blocks(c: Any, n: int, salt: str = "victim") -> tuple[Any, list[bytes],
                                                                    list[np.ndarray]]:
    ns = c.register_layout(LAYOUT, "m", cache_salt=salt)
    keys = block_keys(ns, np.arange(10_000, 10_000 + n * 64))
    data = [np.full(BB, (0x11 * (i + 1)) & 0x7F, np.uint8) for i in range(n)]
    return ns, keys, data


def _exact(c: Any, ns: Any, keys: list[bytes], data: list[np.ndarray]) -> int:
    """How many of the victim's blocks come back; every one that does must be exact."""
    outs = [np.zeros(BB, np.uint8) for _ in keys]
    n = c.get(ns, keys, outs)
    for got, want in zip(outs[:n], data[:n], strict=True):
        assert np.array_equal(got, want), "a victim's block came back with wrong bytes"
    return int(n)


def test_an_idle_writer_holding_quarantined_slots_is_not_dropped(tmp_path: Path) -> None:
    d = _daemon(tmp_path, 16, lease_ttl_s="1", idle_timeout_s="2", client_put_share="1",
                client_get_share="1")
    try:
        w = connect(d.socket)
        ns = w.register_layout(LAYOUT, "m", cache_salt="writer")
        lease = w.prepare_put(ns, block_keys(ns, np.arange(4 * 64)))
        time.sleep(3.5)   # stalled past its lease (quarantined) and past the idle timeout
        st = d.stats()
        assert st["daemon"]["dropped_idle"] == 0
        assert st["leases"]["quarantined_slots"] == 4
        v = connect(d.socket)
        vns, vkeys, vdata = _victim_blocks(v, 12)
        assert v.put(vns, vkeys, vdata) == 12   # the rest of the arena
        for view in lease.views:    # the writer resumes: its slots are still its own
            assert view is not None
            view[:] = 0xEE
        assert _exact(v, vns, vkeys, vdata) == 12
        w.close()   # the writer's own close ends the quarantine
        deadline = time.monotonic() + 5
        while d.stats()["leases"]["quarantined_slots"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.stats()["leases"]["quarantined_slots"] == 0
        v.close()
    finally:
        d.kill()


def test_a_dropped_writer_keeps_its_slots_until_its_process_exits(tmp_path: Path) -> None:
    d = _daemon(tmp_path, 16, client_put_share="1",
                client_get_share="1")
    writer = Writer(d.socket, 4)
    try:
        assert writer.slots == 4
        writer.do("drop")   # the daemon closes its connection: the writer may go on writing
        deadline = time.monotonic() + 5
        while d.stats()["daemon"]["dropped_writers"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        st = d.stats()
        assert st["daemon"]["dropped_writers"] == 1
        assert st["leases"]["quarantined_slots"] == 4
        with connect(d.socket) as v:
            vns, vkeys, vdata = _victim_blocks(v, 16)
            assert v.put(vns, vkeys, vdata) == 12   # the writer's 4 slots are not lent
            writer.do("write")
            assert _exact(v, vns, vkeys, vdata) == 12
            writer.do("exit")
            writer.proc.wait(10)
            deadline = time.monotonic() + 5
            while d.stats()["leases"]["quarantined_slots"] and time.monotonic() < deadline:
                time.sleep(0.05)
            st = d.stats()
            assert st["leases"]["quarantined_slots"] == 0
            assert st["daemon"]["dropped_writers"] == 0
            more = block_keys(vns, np.arange(90_000, 90_000 + 4 * 64))
            assert v.put(vns, more, vdata[:4]) == 4   # the slots are lent again
    finally:
        writer.close()
        d.kill()


def test_one_process_holds_at_most_its_share_of_the_arena_for_writing(
        tmp_path: Path) -> None:
    d = _daemon(tmp_path, 16, client_put_share="0.5")
    hog = Writer(d.socket, 16)   # asks for the whole arena, never commits
    try:
        assert hog.slots == 8
        assert d.stats()["daemon"]["capped_puts"] == 1
        with connect(d.socket) as v:   # another process still stores and loads
            vns, vkeys, vdata = _victim_blocks(v, 8)
            assert v.put(vns, vkeys, vdata) == 8
            assert _exact(v, vns, vkeys, vdata) == 8
    finally:
        hog.close()
        d.kill()


def test_a_late_commit_ends_its_quarantine_and_the_process_stores_again(
        tmp_path: Path) -> None:
    """A writer that stalled past its lease learns it at commit; the commit says its copy
    is over, so the slots go back then, not when the connection closes, and its
    process's later puts are not held to a share spent on slots it no longer writes."""
    d = _daemon(tmp_path, 16, lease_ttl_s="0.5", lease_sweep_s="0.05",
                client_put_share="0.5")
    try:
        with connect(d.socket) as c:
            ns = c.register_layout(LAYOUT, "m")
            for r in range(2):   # two stalls, 4 blocks each: the process's whole share
                lease = c.prepare_put(ns, block_keys(ns, np.arange(4 * 64) + 1000 * (r + 1)))
                time.sleep(1.0)
                with pytest.raises(LeaseExpired):
                    lease.commit()
            assert d.stats()["leases"]["quarantined_slots"] == 0
            vns, vkeys, vdata = _victim_blocks(c, 4)
            assert c.put(vns, vkeys, vdata) == 4
            assert _exact(c, vns, vkeys, vdata) == 4
    finally:
        d.kill()
