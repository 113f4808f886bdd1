"""Survivors of the request-handling mutation round against a real daemon: the control
server's connection handling (``kvtier.daemon.control``)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable

import numpy as np

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from kvtier.protocol import pack
from tests.support.daemon import DaemonProcess

LAYOUT = KVLayout(2, 2, 32, "float16", 64)
BB = LAYOUT.block_bytes


def test_a_writer_dropped_for_unread_replies_keeps_its_slots_quarantined(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """A client the daemon drops because it leaves its replies unread may still be writing
    into the put slots it leased (it maps the arena): they stay quarantined, counted as a
    dropped writer, until its process exits, never lent to another client meanwhile.
    Mutant that survived: the slow-reader drop did not mark the connection dropped, so its
    slots went straight back to the allocator while the writer could still write."""
    d = daemon_factory(cpu_bytes=str(16 * BB), nvme_bytes="0",
                       env={"KVTIER_DAEMON_READ_TIMEOUT_S": "1"}).start()
    c = connect(d.socket)
    try:
        ns = c.register_layout(LAYOUT, "m")
        lease = c.prepare_put(ns, block_keys(ns, np.arange(4 * 64)))
        assert sum(v is not None for v in lease.views) == 4
        deaf = c._sock
        deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stats = pack({"id": 2, "op": "stats"})   # a few KiB of reply each, never read
        with contextlib.suppress(OSError):       # the daemon stops reading, then drops us
            deaf.settimeout(0.3)
            for _ in range(2000):
                deaf.sendall(stats)
        deadline = time.monotonic() + 6
        while (st := d.stats())["daemon"]["dropped_writers"] != 1:
            assert time.monotonic() < deadline, st["daemon"]
            time.sleep(0.05)
        assert st["daemon"]["dropped_slow"] == 1
        assert st["leases"]["quarantined_slots"] == 4
    finally:
        c.close()


def test_the_stats_count_the_open_client_connections(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """``daemon.clients`` in the stats is the number of open control connections, and
    falls when one closes. Mutant that survived: it counted the dropped writers instead."""
    d = daemon_factory(nvme_bytes="0").start()
    first, second = connect(d.socket), connect(d.socket)
    try:
        assert d.stats()["daemon"]["clients"] == 2
        first.close()
        deadline = time.monotonic() + 5
        while (n := d.stats()["daemon"]["clients"]) != 1:
            assert time.monotonic() < deadline, n
            time.sleep(0.02)
    finally:
        first.close()
        second.close()
