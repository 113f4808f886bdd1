"""The daemon as a real subprocess, driven through the client from other processes."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from kvtier.client import connect, connect_async
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=64)  # 32 KiB blocks


def block_bytes_for(key: bytes, nbytes: int) -> np.ndarray:
    """Deterministic content derived from the key: any process can check any block."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _writer(socket_path: str, first_token: int, n_blocks: int) -> list[str]:
    c = connect(socket_path)
    ns = c.register_layout(LAYOUT, "m")
    keys = block_keys(ns, np.arange(first_token, first_token + n_blocks * 64))
    stored = c.put(ns, keys, [block_bytes_for(k, LAYOUT.block_bytes) for k in keys])
    c.close()
    assert stored == n_blocks
    return [k.hex() for k in keys]


def test_put_in_one_process_get_in_another(daemon: DaemonProcess) -> None:
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        written = pool.starmap(_writer, [(str(daemon.socket), 0, 20),
                                         (str(daemon.socket), 10_000, 20)])
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m")
    for hexes in written:
        keys = [bytes.fromhex(h) for h in hexes]
        assert c.lookup(ns, keys).hits == len(keys)
        outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
        assert c.get(ns, keys, outs) == len(keys)
        for k, out in zip(keys, outs, strict=True):
            assert np.array_equal(out, block_bytes_for(k, LAYOUT.block_bytes))
    stats = c.stats()
    assert stats["tiers"]["cpu"]["blocks"] == 40
    assert stats["requests"]["put_blocks"] == 40


def test_prefix_lookup_stops_at_first_miss(daemon: DaemonProcess) -> None:
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m")
    tokens = np.arange(64 * 8)
    keys = block_keys(ns, tokens)
    c.put(ns, keys[:5], [block_bytes_for(k, LAYOUT.block_bytes) for k in keys[:5]])
    res = c.lookup(ns, keys)
    assert res.hits == 5 and res.tiers == ["cpu"] * 5
    other = tokens.copy()
    other[64 * 3 + 1] += 1  # diverge inside block 3: blocks 3.. differ
    assert c.lookup(ns, block_keys(ns, other)).hits == 3
    outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
    assert c.get(ns, keys, outs) == 5


def test_cache_salt_isolates_tenants(daemon: DaemonProcess) -> None:
    c = connect(daemon.socket)
    a = c.register_layout(LAYOUT, "m", cache_salt="tenant-a")
    b = c.register_layout(LAYOUT, "m", cache_salt="tenant-b")
    tokens = np.arange(64 * 4)
    ka, kb = block_keys(a, tokens), block_keys(b, tokens)
    assert not set(ka) & set(kb)
    c.put(a, ka, [block_bytes_for(k, LAYOUT.block_bytes) for k in ka])
    assert c.lookup(a, ka).hits == 4
    assert c.lookup(b, kb).hits == 0
    outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in kb]
    assert c.get(b, kb, outs) == 0


def test_eviction_demotes_to_nvme_and_lookup_promotes(daemon_factory) -> None:
    d = daemon_factory(cpu_bytes="4MiB", nvme_bytes="64MiB",
                       extra_args=["--eviction", "lru"]).start()
    c = connect(d.socket)
    ns = c.register_layout(LAYOUT, "m")
    keys = block_keys(ns, np.arange(64 * 600))  # 600 x 32 KiB = 19 MiB > 4 MiB arena
    assert c.put(ns, keys, [block_bytes_for(k, LAYOUT.block_bytes) for k in keys]) == 600
    stats = c.stats()
    cpu, nvme = stats["tiers"]["cpu"], stats["tiers"]["nvme"]
    assert cpu["used_bytes"] <= cpu["capacity_bytes"]
    assert cpu["evictions"]["capacity"] > 0 and nvme["blocks"] == cpu["evictions"]["capacity"]
    res = c.lookup(ns, keys[:50])
    assert res.hits == 50 and res.tiers[0] == "nvme"
    outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in range(50)]
    assert c.get(ns, keys[:50], outs) == 50
    for k, out in zip(keys[:50], outs, strict=True):
        assert np.array_equal(out, block_bytes_for(k, LAYOUT.block_bytes))
    after = c.stats()
    assert after["prefetch"]["issued"] >= 50
    assert any(r["src"] == "nvme" and r["dst"] == "cpu" for r in after["bytes_moved"])


async def test_async_client_roundtrip(daemon: DaemonProcess) -> None:
    c = await connect_async(daemon.socket)
    ns = await c.register_layout(LAYOUT, "m")
    keys = block_keys(ns, np.arange(64 * 6))
    bufs = [block_bytes_for(k, LAYOUT.block_bytes) for k in keys]
    assert await c.put(ns, keys, bufs) == 6
    res = await c.lookup(ns, keys)
    assert res.hits == 6
    outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
    assert await c.get(ns, keys, outs) == 6
    assert all(np.array_equal(a, b) for a, b in zip(bufs, outs, strict=True))
    assert await c.delete(ns, keys[3:]) == 3
    assert (await c.lookup(ns, keys)).hits == 3
    await c.close()


def test_http_endpoints_and_stats_cli(daemon: DaemonProcess) -> None:
    with urllib.request.urlopen(daemon.http_url + "/healthz") as r:
        assert json.loads(r.read()) == {"status": "ok"}
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m")
    keys = block_keys(ns, np.arange(64 * 3))
    c.put(ns, keys, [block_bytes_for(k, LAYOUT.block_bytes) for k in keys])
    c.lookup(ns, keys)
    with urllib.request.urlopen(daemon.http_url + "/metrics") as r:
        text = r.read().decode()
    assert 'kvtier_tier_blocks{tier="cpu"} 3.0' in text
    assert 'kvtier_hit_blocks_total{tier="cpu"} 3.0' in text
    assert "kvtier_op_seconds_bucket" in text
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "stats", "--url",
                          daemon.http_url], capture_output=True, text=True, check=True).stdout
    assert "cpu" in out and "nvme" in out and "prefix hit rate 100.0%" in out
    js = subprocess.run([sys.executable, "-m", "kvtier.cli", "stats", "--json", "--url",
                         daemon.http_url], capture_output=True, text=True, check=True).stdout
    assert json.loads(js)["tiers"]["cpu"]["blocks"] == 3


def test_stats_cli_without_daemon_says_so() -> None:
    p = subprocess.run([sys.executable, "-m", "kvtier.cli", "stats", "--url",
                        "http://127.0.0.1:9"], capture_output=True, text=True)
    assert p.returncode == 1
    assert p.stderr.strip().count("\n") == 0 and "no daemon answered" in p.stderr


def test_sigterm_drains_and_blocks_survive_restart(daemon: DaemonProcess) -> None:
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m")
    keys = block_keys(ns, np.arange(64 * 10))
    c.put(ns, keys, [block_bytes_for(k, LAYOUT.block_bytes) for k in keys])
    c.close()
    assert daemon.terminate(timeout=20) == 0
    daemon.start()
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m")
    res = c.lookup(ns, keys)
    assert res.hits == 10 and set(res.tiers) == {"nvme"}
    outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
    assert c.get(ns, keys, outs) == 10
    assert all(np.array_equal(o, block_bytes_for(k, LAYOUT.block_bytes))
               for k, o in zip(keys, outs, strict=True))


def test_second_daemon_on_same_socket_refuses(daemon: DaemonProcess, tmp_path) -> None:
    p = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--socket",
                        str(daemon.socket), "--data-dir", str(tmp_path / "other"),
                        "--http-port", "0", "--cpu-bytes", "8MiB"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "already serving" in p.stderr


@pytest.mark.parametrize("seed", ["0", "4242"])
def test_keys_match_across_processes(seed: str) -> None:
    code = ("import numpy as np;from kvtier.keys import Namespace,block_keys;"
            "from kvtier.layout import KVLayout;"
            "ns=Namespace('m',KVLayout(2,2,32,'float16',64),0,1,'s');"
            "print(b''.join(block_keys(ns,np.arange(640))).hex())")
    import os

    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": s}, check=True).stdout
            for s in (seed, "999")}
    assert len(outs) == 1 and len(outs.pop().strip()) == 10 * 32


def test_engine_counters_are_lifetime_totals_counted_once_per_engine(
        daemon: DaemonProcess) -> None:
    """An engine's cumulative counters: kept when its connection goes, and counted once
    when the same engine (its ``engine_id``) reconnects; exported as counters."""
    def metric(name: str) -> float:
        with urllib.request.urlopen(daemon.http_url + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise AssertionError(f"{name} not exported")

    before = metric("kvtier_engine_loaded_blocks_total") if "loaded_blocks" in \
        daemon.stats()["connector"] else 0.0
    with connect(daemon.socket) as c:
        c.report_engine(engine_id="engine-a", loaded_blocks=100, running=2)
    with connect(daemon.socket) as c:             # the link reconnected: same engine
        c.report_engine(engine_id="engine-a", loaded_blocks=110, running=1)
        assert daemon.stats()["connector"]["running"] == 1
    assert metric("kvtier_engine_loaded_blocks_total") == before + 110


def test_a_report_sent_without_waiting_lands_and_its_reply_is_skipped(
        daemon: DaemonProcess) -> None:
    """The connector reports from inside the engine's step without a round trip: the
    daemon applies it, and the next call on the connection skips its reply."""
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m")
    c.report_engine_nowait(running=7, waiting=2, lookups_without_round_trip=5)
    keys = block_keys(ns, np.arange(3 * LAYOUT.tokens_per_block))
    data = [block_bytes_for(k, LAYOUT.block_bytes) for k in keys]
    assert c.put(ns, keys, data) == 3             # the stray reply is skipped, not taken
    assert c.lookup(ns, keys).hits == 3
    engine = c.stats()["connector"]
    assert engine["running"] == 7 and engine["lookups_without_round_trip"] == 5
    c.close()


def test_hindsight_eviction_runs_in_the_daemon(daemon_factory) -> None:
    """``--eviction hindsight`` (the mode ``adaptive`` starts in) as the fixed policy: the
    arena overflows, OPTgen learns the tier's size at the first eviction, every block is
    still served exactly, from the arena or nvme."""
    d = daemon_factory(cpu_bytes="4MiB", nvme_bytes="64MiB",
                       extra_args=["--eviction", "hindsight"]).start()
    c = connect(d.socket)
    ns = c.register_layout(LAYOUT, "m")
    keys = block_keys(ns, np.arange(64 * 300))  # 300 x 32 KiB > 4 MiB arena
    for i in range(0, len(keys), 30):           # prompts of 30 blocks, then a re-read
        chunk = keys[i:i + 30]
        assert c.put(ns, chunk, [block_bytes_for(k, LAYOUT.block_bytes) for k in chunk]) == 30
        assert c.lookup(ns, keys[:10]).hits == 10
    stats = c.stats()
    assert stats["tiers"]["cpu"]["evictions"]["capacity"] > 0
    outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in range(40)]
    assert c.lookup(ns, keys[:40]).hits == 40
    assert c.get(ns, keys[:40], outs) == 40
    for k, out in zip(keys[:40], outs, strict=True):
        assert np.array_equal(out, block_bytes_for(k, LAYOUT.block_bytes))
    c.close()


def test_a_stop_lets_a_writer_commit_and_does_not_wait_for_idle_clients(
        tmp_path: object) -> None:
    """SIGTERM with two clients connected: one idle, one holding a put lease it is still
    filling. The stop waits for the lease (its commit lands and the blocks survive the
    restart), not for the idle client (before, every connection held the stop for half of
    drain_timeout_s: 15 s here)."""
    import threading
    import time
    from pathlib import Path

    d = DaemonProcess(Path(str(tmp_path)) / "kvd",
                      extra_args=["--daemon-drain-timeout-s", "30"]).start()
    try:
        idle = connect(d.socket)
        idle.register_layout(LAYOUT, "m")
        c = connect(d.socket)
        ns = c.register_layout(LAYOUT, "m")
        keys = block_keys(ns, np.arange(64 * 4))
        lease = c.prepare_put(ns, keys)
        assert d.proc is not None
        d.proc.send_signal(15)
        time.sleep(0.3)                    # the stop has begun; the writer is still copying
        for k, view in zip(keys, lease.views, strict=True):
            assert view is not None
            view[:] = block_bytes_for(k, LAYOUT.block_bytes)
        assert lease.commit() == 4
        t0 = time.monotonic()
        done = threading.Event()
        proc = d.proc

        def stopped() -> None:
            proc.wait(30)
            done.set()

        threading.Thread(target=stopped, daemon=True).start()
        assert done.wait(10), "the stop waited for the idle client"
        assert d.proc.returncode == 0 and time.monotonic() - t0 < 10
        idle.close()
        c.close()
        d.start()
        with connect(d.socket) as again:
            ns = again.register_layout(LAYOUT, "m")
            outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
            assert again.get(ns, keys, outs) == 4
            assert all(np.array_equal(o, block_bytes_for(k, LAYOUT.block_bytes))
                       for k, o in zip(keys, outs, strict=True))
    finally:
        d.kill()


@pytest.mark.parametrize("when", ["during the start", "while serving", "during the drain"])
def test_a_stop_signal_at_any_time_cleans_up(tmp_path: object, when: str) -> None:
    """SIGHUP while serving, SIGTERM while the arena is being made, a second SIGTERM while
    draining: each was the default action (the process killed, its 1 GiB arena, journal,
    presence filter or socket left behind). Each is now the one graceful stop."""
    import signal
    import time
    from pathlib import Path

    from kvtier.tiers.arena import journal_path, stable_arena_name

    root = Path(str(tmp_path))
    sock, data = root / "run" / "kvtier.sock", root / "data"
    arena = Path("/dev/shm") / stable_arena_name(data)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "serve", "--data-dir", str(data), "--socket",
         str(sock), "--http-port", "0", "--cpu-bytes", "1GiB", "--nvme-bytes", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if when == "during the start":
            deadline = time.monotonic() + 30
            while not arena.exists() and time.monotonic() < deadline:   # being made
                time.sleep(0.005)
            proc.send_signal(signal.SIGTERM)
        else:
            while not proc.stdout.readline().strip().startswith("policy:"):
                pass
            if when == "while serving":
                proc.send_signal(signal.SIGHUP)
            else:
                client = connect(sock)   # an idle client: the drain waits for nothing
                client.register_layout(LAYOUT, "m")
                proc.send_signal(signal.SIGTERM)
                while "draining" not in proc.stdout.readline():
                    pass
                proc.send_signal(signal.SIGTERM)
                client.close()
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
        left = [p for p in (arena, journal_path(arena), Path(f"{arena}.presence"), sock)
                if p.exists()]
        assert not left, left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for p in (arena, journal_path(arena), Path(f"{arena}.presence")):
            p.unlink(missing_ok=True)
