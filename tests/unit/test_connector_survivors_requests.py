"""The scheduler side across a request's whole life, no daemon (the daemon's answer is
given): what a request that never ran leaves behind, where an async engine's loads go and
that each is planned once, the step numbers that name loads, a pending save's own range,
and an empty allocation that must not wipe a request's pages. Each was found unpinned by a
mutation review of the connector: a test fails on its mutant."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.link import DaemonLink
from kvtier.connectors.vllm.metadata import KVTierWorkerMetadata

from tests.support.connector_sched import (
    PROMPT,
    TPB,
    daemon_holds,
    request,
    scheduler,
    step,
)
from tests.support.vllm_fakes import fake as NS


def test_a_request_finished_before_it_ran_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Looked up (a load span, blocks skipped as slower than recompute) and aborted while
    waiting: finished, nothing of it stays in the scheduler side (a long-running engine
    would keep one entry per aborted request)."""
    sched = scheduler(tmp_path)
    try:
        daemon_holds(monkeypatch, hits=2)
        req = request("A", PROMPT)
        assert sched.get_num_new_matched_tokens(req, 0) == (2 * TPB, False)
        monkeypatch.setattr(DaemonLink, "lookup_result", lambda self, ns, keys: NS(
            hits=len(keys), tiers=["redis"] * len(keys), bandwidth={"redis": 1000.0}))
        assert sched.get_num_new_matched_tokens(request("B", PROMPT), 0) == (0, False)
        assert "A" in sched._spans and "B" in sched._skips
        assert sched.request_finished(req) == (False, None)
        assert sched.request_finished(request("B", PROMPT)) == (False, None)
        assert sched._spans == {} and sched._skips == {}
    finally:
        sched.shutdown()


def test_an_async_engine_s_load_is_planned_once_as_async(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``async_load`` the load goes in ``async_loads`` (vLLM waits for the worker to
    report it received, never schedules the request on it before), once: the next step
    plans it no more (loaded again, it overwrote pages the request had computed on)."""
    sched = scheduler(tmp_path, async_load=True)
    try:
        daemon_holds(monkeypatch, hits=2)
        req = request("A", PROMPT)
        assert sched.get_num_new_matched_tokens(req, 0) == (2 * TPB, True)
        sched.update_state_after_alloc(req, NS(get_block_ids=lambda: (list(range(10, 19)),)),
                                       2 * TPB)
        meta = step(sched, {})
        assert meta.loads == [] and [s.end_block for s in meta.async_loads] == [2]
        meta = step(sched, {"A": (2 * TPB, 1)})
        assert meta.loads == [] and meta.async_loads == []
    finally:
        sched.shutdown()


def test_each_step_has_its_own_number(tmp_path: Path) -> None:
    """The metadata's step names the loads the workers confirm: each step's is the next
    (one number for every step, a report of the first confirmed every later load)."""
    sched = scheduler(tmp_path)
    try:
        assert [step(sched, {}).step for _ in range(3)] == [0, 1, 2]
    finally:
        sched.shutdown()


def test_a_pending_save_holds_only_the_blocks_it_saves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A saved blocks 0..1 (acknowledged) and now saves 2..3. B shares A's prompt and the
    daemon lost block 1: B's next block (1) is in no save in flight, so B is answered at
    once (1 block), not told to wait on A's save of blocks 2..3."""
    sched = scheduler(tmp_path)
    try:
        sched.update_state_after_alloc(request("A", PROMPT),
                                       NS(get_block_ids=lambda: (list(range(10, 19)),)), 0)
        first = step(sched, {"A": (0, 2 * TPB)}).saves
        sched.update_connector_output(NS(
            kv_connector_worker_meta=KVTierWorkerMetadata(saves_done={first[0].save_id: 1}),
            invalid_block_ids=set()))
        assert [(s.first_block, s.end_block)
                for s in step(sched, {"A": (2 * TPB, 2 * TPB)}).saves] == [(2, 4)]
        daemon_holds(monkeypatch, hits=1)
        assert sched.get_num_new_matched_tokens(request("B", PROMPT), 0) == (TPB, False)
    finally:
        sched.shutdown()


def test_an_empty_allocation_keeps_the_request_s_pages(tmp_path: Path) -> None:
    """vLLM calls update_state_after_alloc again with no new pages (an empty block list):
    the request keeps the pages it holds, and its next block is saved from its own page.
    Wiped, the pages added next were taken for block 0's and block 2's KV was stored
    under block 0's key."""
    sched = scheduler(tmp_path)
    try:
        req = request("A", PROMPT)
        sched.update_state_after_alloc(req, NS(get_block_ids=lambda: ([10, 11, 12, 13],)), 0)
        assert [s.pages for s in step(sched, {"A": (0, 2 * TPB)}).saves] == \
            [[[10, 11], [12, 13]]]
        sched.update_state_after_alloc(req, NS(get_block_ids=lambda: ([],)), 0)
        assert sched._states["A"].page_ids == [10, 11, 12, 13]
    finally:
        sched.shutdown()
