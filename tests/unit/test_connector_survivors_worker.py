"""How a producer splits a save (``WorkerSide._piece_blocks``; mutation review survivor):
every piece fits the bound on saves in flight and half the put share the daemon gives
this process, so a prompt larger than the share still reaches Redis whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.connector_sched import LAYOUT, PAGE, TPB
from tests.support.vllm_fakes import fake

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.config import ConnectorConfig
from kvtier.connectors.vllm.worker import WorkerSide

BLOCK = 1000   # bytes of one kvtier block (stood in)


def producer(tmp_path: Path, *, inflight: int, put_room: int) -> WorkerSide:
    cfg = ConnectorConfig.from_extra({"socket_path": str(tmp_path / "none.sock"),
                                      "tokens_per_block": TPB, "model_id": "m"},
                                     block_size=PAGE, default_model_id="m",
                                     role="kv_producer")
    w = WorkerSide(cfg, LAYOUT, PAGE, tp_rank=0, tp_size=1)
    w.pipeline = fake(max_inflight_bytes=inflight)
    w.caches = fake(block_bytes=BLOCK)
    w.put_room = put_room
    return w


@pytest.mark.parametrize(("inflight", "put_room", "blocks"), [
    (10 * BLOCK, 0, 10),            # no share known: the bound on saves in flight
    (10 * BLOCK, 8 * BLOCK, 4),     # half the put share
    (10 * BLOCK, 40 * BLOCK, 10),   # the bound, when smaller
    (10 * BLOCK, BLOCK, 1),         # never below one block
])
def test_a_producer_piece_fits_the_bound_and_half_the_put_share(
        tmp_path: Path, inflight: int, put_room: int, blocks: int) -> None:
    assert producer(tmp_path, inflight=inflight,
                    put_room=put_room)._piece_blocks() == blocks


def test_a_preempted_request_s_free_is_no_longer_delayed(tmp_path: Path) -> None:
    """The scheduler side stops delaying a preempted request's free (it clears
    ``saved_any``): reported in ``finished_sending`` later, vLLM would be told of a free
    it never delayed."""
    w = producer(tmp_path, inflight=10 * BLOCK, put_room=0)
    w.ledger.planned("r")                 # a save of "r" was planned, then it was preempted
    w.handle_preemptions(["r"])
    assert w.get_finished({"r"}) == (set(), set())
    w.ledger.planned("s")                 # (not preempted: its free stays delayed)
    assert w.get_finished({"s"}) == ({"s"}, set())


class Batch:
    """A ``LoadBatch`` stood in: ``fail`` raised by ``open``; ``close`` returns ``bad``."""

    fail: Exception | None = None
    bad: set[int] = set()

    def __init__(self, specs: list[Any], caches: Any, link: Any, tp_rank: int,
                 device_loads: bool) -> None:
        self.pages = {p for s in specs for block in s.pages for p in block}
        self.loaded_blocks = 0

    def open(self) -> None:
        if Batch.fail is not None:
            raise Batch.fail

    def load_layer(self, layer: int, stream: Any) -> None:
        self.loaded_blocks = 1

    def close(self) -> set[int]:
        return set(Batch.bad)

    def all_pages(self) -> set[int]:
        return set(self.pages)


def async_load(monkeypatch: pytest.MonkeyPatch, *, fail: Exception | None = None,
               bad: frozenset[int] = frozenset()) -> set[int]:
    """The pages an asynchronous load of one request (pages 3..6) reports failed."""
    import torch
    from kvtier.connectors.vllm import asyncloads

    monkeypatch.setattr(asyncloads, "LoadBatch", Batch)
    monkeypatch.setattr(Batch, "fail", fail)
    monkeypatch.setattr(Batch, "bad", set(bad))
    loads = asyncloads.AsyncLoads(lambda: None, 0,   # type: ignore[arg-type, return-value]
                                  lambda name, n: None)
    spec = fake(req_id="r", pages=[[3, 4], [5, 6]])
    loads.submit(spec, fake(caches=[torch.zeros(1)], num_layers=2), False)
    loads.running["r"].result(timeout=30)
    done, failed = loads.take_done()
    loads.shutdown()
    assert done == {"r"}
    return failed


def test_an_async_load_that_crashes_fails_all_its_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever raised, vLLM must recompute every page of the load (claimed loaded, they
    would be read as the prompt's KV)."""
    assert async_load(monkeypatch, fail=RuntimeError("copy failed")) == {3, 4, 5, 6}


def test_an_async_load_reports_the_pages_its_batch_failed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert async_load(monkeypatch, bad=frozenset({5, 6})) == {5, 6}
    assert async_load(monkeypatch) == set()
