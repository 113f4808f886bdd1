"""SIGKILL the daemon while clients write; every durable put survives with exact bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvtier.client import connect
from kvtier.keys import block_keys
from tests.support.chains import LAYOUT, content
from tests.support.daemon import DaemonProcess

WRITER = r"""
import sys, numpy as np
from kvtier.client import connect
from kvtier.errors import KVTierError
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.chains import content
sock, first, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
layout = KVLayout(2, 2, 32, "float16", 64)
c = connect(sock)
ns = c.register_layout(layout, "m")
with open(log, "a", buffering=1) as out:
    for i in range(100000):
        keys = block_keys(ns, np.arange(first + i * 256, first + (i + 1) * 256))
        try:
            n = c.put(ns, keys, [content(k) for k in keys], durable=True)
        except KVTierError:
            break
        if n == len(keys):
            out.write("".join(k.hex() + "\n" for k in keys))  # only after the ack
"""


# these tests are about what survives a kill, not prefetch deadlines: a get waits for its
# nvme reads (on a loaded machine the default deadline can pass before the first read
# lands, and the get returns the blocks read by then: a short count, not lost blocks)
WAIT_FOR_READS = {"KVTIER_POLICY_PREFETCH_WAIT": "wait"}


def test_sigkill_mid_write_loses_no_acknowledged_block(daemon_factory, tmp_path: Path) -> None:
    d: DaemonProcess = daemon_factory(cpu_bytes="8MiB", nvme_bytes="256MiB",
                                      env=WAIT_FOR_READS).start()
    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(d.socket),
                                 str(i * 10_000_000), str(log)], env=env,
                                stderr=subprocess.DEVNULL)
               for i, log in enumerate(logs)]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # let them write a good amount first
        if sum(len(log.read_text()) if log.exists() else 0 for log in logs) > 33 * 300:
            break
        time.sleep(0.05)
    d.kill()  # SIGKILL while writers are mid-put
    for w in writers:
        w.wait(30)
    acked = [bytes.fromhex(line) for log in logs for line in log.read_text().split()]
    assert len(acked) >= 300, "writers acknowledged too few blocks before the kill"

    d.start()  # same data directory
    stats = d.stats()
    assert stats["tiers"]["nvme"]["blocks"] >= len(acked)
    c = connect(d.socket)
    ns = c.register_layout(LAYOUT, "m")
    for i in range(0, len(acked), 64):
        chunk = acked[i: i + 64]
        res = c.lookup(ns, chunk, prefetch=False)
        assert res.hits == len(chunk)
        assert set(res.tiers) == {"nvme"}
    # read every acknowledged block back (through the 8 MiB arena, in chunks)
    for i in range(0, len(acked), 64):
        chunk = acked[i: i + 64]
        outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in chunk]
        assert c.get(ns, chunk, outs) == len(chunk)
        for k, out in zip(chunk, outs, strict=True):
            assert np.array_equal(out, content(k)), f"wrong bytes for {k.hex()}"
    # nothing the daemon returns is ever wrong, acknowledged or not: also read the batches
    # that were in flight at the kill (their frames may be torn: then they must be misses)
    per_writer = [len(log.read_text().split()) // 4 for log in logs]
    for i, done in enumerate(per_writer):
        first = i * 10_000_000
        for b in range(done, done + 3):
            keys = block_keys(ns, np.arange(first + b * 256, first + (b + 1) * 256))
            outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
            n = c.get(ns, keys, outs)
            for k, out in zip(keys[:n], outs[:n], strict=True):
                assert np.array_equal(out, content(k)), f"wrong bytes for {k.hex()}"


def test_torn_frames_are_dropped_not_returned(daemon_factory) -> None:
    d: DaemonProcess = daemon_factory(cpu_bytes="8MiB", nvme_bytes="64MiB",
                                      env=WAIT_FOR_READS).start()
    c = connect(d.socket)
    ns = c.register_layout(LAYOUT, "m")
    keys = block_keys(ns, np.arange(64 * 20))
    assert c.put(ns, keys, [content(k) for k in keys], durable=True) == 20
    c.close()
    d.kill()
    # corrupt: flip a payload byte of one slot, truncate the file inside the last slot
    files = sorted((d.data_dir / "nvme").glob("slots-*.dat"))
    assert files
    f = files[0]
    stride = 4096 + LAYOUT.block_bytes
    with open(f, "r+b") as fh:
        fh.seek(2 * stride + 4096 + 100)
        b = fh.read(1)
        fh.seek(2 * stride + 4096 + 100)
        fh.write(bytes([b[0] ^ 0xFF]))
    size = f.stat().st_size
    os.truncate(f, size - 1000)
    d.start()
    c = connect(d.socket)
    ns = c.register_layout(LAYOUT, "m")
    outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
    n = c.get(ns, keys, outs)
    for k, out in zip(keys[:n], outs[:n], strict=True):
        assert np.array_equal(out, content(k))
    # the corrupt block 2 stops the chain: blocks 0 and 1 come back, block 2 is dropped
    assert n == 2
    stats = c.stats()
    assert stats["tiers"]["nvme"]["checksum_failures"] >= 1
    assert c.lookup(ns, keys).hits == 2
