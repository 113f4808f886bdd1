"""How the connector cuts, splits and accounts for saves: a save cut at a failed load's
block keeps only its blocks before it (pieces.py), the workers' reports aggregate to what
all of them did (metadata.py), the worker's ledger withdraws and never reports a request
freed without waiting (ledger.py), and a lookup waits only on a pending save of its own
chain's next block (pending.py). Each was found unpinned by a mutation review of the
connector: a test fails on its mutant."""

from __future__ import annotations

import time
from concurrent.futures import Future

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.ledger import SaveLedger
from kvtier.connectors.vllm.metadata import KVTierWorkerMetadata, TransferSpec
from kvtier.connectors.vllm.pending import PENDING_SAVE_WAIT_S, PendingSaves
from kvtier.connectors.vllm.pieces import first_failed_block, save_pieces, saved_before

TPB = 4


def _save(first: int, n: int, loaded: list[tuple[int, int, int]] | None = None
          ) -> TransferSpec:
    """A save of blocks ``[first, first + n)``, two pages a block."""
    tokens = np.arange(1, (first + n) * TPB + 1, dtype=np.uint32)
    pages = [[100 + 2 * b, 101 + 2 * b] for b in range(first, first + n)]
    return TransferSpec("A", None, tokens, first, pages, save_id=7,
                        loaded_pages=loaded or [])


def test_a_page_failed_in_another_step_does_not_cut_a_save() -> None:
    """Page 12 failed in step 4's load; the save's request had it loaded again in step 5,
    whose load did not fail: the save is whole. Only a failure of the step that filled the
    page for this request spoils what was computed on it."""
    save = _save(0, 3, loaded=[(1, 12, 5)])
    assert first_failed_block(save, {4: {12}}) is None
    assert first_failed_block(save, {4: {12}, 5: {12}}) == 1


def test_a_save_that_starts_at_the_cut_is_dropped() -> None:
    """The cut is block 2 and the save starts there: nothing of it is sound (an empty save
    would still be sent and acknowledged as if it had stored something)."""
    assert saved_before(_save(2, 2), 2, TPB) is None


def test_a_cut_keeps_only_the_blocks_before_it() -> None:
    """A save of blocks 2..4 cut at block 3 keeps block 2 only, its tokens up to block 3.
    Cutting by the cut's index instead of its distance from the save's first block kept
    blocks 3..4, computed on a failed load: wrong KV stored under their keys."""
    cut = saved_before(_save(2, 3), 3, TPB)
    assert cut is not None
    assert cut.first_block == 2 and cut.pages == [[104, 105]]
    assert len(cut.token_ids) == 3 * TPB and cut.save_id == 7


def test_a_save_in_pieces_names_each_piece_s_own_chain() -> None:
    """A 5-block save in pieces of 2: each piece carries the chain's tokens through its own
    last block, no further (the last piece's key chain ends where its pages end)."""
    pieces = save_pieces(_save(0, 5), 2, TPB)
    assert [(p.first_block, p.end_block) for p in pieces] == [(0, 2), (2, 4), (4, 5)]
    assert [len(p.token_ids) for p in pieces] == [2 * TPB, 4 * TPB, 5 * TPB]


def test_workers_reports_aggregate_to_what_every_worker_did() -> None:
    """Two workers: a save is over for the scheduler only once both acknowledged it (their
    counts add up), and the loads confirmed are those of the step every worker finished:
    the slower worker's (the faster one's step confirmed a load the other still ran, and
    its failure came too late to keep its pages bad)."""
    a = KVTierWorkerMetadata({1: 1, 2: 1}, {"loaded": 3}, step=5)
    b = KVTierWorkerMetadata({1: 1}, {"loaded": 2}, step=3)
    both = a.aggregate(b)
    assert isinstance(both, KVTierWorkerMetadata)
    assert both.saves_done == {1: 2, 2: 1} and both.counters == {"loaded": 5}
    assert both.step == 3


def test_freed_without_waiting_withdraws_what_still_runs() -> None:
    """vLLM freed A without waiting (the scheduler saw every save over): a save of it still
    running is told not to publish (its pages may be another request's by now); a save
    already done is left alone."""
    ledger = SaveLedger()
    withdrawn: list[str] = []
    running: Future[bool] = Future()
    done: Future[bool] = Future()
    done.set_result(True)
    ledger.planned("A")
    ledger.submitted("A", done, lambda: withdrawn.append("done"))
    ledger.submitted("A", running, lambda: withdrawn.append("running"))
    assert ledger.withdraw("A") == 1 and withdrawn == ["running"]
    withdrawn.clear()
    ledger.undelayed("A")
    assert withdrawn == ["running"]


def test_a_request_freed_without_waiting_is_never_reported_sent() -> None:
    """vLLM finished A while a save ran (A is finishing), then freed it without waiting:
    once the save ends, A is not in finished_sending (vLLM asserts that a request it
    reports sent still exists: an engine crash)."""
    ledger = SaveLedger()
    fut: Future[bool] = Future()
    ledger.planned("A")
    ledger.submitted("A", fut)
    assert ledger.finished_sending(["A"]) == set()
    ledger.undelayed("A")
    fut.set_result(True)
    ledger.over("A", 0)
    assert ledger.finished_sending([]) == set()


def test_a_pending_save_holds_only_its_own_blocks_of_its_own_chain() -> None:
    """A save of blocks 2..3 of tenant t's chain: a lookup of block 2 or 3 of that chain
    waits on it; of block 1 (not in it), of another tenant's chain or of other tokens,
    it does not (waiting there delays a request up to PENDING_SAVE_WAIT_S for nothing)."""
    saves = PendingSaves(tp_size=1, tokens_per_block=TPB)
    tokens = np.arange(1, 4 * TPB + 1, dtype=np.uint32)
    saves.add("t", tokens, 2, 4)
    assert saves.holds("t", tokens, 2) and saves.holds("t", tokens, 3)
    assert not saves.holds("t", tokens, 1)
    assert not saves.holds("u", tokens, 2) and not saves.holds(None, tokens, 2)
    other = tokens.copy()
    other[0] += 1000
    assert not saves.holds("t", other, 2)


def test_a_slow_acknowledgement_is_not_forgotten_early() -> None:
    """A save acknowledged 3 wait-periods after it was planned (a slow worker) is still
    pending until then and over after: only saves unacknowledged ten wait-periods are
    forgotten (a forgotten save is never over: its request is held until the workers
    report it)."""
    saves = PendingSaves(tp_size=1, tokens_per_block=TPB)
    s = saves.add(None, np.arange(TPB, dtype=np.uint32), 0, 1)
    saves.prune(time.monotonic() + 3 * PENDING_SAVE_WAIT_S)
    assert not saves.over([s])
    saves.acked({s: 1})
    assert saves.over([s])
