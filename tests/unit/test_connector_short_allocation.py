"""A product bug a mutation review of the connector found, pinned since its fix: a load
that vLLM gave fewer pages than it accepted claimed tokens it never loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.metadata import KVTierConnectorMetadata
from kvtier.connectors.vllm.scheduler import SchedulerSide

from tests.support.connector_sched import TPB, daemon_holds, request, scheduler, step
from tests.support.vllm_fakes import fake


def _claim_then_run(sched: SchedulerSide, pages: list[int]) -> KVTierConnectorMetadata:
    """A 129-token prompt whose 2 blocks kvtier holds: the claim (128 tokens, which vLLM
    accepts), an allocation of ``pages``, then the step that runs it."""
    req = request("A", list(range(1, 2 * TPB + 2)))
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * TPB, False)
    sched.update_state_after_alloc(req, fake(get_block_ids=lambda: (pages,)), 2 * TPB)
    return step(sched, {"A": (2 * TPB, 1)})


def test_a_load_short_of_pages_reports_the_blocks_it_does_not_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kvtier claimed 2 blocks (128 tokens) and vLLM accepted them, but the request's
    pages cover 1.5 blocks (3 pages of 32 tokens). Before the fix the connector planned a
    1-block load, named no page stale or failed, and counted 2 blocks known: vLLM then
    counted tokens 64..127 computed while no load filled them (wrong KV). Now the block it
    cannot load reaches vLLM as a load error of the page it does hold, and only the loaded
    block counts known. (Unreachable with full attention: the geometry refuses
    sliding-window and hybrid caches.)"""
    daemon_holds(monkeypatch)
    sched = scheduler(tmp_path)
    try:
        meta = _claim_then_run(sched, [10, 11, 12])
        assert [(s.first_block, s.end_block, s.page_ids) for s in meta.loads] == \
            [(0, 1, [10, 11])]
        assert meta.stale_pages == [12]   # the workers report it: vLLM recomputes from it
        assert sched._states["A"].known_blocks == 1
        assert sched.hit_tokens == TPB    # what is loaded, not what was claimed
    finally:
        sched.shutdown()


def test_a_load_with_no_whole_row_plans_nothing_and_reports_every_page(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One page for a 2-block claim (a block is 2 pages): nothing can be loaded, so no
    load is planned, nothing counts known, and the page the request holds is reported."""
    daemon_holds(monkeypatch)
    sched = scheduler(tmp_path)
    try:
        meta = _claim_then_run(sched, [10])
        assert meta.loads == [] and meta.async_loads == []
        assert meta.stale_pages == [10]
        assert sched._states["A"].known_blocks == 0 and sched.hit_tokens == 0
    finally:
        sched.shutdown()
