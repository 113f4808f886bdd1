"""The scheduler side's load and save plans and its bookkeeping of failures, no daemon (the
daemon's answer is given): an uncacheable request is never tracked, a load vLLM did not
accept is not planned, a consumer saves nothing, a save stops at the pages it has, a failed
load forgets exactly the blocks it spoiled, a preempted request's pages are no longer its
own, and the step that waits on saves is not timed as prefill. Each was found unpinned by a
mutation review of the connector: a test fails on its mutant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.metadata import KVTierWorkerMetadata
from kvtier.connectors.vllm.scheduler import SchedulerSide

from tests.support.connector_sched import PROMPT, TPB, daemon_holds, request, scheduler, step
from tests.support.vllm_fakes import fake as NS


def _alloc(sched: SchedulerSide, req: Any, pages: list[int], external: int = 0) -> None:
    sched.update_state_after_alloc(req, NS(get_block_ids=lambda: (pages,)), external)


def _output(sched: SchedulerSide, step: int = -1, invalid: set[int] | None = None,
            done: dict[int, int] | None = None) -> None:
    sched.update_connector_output(NS(
        kv_connector_worker_meta=KVTierWorkerMetadata(saves_done=done or {}, step=step),
        invalid_block_ids=invalid or set()))


def test_an_uncacheable_request_is_never_tracked_nor_saved(tmp_path: Path) -> None:
    """A multimodal request's KV depends on its image, not its token ids alone: saved under
    its token ids, a text request with the same placeholder ids would load it."""
    sched = scheduler(tmp_path)
    try:
        _alloc(sched, request("A", PROMPT, mm_features=[object()]), list(range(10, 19)))
        assert "A" not in sched._states
        assert step(sched, {"A": (0, len(PROMPT))}).saves == []
    finally:
        sched.shutdown()


def test_a_load_vllm_did_not_accept_is_not_planned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kvtier offered 4 blocks but vLLM allocated the request with no external tokens (it
    computes them all): no load is planned into pages vLLM is about to compute, and the
    blocks are saved once computed, as any other's."""
    sched = scheduler(tmp_path)
    try:
        daemon_holds(monkeypatch)
        req = request("A", PROMPT)
        assert sched.get_num_new_matched_tokens(req, 0) == (4 * TPB, False)
        _alloc(sched, req, list(range(10, 19)), external=0)
        meta = step(sched, {"A": (0, len(PROMPT))})
        assert meta.loads == [] and meta.async_loads == []
        assert [(s.first_block, s.end_block) for s in meta.saves] == [(0, 4)]
    finally:
        sched.shutdown()


def test_a_consumer_plans_no_save(tmp_path: Path) -> None:
    """A kv_consumer (a decode instance) loads only: a whole prompt computed saves nothing."""
    sched = scheduler(tmp_path, role="kv_consumer")
    try:
        _alloc(sched, request("A", PROMPT), list(range(10, 19)))
        assert step(sched, {"A": (0, len(PROMPT))}).saves == []
    finally:
        sched.shutdown()


def test_a_save_stops_at_the_pages_the_request_has(tmp_path: Path) -> None:
    """The step completes 3 blocks but the request holds pages for 2 only: blocks 0..1 are
    saved and block 2 is saved once its pages are known (counted saved without pages, it
    was never offloaded)."""
    sched = scheduler(tmp_path)
    try:
        _alloc(sched, request("A", PROMPT), [10, 11, 12, 13])
        meta = step(sched, {"A": (0, 3 * TPB)})
        assert [(s.first_block, s.end_block) for s in meta.saves] == [(0, 2)]
        assert sched._states["A"].known_blocks == 2
        meta = step(sched, {"A": (3 * TPB, 1)}, new_ids={"A": [14, 15, 16]})
        assert [(s.first_block, s.pages) for s in meta.saves] == [(2, [[14, 15]])]
    finally:
        sched.shutdown()


def test_a_failure_mid_block_forgets_that_block(tmp_path: Path) -> None:
    """The second page of block 1 failed to load: blocks from 1 on are no longer known (a
    failed load drops their saves) and block 1 is saved again once rewritten; rounding the
    failed page up forgot only from block 2 and block 1 was never offloaded again."""
    sched = scheduler(tmp_path)
    try:
        _alloc(sched, request("A", PROMPT), list(range(10, 19)))
        step(sched, {"A": (0, 3 * TPB)})
        assert sched._states["A"].known_blocks == 3
        _output(sched, invalid={13})
        assert sched._states["A"].known_blocks == 1
    finally:
        sched.shutdown()


def test_a_failure_past_what_is_known_raises_nothing(tmp_path: Path) -> None:
    """A request with one block known fails on a page of its block 3: it still knows 1
    block, not 3 (blocks 1..2 were never saved: counted known, they never would be)."""
    sched = scheduler(tmp_path)
    try:
        _alloc(sched, request("A", PROMPT), list(range(10, 19)))
        step(sched, {"A": (0, TPB)})
        assert sched._states["A"].known_blocks == 1
        _output(sched, invalid={16})
        assert sched._states["A"].known_blocks == 1
    finally:
        sched.shutdown()


def test_a_preempted_request_s_old_pages_are_not_marked_bad_by_its_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A was preempted and gave up pages 10..13; B got 12 and 20 and its load into 12 failed.
    Bad is 12 alone (20 was loaded whole in the same load), not 13: A holds no page any
    more, and 13 may be a sound page of another request now (marked bad, its saves stop
    and its sharers are rolled back for nothing)."""
    sched = scheduler(tmp_path)
    try:
        _alloc(sched, request("A", PROMPT), [10, 11, 12, 13])
        step(sched, {"A": (0, 2 * TPB)})
        step(sched, {}, preempted=("A",))
        assert sched._states["A"].page_ids == []
        daemon_holds(monkeypatch, hits=1)
        b = request("B", PROMPT[:TPB + 1])
        assert sched.get_num_new_matched_tokens(b, 0) == (TPB, False)
        _alloc(sched, b, [12, 20], external=TPB)
        meta = step(sched, {"B": (TPB, 1)})
        _output(sched, step=meta.step, invalid={12})
        assert sched._bad.pages == {12}
    finally:
        sched.shutdown()


def test_a_resumed_request_is_freed_once_its_new_saves_are_over(tmp_path: Path) -> None:
    """A's first save is never acknowledged (the workers waited for it when A was preempted
    and forgot it); resumed, A saves again and that save is acknowledged: A is freed at
    once, not held until a report of the forgotten save that never comes."""
    sched = scheduler(tmp_path)
    try:
        req = request("A", PROMPT)
        _alloc(sched, req, [10, 11, 12, 13])
        assert len(step(sched, {"A": (0, 2 * TPB)}).saves) == 1
        step(sched, {}, preempted=("A",))
        pages = list(range(10, 19))
        _alloc(sched, req, pages)
        meta = step(sched, {"A": (2 * TPB, 2 * TPB)}, new_ids={"A": pages}, resumed=("A",))
        assert [(s.first_block, s.end_block) for s in meta.saves] == [(2, 4)]
        _output(sched, done={meta.saves[0].save_id: 1})
        assert sched.request_finished(req) == (False, None)
    finally:
        sched.shutdown()


def test_a_step_waiting_on_a_preempted_request_s_saves_is_not_timed(tmp_path: Path) -> None:
    """The workers wait for a preempted request's saves before its pages go to others: that
    step is not a measure of prefill speed (timed, recomputing looked slower than it is
    and slow tiers were loaded)."""
    sched = scheduler(tmp_path)
    try:
        _alloc(sched, request("A", PROMPT), [10, 11, 12, 13])
        _alloc(sched, request("B", PROMPT), list(range(20, 29)))
        step(sched, {"A": (0, 2 * TPB)})
        step(sched, {"B": (0, 2 * TPB)}, preempted=("A",))
        assert sched._step_started is None
        step(sched, {"B": (2 * TPB, 2 * TPB)})
        assert sched._step_started is not None   # (a step waiting on nothing is timed)
    finally:
        sched.shutdown()


def test_a_sharer_of_a_failed_page_is_reported_stale_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A's load failed on page 12, which vLLM keeps in its prefix cache. B arrives and
    counts A's pages computed (a prefix-cache hit): the step names 12 as stale, so that
    vLLM rolls B back (else B decodes on KV that is not its prompt's); 13 was loaded whole."""
    sched = scheduler(tmp_path)
    try:
        daemon_holds(monkeypatch)
        a = request("A", PROMPT[:2 * TPB + 1])
        assert sched.get_num_new_matched_tokens(a, 0) == (2 * TPB, False)
        pages = [10, 11, 12, 13, 14]
        _alloc(sched, a, pages, external=2 * TPB)
        meta = step(sched, {"A": (2 * TPB, 1)})
        _output(sched, step=meta.step, invalid={12})
        _alloc(sched, request("B", PROMPT[:2 * TPB + 1]), [10, 11, 12, 13, 15])
        meta = sched.build_connector_meta(NS(
            preempted_req_ids=[], num_scheduled_tokens={"B": 1}, total_num_scheduled_tokens=1,
            scheduled_new_reqs=[NS(req_id="B", block_ids=([10, 11, 12, 13, 15],),
                                   num_computed_tokens=2 * TPB)],
            scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                     num_computed_tokens=[])))
        assert meta.stale_pages == [12]
        # the workers echo the report in the step's invalid block ids: no news. Bad are
        # 12, A's 14 and B's 15 (computed on 12 in this step); taken as a failure of B's
        # pages from 12 on, the echo marked A's sound loaded page 13 bad as well
        _output(sched, step=meta.step, invalid={12})
        assert sched._bad.pages == {12, 14, 15}
    finally:
        sched.shutdown()


def test_a_save_names_the_pages_a_load_of_its_step_fills(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loads blocks 0..1 and computes block 2 on them in one step: its save of block 2
    names the loaded pages (with the step), so that a worker whose load failed cuts the
    save (block 2 was computed on pages that may not hold the prompt's KV)."""
    sched = scheduler(tmp_path)
    try:
        daemon_holds(monkeypatch, hits=2)
        a = request("A", PROMPT[:3 * TPB + 1])
        assert sched.get_num_new_matched_tokens(a, 0) == (2 * TPB, False)
        _alloc(sched, a, list(range(10, 17)), external=2 * TPB)
        meta = step(sched, {"A": (2 * TPB, TPB + 1)})
        assert [(s.first_block, s.end_block) for s in meta.saves] == [(2, 3)]
        assert meta.saves[0].loaded_pages == [(0, 10, meta.step), (0, 11, meta.step),
                                              (1, 12, meta.step), (1, 13, meta.step)]
    finally:
        sched.shutdown()


def test_a_resumed_request_does_not_save_again_what_it_saved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A saved 3 blocks, was preempted and, resumed, loads back 2 of them: block 2 is still
    known (saved), so its next save starts at block 3, not again at 2."""
    sched = scheduler(tmp_path)
    try:
        req = request("A", PROMPT)
        _alloc(sched, req, list(range(10, 16)))
        saves = step(sched, {"A": (0, 3 * TPB)}).saves
        assert [(s.first_block, s.end_block) for s in saves] == [(0, 3)]
        _output(sched, done={saves[0].save_id: 1})
        step(sched, {}, preempted=("A",))
        daemon_holds(monkeypatch, hits=2)
        assert sched.get_num_new_matched_tokens(req, 0) == (2 * TPB, False)
        pages = list(range(20, 29))
        _alloc(sched, req, pages, external=2 * TPB)
        assert sched._states["A"].known_blocks == 3
        meta = step(sched, {"A": (2 * TPB, 2 * TPB)}, new_ids={"A": pages}, resumed=("A",))
        assert [(s.first_block, s.end_block) for s in meta.saves] == [(3, 4)]
    finally:
        sched.shutdown()
