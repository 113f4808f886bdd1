"""The connector's worker side as a ``kv_producer`` (no engine; real daemon, real Redis,
real CPU KV caches): a step ends only once its saves are committed and in Redis, a save is
never dropped for lack of room (a ``kv_both`` save is), and a Redis that cannot take the
blocks bounds the step and is counted."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")
pytest.importorskip("torch")

from kvtier.connectors.vllm import transfers
from kvtier.connectors.vllm.config import ConnectorConfig
from kvtier.connectors.vllm.metadata import KVTierConnectorMetadata, TransferSpec
from kvtier.connectors.vllm.worker import WorkerSide

from tests.integration.test_connector_worker import (
    LAYOUT,
    PAGE,
    TPB,
    WAIT_S,
    caches,
    rows,
    tokens,
)
from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import RedisServer


@pytest.fixture
def node(tmp_path: Path, redis_server: RedisServer) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "kvd", cpu_bytes="32MiB", nvme_bytes="0",
                       extra_args=["--redis-url", redis_server.url],
                       env={"KVTIER_REDIS_WRITE_THROUGH": "false",
                            "KVTIER_REDIS_OP_TIMEOUT_S": "0.5"}) as d:
        yield d


def worker(d: DaemonProcess, role: str, **extra: Any) -> WorkerSide:
    cfg = ConnectorConfig.from_extra({"socket_path": str(d.socket), "tokens_per_block": TPB,
                                      "model_id": "m", "timeout_s": 5.0,
                                      "max_inflight_save_bytes": LAYOUT.block_bytes, **extra},
                                     block_size=PAGE, default_model_id="m", role=role)
    w = WorkerSide(cfg, LAYOUT, PAGE, 0, 1)
    w.register_kv_caches(caches(3))
    return w


def two_saves() -> KVTierConnectorMetadata:
    """Two requests' saves of one block each: the in-flight bound holds one at a time."""
    return KVTierConnectorMetadata(saves=[
        TransferSpec("a", None, tokens(1, 1), 0, rows(1, 1), save_id=1),
        TransferSpec("b", None, tokens(2, 1), 0, rows(5, 1), save_id=2)])


def counters(w: WorkerSide) -> dict[str, int]:
    meta = w.worker_meta()
    return dict(meta.counters) if meta is not None else {}


def test_a_producer_step_ends_with_every_block_in_redis(node: DaemonProcess,
                                                        redis_server: RedisServer) -> None:
    w = worker(node, "kv_producer", redis_sync_timeout_s=3.0)
    w.save(two_saves())
    # no waiting here: save() returned after both commits and their write-through
    assert w.saved_blocks == 2
    assert redis_server.client().dbsize() == 2
    got = counters(w)
    assert got.get("dropped_saves", 0) == 0 and got.get("redis_sync_gave_up", 0) == 0
    assert node.stats()["daemon"]["redis_sync"]["commits"] == 2
    w.shutdown()


def test_kv_both_drops_at_the_bound_where_a_producer_waits(
        node: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    original = transfers.SaveRequest.copy

    def held(self: Any, stream: Any) -> None:
        assert gate.wait(WAIT_S)
        original(self, stream)

    monkeypatch.setattr(transfers.SaveRequest, "copy", held)
    w = worker(node, "kv_both")
    w.save(two_saves())                  # the first holds the bound: the second is dropped
    gate.set()
    w.shutdown()
    assert counters(w).get("dropped_saves") == 1


def test_redis_gone_bounds_the_producer_step_and_is_counted(
        node: DaemonProcess, redis_server: RedisServer) -> None:
    w = worker(node, "kv_producer", redis_sync_timeout_s=1.0)
    redis_server.kill()
    w.save(two_saves())
    assert w.saved_blocks == 2           # stored on this node all the same
    assert counters(w).get("redis_sync_gave_up") == 2
    assert node.stats()["daemon"]["redis_sync"]["gave_up"] == 2
    w.shutdown()


def test_a_producer_on_a_daemon_without_redis_is_said_once_not_counted_as_giving_up(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing to sync to is not a sync that gave up: every save of a producer whose
    daemon has no Redis tier counted one, so the give-up alert fired for a producer alone
    (found by review). It is said in the log, once."""
    with DaemonProcess(tmp_path / "kvd", cpu_bytes="32MiB", nvme_bytes="0") as d:
        w = worker(d, "kv_producer", redis_sync_timeout_s=1.0)
        with caplog.at_level("WARNING", "kvtier.connectors.vllm"):
            w.save(two_saves())
        assert w.saved_blocks == 2
        assert counters(w).get("redis_sync_gave_up", 0) == 0
        assert caplog.text.count("kv_producer on a daemon without a Redis tier") == 1
        assert d.stats()["daemon"]["redis_sync"]["gave_up_by_reason"] == {"off": 2}
        w.shutdown()


def test_a_hung_redis_holds_a_producer_step_once_not_once_per_save(
        tmp_path: Path, redis_server: RedisServer) -> None:
    """Redis stops answering (SIGSTOP, as a DEBUG SLEEP or a stalled host would) while the
    tier still reads as up (its op timeout is longer): the step's four synchronous commits
    share one redis_sync_timeout_s (each used to wait its own: 4 x the bound)."""
    d = DaemonProcess(tmp_path / "kvd", cpu_bytes="32MiB", nvme_bytes="0",
                      extra_args=["--redis-url", redis_server.url],
                      env={"KVTIER_REDIS_WRITE_THROUGH": "false",
                           "KVTIER_REDIS_OP_TIMEOUT_S": "30"}).start()
    w = worker(d, "kv_producer", redis_sync_timeout_s=1.0)
    assert redis_server.proc is not None
    try:
        redis_server.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        w.save(KVTierConnectorMetadata(saves=[
            TransferSpec(f"r{i}", None, tokens(40 + i, 1), 0, rows(1 + 2 * i, 1), save_id=i)
            for i in range(4)]))
        took = time.monotonic() - t0
        assert w.saved_blocks == 4                # stored on this node all the same
        assert counters(w).get("redis_sync_gave_up") == 4
        assert took < 2.5, f"the step waited {took:.2f} s for a 1 s sync bound"
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
        w.shutdown()
        d.kill()


def test_slow_copies_do_not_use_up_a_producer_step_s_redis_wait(
        node: DaemonProcess, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's bound is on waiting for Redis, not on the step: four saves whose copies
    take 0.4 s each (large blocks) all reach a healthy Redis within a 1 s bound (a deadline
    on the clock, set before the copies, gave up on the last ones)."""
    original = transfers.SaveRequest.copy

    def slow(self: Any, stream: Any) -> None:
        time.sleep(0.4)
        original(self, stream)

    monkeypatch.setattr(transfers.SaveRequest, "copy", slow)
    w = worker(node, "kv_producer", redis_sync_timeout_s=1.0)
    try:
        w.save(KVTierConnectorMetadata(saves=[
            TransferSpec(f"s{i}", None, tokens(60 + i, 1), 0, rows(1 + 2 * i, 1), save_id=i)
            for i in range(4)]))
        assert w.saved_blocks == 4
        assert counters(w).get("redis_sync_gave_up", 0) == 0
        assert redis_server.client().dbsize() == 4
    finally:
        w.shutdown()
