"""The worker's save ledger: delayed frees are reported only once every save is over."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.ledger import SaveLedger


def test_a_finished_request_is_freed_only_after_its_saves() -> None:
    ledger = SaveLedger()
    fut: Future[bool] = Future()
    ledger.planned("r1")
    ledger.submitted("r1", fut)
    assert ledger.finished_sending(["r1", "other"]) == set()   # save still running
    assert ledger.running() == [fut] and ledger.of("r1") == [fut]
    fut.set_result(True)
    ledger.over("r1", save_id=7)
    assert ledger.finished_sending([]) == {"r1"}               # remembered as finishing
    assert ledger.finished_sending(["r1"]) == set()            # reported once
    meta = ledger.take_meta()
    assert meta is not None and meta.saves_done == {7: 1}
    assert ledger.take_meta() is None


def test_dropped_saves_and_counters_reach_the_scheduler_once() -> None:
    ledger = SaveLedger()
    ledger.dropped(3)
    ledger.count("dropped_saves", 1)
    ledger.count("dropped_saves", 2)
    ledger.count("ignored", 0)
    meta = ledger.take_meta()
    assert meta is not None
    assert meta.saves_done == {3: 1} and meta.counters == {"dropped_saves": 3}
    assert ledger.take_meta() is None
