"""Redis on the request path is bounded by ``redis.lookup_budget_s``, not by the Redis op
timeout: with a real redis-server stopped (SIGSTOP: connections hang) or killed, a lookup or
get returns within the budget and counts the Redis part as a miss."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import RedisServer, running_server

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=64)
OP_TIMEOUT_S = 2.0
BUDGET_S = 0.1


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_server(tmp_path / "redis") as server:
        try:
            yield server
        finally:
            if server.proc is not None and server.proc.poll() is None:
                server.proc.send_signal(signal.SIGCONT)


def node(factory: Callable[..., DaemonProcess], name: str, url: str,
         budget_s: float) -> DaemonProcess:
    return factory(name, extra_args=["--redis-url", url], env={
        "KVTIER_REDIS_OP_TIMEOUT_S": str(OP_TIMEOUT_S),
        "KVTIER_REDIS_LOOKUP_BUDGET_S": str(budget_s)}).start()


def slowest(fn: Callable[[], object], n: int = 5) -> float:
    worst = 0.0
    for _ in range(n):
        t = time.monotonic()
        fn()
        worst = max(worst, time.monotonic() - t)
    return worst


def test_lookup_with_redis_stopped_or_killed_returns_within_budget(
        daemon_factory, redis_server: RedisServer) -> None:
    bounded = node(daemon_factory, "bounded", redis_server.url, BUDGET_S)
    unbounded = node(daemon_factory, "unbounded", redis_server.url, 10 * OP_TIMEOUT_S)
    cb, cu = connect(bounded.socket, timeout=30), connect(unbounded.socket, timeout=30)
    nsb, nsu = cb.register_layout(LAYOUT, "m"), cu.register_layout(LAYOUT, "m")
    local = block_keys(nsb, np.arange(64 * 4))
    assert cb.put(nsb, local, [np.ones(LAYOUT.block_bytes, np.uint8)] * 4) == 4
    remote = block_keys(nsb, 10_000 + np.arange(64 * 4))   # in no local tier: asks Redis
    outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in remote]

    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)        # Redis hangs: replies never come
    lookup = slowest(lambda: cb.lookup(nsb, remote))
    get = slowest(lambda: cb.get(nsb, remote, outs))
    hung = slowest(lambda: cu.lookup(nsu, remote), n=1)  # without a budget: the op timeout
    assert cb.lookup(nsb, local).hits == 4               # local hits are unaffected
    misses = bounded.stats()["requests"]["redis_budget_misses"]
    redis_server.proc.send_signal(signal.SIGCONT)
    redis_server.kill()
    killed = slowest(lambda: cb.lookup(nsb, remote))
    print(f"\nredis stopped: lookup {lookup * 1000:.0f} ms, get {get * 1000:.0f} ms with a "
          f"{BUDGET_S * 1000:.0f} ms budget vs {hung * 1000:.0f} ms without; killed: "
          f"{killed * 1000:.0f} ms; budget misses {misses}")
    assert hung >= 0.5 * OP_TIMEOUT_S, "Redis did not hang: the test proves nothing"
    assert lookup < 0.25 * OP_TIMEOUT_S and get < 0.25 * OP_TIMEOUT_S
    assert killed < 0.25 * OP_TIMEOUT_S
    assert misses >= 5   # each cut lookup or get counted (10 unless the tier went down)
    cb.close()
    cu.close()
