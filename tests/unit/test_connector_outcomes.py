"""What the connector remembers between steps: page outcomes (outcomes.py: stale reports,
confirmed loads, the workers' echo of stale pages), saves in flight (pending.py) and the
worker's save ledger after a preemption (ledger.py). Each was found unpinned by a mutation
review: a test fails on its mutant."""

from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace as NS

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm import pending
from kvtier.connectors.vllm.ledger import SaveLedger
from kvtier.connectors.vllm.metadata import KVTierConnectorMetadata, TransferSpec
from kvtier.connectors.vllm.outcomes import PageOutcomes
from kvtier.connectors.vllm.pending import PENDING_SAVE_WAIT_S, PendingSaves

PAGE, PPB = 32, 2


def test_a_load_into_a_recycled_bad_page_is_no_stale_report() -> None:
    """Pages a failed load left bad go back to vLLM's free pool and are handed out again:
    a new request that loads into one counts it computed (its num_computed_tokens include
    the load) but its KV is the load's, not the failed one's. Reporting it stale would
    roll the request back and throw a good load away (a recompute on every load that
    lands on a once-failed page); only a page no load of this step fills is reported."""
    out = PageOutcomes(PAGE, PPB)
    assert out.bad.failed([10, 11, 12, 13], {10}) == 0       # 10..13 bad, then freed
    tokens = np.arange(1, 2 * PAGE * PPB + 1, dtype=np.uint32)
    meta = KVTierConnectorMetadata()
    meta.loads.append(TransferSpec("B", None, tokens, 0, [[12, 13], [20, 21]]))
    loader = NS(page_ids=[12, 13, 20, 21])                    # counts its 2 loaded blocks
    sharer = NS(page_ids=[10, 11])                            # a prefix-cache hit on 10, 11
    out.report_stale(meta, [(loader, 2 * PAGE * PPB), (sharer, PAGE * PPB)])
    assert meta.stale_pages == [10, 11]
    assert out.failures({10, 11}) == set()


def test_the_loads_of_the_step_the_workers_report_are_confirmed() -> None:
    """The workers report the last step whose loads they all finished: that step's loads
    are over too. Left out, a recycled bad page a load filled stayed bad: its request's
    blocks were never saved, and it was reported stale (rolled back) as if it read
    zeroed KV."""
    out = PageOutcomes(PAGE, PPB)
    out.bad.failed([12, 13, 14, 15], {12})                   # 12..15 bad, then freed
    tokens = np.arange(1, PAGE * PPB + 1, dtype=np.uint32)
    for step in (0, 1):
        meta = KVTierConnectorMetadata(step=step)
        meta.loads.append(TransferSpec(f"R{step}", None, tokens, 0,
                                       [[12 + 2 * step, 13 + 2 * step]]))
        out.loads_planned(meta)
    assert out.confirmed(0) == {12, 13}
    assert out.confirmed(1) == {14, 15}
    assert out.confirmed(1) == set()


def test_the_workers_echo_of_a_stale_report_is_no_load_failure() -> None:
    """The workers return the stale pages this side named as the step's invalid block ids
    (vLLM's rollback needs them there). Taken for failed loads, they re-marked pages a
    request was rewriting a step at a time (its progress lost: never sound, never saved)
    and failed the load of every request holding one; only the other ids are failures."""
    out = PageOutcomes(PAGE, PPB)
    out.bad.failed([10, 11, 12], {10})
    out.bad.rewritten([10, 11, 12], 0, PAGE + 4)             # 10 whole, 11 up to token 4
    assert out.bad.pages == {11, 12}
    meta = KVTierConnectorMetadata()
    out.report_stale(meta, [(NS(page_ids=[10, 11, 12]), 3 * PAGE)])   # a sharer
    assert meta.stale_pages == [11, 12]
    assert out.failures({11, 12, 40}) == {40}


def test_a_lookup_waits_on_a_save_for_a_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup whose next block is in a save not yet acknowledged answers "not yet", but
    only for PENDING_SAVE_WAIT_S: a save never acknowledged (its worker restarted) is
    pruned only with the engine reports, which stop while the daemon is unreachable, so
    without the bound the request would wait on it indefinitely."""
    saves = PendingSaves(tp_size=1, tokens_per_block=4)
    tokens = np.arange(1, 9, dtype=np.uint32)
    t0 = time.monotonic()
    monkeypatch.setattr(pending, "time", NS(monotonic=lambda: t0))
    saves.add(None, tokens, 0, 2)
    assert saves.holds(None, list(tokens), 1)
    monkeypatch.setattr(pending, "time",
                        NS(monotonic=lambda: t0 + PENDING_SAVE_WAIT_S + 0.5))
    assert not saves.holds(None, list(tokens), 1)
    assert not saves.over([0])


def test_a_request_preempted_after_its_saves_is_never_reported_sent() -> None:
    """A request's saves are waited for at its preemption and forgotten: the scheduler side
    no longer delays its free for them (it clears ``saved_any``), so vLLM frees it at
    once when it finishes without saving again. Reporting it in finished_sending then
    would name a request vLLM no longer has (its scheduler asserts it does: an engine
    crash)."""
    ledger = SaveLedger()
    fut: Future[bool] = Future()
    ledger.planned("r1")
    ledger.submitted("r1", fut)
    fut.set_result(True)
    ledger.over("r1", save_id=0)
    ledger.forget("r1")                                   # preempted: saves over
    assert ledger.finished_sending(["r1"]) == set()
    assert ledger.finished_sending([]) == set()
