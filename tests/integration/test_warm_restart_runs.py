"""A warm start adopts only the arena of the data directory's last run.

kill -9 leaves the arena for the next start. When that start does not adopt it (warm
restart off, or another shared-memory directory) and serves, it stores new bytes under the
old keys and deletes blocks; the arena it left alone is stale from then on. Before, the
next warm start adopted it anyway: it served the old bytes over the new ones and brought
the deleted blocks back (found by review). Now each run's id is in the data directory and
in its journal's header, and a journal of an earlier run is not adopted.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.tiers.arena import journal_path
from kvtier.tiers.journal_replay import read_journal
from kvtier.tiers.journal_run import RUN_FILE, last_run
from tests.support.chains import LAYOUT, content
from tests.support.daemon import DaemonProcess

BLOCKS = 8


def _newer(key: bytes) -> np.ndarray:
    """Bytes other than ``content(key)``: what the run in between stores under ``key``."""
    return np.bitwise_xor(content(key), np.uint8(0x5A))


def _journaled(daemon_factory: Callable[..., DaemonProcess]
               ) -> tuple[DaemonProcess, list[bytes]]:
    """A daemon without nvme holding a chain of BLOCKS blocks in its arena, journaled."""
    d: DaemonProcess = daemon_factory(cpu_bytes="8MiB", nvme_bytes="0").start()
    c = connect(d.socket)
    ns = c.register_layout(LAYOUT, "m")
    keys = [bytes(k) for k in block_keys(ns, np.arange(64 * BLOCKS))]
    assert c.put(ns, keys, [content(k) for k in keys]) == BLOCKS
    c.close()
    d.wait_journal_commits(BLOCKS)
    return d, keys


@pytest.mark.parametrize("between", ["warm-restart-off", "other-shm-dir"])
def test_an_arena_left_before_a_cold_run_is_not_adopted_after_it(daemon_factory,
                                                                 between: str) -> None:
    d: DaemonProcess = daemon_factory(cpu_bytes="8MiB", nvme_bytes="64MiB").start()
    c = connect(d.socket)
    ns = c.register_layout(LAYOUT, "m")
    keys = [bytes(k) for k in block_keys(ns, np.arange(64 * BLOCKS))]
    assert c.put(ns, keys, [content(k) for k in keys]) == BLOCKS   # arena only
    c.close()
    d.wait_journal_commits(BLOCKS)
    first = last_run(d.data_dir)
    assert first is not None
    state = read_journal(journal_path(d.arena_path))
    assert state is not None and state.run == first
    d.crash()                                  # the arena and its journal stay
    assert d.arena_path.exists()

    other = Path(tempfile.mkdtemp(prefix="kvtier-test-shm-", dir="/dev/shm"))
    try:
        d.extra_args = (["--no-cpu-warm-restart"] if between == "warm-restart-off"
                        else ["--cpu-shm-dir", str(other)])
        d.start()
        assert d.stats()["recovery"]["mode"] == "cold"
        assert last_run(d.data_dir) not in (None, first)
        c = connect(d.socket)
        ns = c.register_layout(LAYOUT, "m")
        assert c.lookup(ns, keys, prefetch=False).hits == 0
        assert c.put(ns, keys, [_newer(k) for k in keys], durable=True) == BLOCKS
        assert c.delete(ns, keys[BLOCKS // 2:]) == BLOCKS // 2
        c.close()
        assert d.terminate() == 0              # graceful: its arena goes, nvme stays
    finally:
        shutil.rmtree(other, ignore_errors=True)

    assert d.arena_path.exists()               # the first run's, still there
    d.extra_args = []
    d.start()
    rec = d.stats()["recovery"]
    assert rec["mode"] == "cold" and rec["adopted_blocks"] == 0, rec
    assert "last run" in rec["cold_reason"]
    c = connect(d.socket)
    ns = c.register_layout(LAYOUT, "m")
    outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
    served = 0
    for _ in range(5):    # the prefetch deadline may answer before every nvme read is in
        served = c.get(ns, keys, outs)
        if served == BLOCKS // 2:
            break
    assert served == BLOCKS // 2               # the deleted tail does not come back
    for k, o in zip(keys[:served], outs[:served], strict=True):
        assert np.array_equal(o, _newer(k))    # the newer bytes, not the stale arena's
    c.close()


def test_a_warm_start_still_adopts_the_last_runs_arena(daemon_factory) -> None:
    """Two crashes in a row: each start adopts the arena the run before it left."""
    d, _ = _journaled(daemon_factory)
    runs = [last_run(d.data_dir)]
    for _ in range(2):
        d.crash()
        d.start()
        rec = d.stats()["recovery"]
        assert (rec["mode"], rec["adopted_blocks"]) == ("warm", BLOCKS), rec
        runs.append(last_run(d.data_dir))
        state = read_journal(journal_path(d.arena_path))
        assert state is not None and state.run == runs[-1]
    assert None not in runs and len(set(runs)) == 3


def test_an_unreadable_run_file_means_a_cold_start(daemon_factory) -> None:
    """A run file that is not an id (edited, truncated) adopts nothing: cold, then served."""
    d, keys = _journaled(daemon_factory)
    d.crash()
    (d.data_dir / RUN_FILE).write_text("not a run id\n")
    d.start()
    rec = d.stats()["recovery"]
    assert (rec["mode"], rec["adopted_blocks"]) == ("cold", 0), rec
    c = connect(d.socket)
    ns = c.register_layout(LAYOUT, "m")
    assert c.lookup(ns, keys, prefetch=False).hits == 0
    assert c.put(ns, keys, [content(k) for k in keys]) == BLOCKS
    c.close()
