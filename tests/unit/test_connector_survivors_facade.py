"""``KVTierConnector``, the facade vLLM calls, built from stand-ins of vLLM's configs (no
engine, no daemon): what it decides itself (background loads under async scheduling,
stale rollback reports, no loads when context reuse is off, the TP rank and replicas a
worker keys with) and how it hands vLLM's calls to its half. Each was found unpinned by a
mutation review of the connector: a test fails on its mutant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

import torch
from kvtier.connectors.vllm.connector import KVTierConnector
from kvtier.connectors.vllm.metadata import KVTierConnectorMetadata
from kvtier.connectors.vllm.scheduler import SchedulerSide
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from tests.support.vllm_fakes import fake

PAGE, TPB = 32, 64


class FullAttentionSpec:
    """vLLM's full-attention KV cache spec, as the layout reads it (matched by name)."""

    num_kv_heads = 2
    head_size = 32
    dtype = torch.float32
    block_size = PAGE


def connector(tmp_path: Path, role: KVConnectorRole, *, asynchronous: bool = False,
              tp_size: int = 1, replicas: int = 1, kv_role: str = "kv_both",
              cache_dtype: str = "auto", **extra: Any) -> KVTierConnector:
    """A connector for ``role`` over a 2-layer cache (``extra``: its extra config)."""
    transfer = fake(kv_role=kv_role, kv_load_failure_policy="recompute",
                    kv_connector_extra_config={
                        "socket_path": str(tmp_path / "none.sock"), "tokens_per_block": TPB,
                        "model_fingerprint": "off", **extra})
    vllm_config = fake(kv_transfer_config=transfer, model_config=fake(model="m"),
                       cache_config=fake(block_size=PAGE, cache_dtype=cache_dtype),
                       parallel_config=fake(tensor_parallel_size=tp_size),
                       scheduler_config=fake(async_scheduling=asynchronous))
    kv_cache_config = fake(kv_tp_replicas=replicas, kv_cache_groups=[
        fake(kv_cache_spec=FullAttentionSpec(), layer_names=["l0", "l1"])])
    return KVTierConnector(vllm_config, role, kv_cache_config)


class Half:
    """A connector half stood in: records each call, answers as told."""

    def __init__(self, **answers: Any) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.answers = answers

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            self.calls.append((name, args[0] if args else None))
            return self.answers.get(name)
        return call


def test_async_scheduling_loads_in_the_background_unless_told_not_to(
        tmp_path: Path) -> None:
    """Under vLLM's async scheduling a failed synchronous load could leave its pages in
    vLLM's prefix cache (wrong tokens on a later hit): loads go to the background unless
    the operator set ``async_load`` himself; without async scheduling they stay as set."""
    sched = KVConnectorRole.SCHEDULER
    assert connector(tmp_path, sched, asynchronous=True).config.async_load is True
    assert connector(tmp_path, sched, asynchronous=True,
                     async_load=False).config.async_load is False
    assert connector(tmp_path, sched).config.async_load is False


def test_stale_rollback_reports_only_without_async_scheduling(tmp_path: Path) -> None:
    """A rollback vLLM did not start itself crashes an async engine that scheduled the
    next step on the request's sampled token: only a synchronous engine gets them."""
    sync = connector(tmp_path, KVConnectorRole.SCHEDULER)
    async_ = connector(tmp_path, KVConnectorRole.SCHEDULER, asynchronous=True)
    assert sync._s().outcomes.stale_reports is True
    assert async_._s().outcomes.stale_reports is False


def test_context_reuse_off_never_loads(tmp_path: Path) -> None:
    """``context_reuse`` "off": the scheduler side claims no token ever (it saves only)."""
    assert connector(tmp_path, KVConnectorRole.SCHEDULER)._s().loads is True
    assert connector(tmp_path, KVConnectorRole.SCHEDULER,
                     context_reuse="off")._s().loads is False


def test_a_consumer_connector_never_saves(tmp_path: Path) -> None:
    """vLLM's ``kv_role`` reaches both halves: a ``kv_consumer`` saves nothing, a
    ``kv_producer`` saves and commits through to Redis."""
    consumer = connector(tmp_path, KVConnectorRole.SCHEDULER, kv_role="kv_consumer")
    assert consumer._s().config.saves is False
    producer = connector(tmp_path, KVConnectorRole.WORKER, kv_role="kv_producer")
    assert producer._w().config.saves is True and producer._w().config.role == "kv_producer"


def test_a_worker_keys_with_its_own_tp_rank_and_the_replicas(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 3 of TP 4 whose ranks hold the same KV two by two keys shard 1 of 2: a
    worker that took rank 0, or ignored the replicas, loaded another shard's KV."""
    import vllm.distributed.parallel_state as ps

    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 3)
    w = connector(tmp_path, KVConnectorRole.WORKER, tp_size=4, replicas=2)._w()
    assert w.tp_rank == 3
    ns = w.link.namespace(None, w.tp_rank)
    assert (ns.tp_rank, ns.tp_size) == (1, 2)
    sched = connector(tmp_path, KVConnectorRole.SCHEDULER, tp_size=4, replicas=2)._s()
    assert sched.link.namespace(None, 3) == ns     # its lookups ask the same shards


def test_worker_calls_go_to_the_worker_half(tmp_path: Path) -> None:
    """Each of vLLM's worker calls reaches the worker half with the step's metadata (a
    load not started is a step computed on garbage pages; a save not queued is lost);
    empty finished sets go back as None, as vLLM expects."""
    c = connector(tmp_path, KVConnectorRole.WORKER)
    half = Half(get_finished=(set(), set()), take_load_errors={7}, worker_meta="wm")
    c._worker = half   # type: ignore[assignment]
    meta = KVTierConnectorMetadata(step=3, preempted=["p"])
    c.bind_connector_metadata(meta)
    c.start_load_kv(fake())
    c.wait_for_layer_load("l1")
    c.wait_for_save()
    c.handle_preemptions(meta)
    c.handle_preemptions(KVTierConnectorMetadata(step=4))     # none preempted: no call
    assert c.get_finished({"a"}) == (None, None)
    half.answers["get_finished"] = ({"s"}, {"r"})
    assert c.get_finished({"s"}) == ({"s"}, {"r"})
    assert c.get_block_ids_with_load_errors() == {7}
    assert c.build_connector_worker_meta() == "wm"
    assert half.calls == [("start_load_kv", meta), ("wait_for_layer_load", "l1"),
                          ("save", meta), ("handle_preemptions", ["p"]),
                          ("get_finished", {"a"}), ("get_finished", {"s"}),
                          ("take_load_errors", None), ("worker_meta", None)]


def test_other_metadata_starts_and_saves_nothing(tmp_path: Path) -> None:
    """Metadata that is not kvtier's (none bound yet) neither loads nor saves."""
    c = connector(tmp_path, KVConnectorRole.WORKER)
    half = Half()
    c._worker = half   # type: ignore[assignment]
    c.start_load_kv(fake())
    c.wait_for_save()
    assert half.calls == []


def test_kvtier_never_requires_kv_delivery(tmp_path: Path) -> None:
    """A dropped save is only a future miss: vLLM must not hold a request for it."""
    assert connector(tmp_path, KVConnectorRole.SCHEDULER).requires_kv_delivery is False


def test_scheduler_calls_go_to_the_scheduler_half(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``request_finished`` answers with the scheduler half's verdict (whether vLLM must
    keep the pages for a save in flight); ``shutdown`` closes that half's link."""
    c = connector(tmp_path, KVConnectorRole.SCHEDULER)
    monkeypatch.setattr(SchedulerSide, "request_finished",
                        lambda self, request: (True, {"r": request.request_id}))
    closed: list[str] = []
    monkeypatch.setattr(SchedulerSide, "shutdown", lambda self: closed.append("s"))
    assert c.request_finished(fake(request_id="r1"), [1, 2]) == (True, {"r": "r1"})
    c.shutdown()
    assert closed == ["s"]
    assert connector(tmp_path, KVConnectorRole.WORKER).reset_cache() is None


def test_the_kv_cache_dtype_names_the_blocks_format(tmp_path: Path) -> None:
    """An fp8 cache is stored as uint8 whatever its variant: e4m3 and e5m2 engines must
    key different blocks (one loaded the other's bytes: wrong tokens)."""
    plain = connector(tmp_path, KVConnectorRole.SCHEDULER)._s().link.layout.kv_format
    e4m3 = connector(tmp_path, KVConnectorRole.SCHEDULER,
                     cache_dtype="fp8_e4m3")._s().link.layout.kv_format
    e5m2 = connector(tmp_path, KVConnectorRole.WORKER,
                     cache_dtype="fp8_e5m2")._w().link.layout.kv_format
    assert e4m3 == f"{plain}:fp8_e4m3" and e5m2 == f"{plain}:fp8_e5m2"
