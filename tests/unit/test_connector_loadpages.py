"""Which planned load covers each engine page (connectors/vllm/loadpages.py): the index
against a plain scan of every load, and the scheduler side ending an older load when its
pages go fresh to another request (no daemon: loads are only planned here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.config import ConnectorConfig
from kvtier.connectors.vllm.loadpages import LoadPages
from kvtier.connectors.vllm.mapping import LoadSpan
from kvtier.connectors.vllm.metadata import KVTierWorkerMetadata
from kvtier.connectors.vllm.scheduler import SchedulerSide

from kvtier.layout import KVLayout
from tests.support.vllm_fakes import fake as NS

PAGE, TPB = 32, 64
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32",
                  tokens_per_block=TPB)

_REQS = st.sampled_from(["A", "B", "C", "D"])
_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), _REQS, st.lists(st.integers(0, 12), max_size=6)),
    st.tuples(st.just("drop"), _REQS, st.just([])),
    st.tuples(st.just("holders"), _REQS, st.lists(st.integers(0, 12), max_size=6)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_the_index_answers_as_a_scan_of_every_load(ops: list[tuple[str, str, list[int]]]) -> None:
    """Shared pages, a page twice in one load, a load replaced, dropped twice: the holders
    of any pages are those a scan of every tracked load finds."""
    index, loads = LoadPages(), {}
    for op, rid, pages in ops:
        if op == "add":
            index.add(rid, list(pages))
            loads[rid] = list(pages)
        elif op == "drop":
            index.drop(rid)
            loads.pop(rid, None)
        else:
            assert index.holders(pages) == {r for r, held in loads.items()
                                             if not set(pages).isdisjoint(held)}
        assert len(index) == len(loads)
    assert index.holders(range(13)) == {r for r, held in loads.items() if held}


def _request(rid: str, ids: list[int]) -> Any:
    return NS(request_id=rid, all_token_ids=ids, num_prompt_tokens=len(ids),
              num_tokens=len(ids), cache_salt=None, mm_features=None, prompt_embeds=None,
              lora_request=None)


def _admit(sched: SchedulerSide, rid: str, pages: list[int], *, blocks: int,
           skip_pages: int = 0) -> None:
    """``rid`` admitted with a load of its first ``blocks`` kvtier blocks into ``pages``."""
    sched._spans[rid] = LoadSpan(0, blocks, skip_pages, blocks * TPB - 1)
    sched.update_state_after_alloc(_request(rid, list(range(1, blocks * TPB + 1))),
                                   NS(get_block_ids=lambda: (pages,)), blocks * TPB - 1)


def test_a_load_into_pages_a_preempted_request_gave_up_ends_its_load(tmp_path: Path) -> None:
    """A loads into pages 10-13 and is preempted; B gets 12-15 fresh and loads: A's load
    is over (a failure of page 12 is B's), while C, which shares A's page 10 as a locally
    cached page and loads 20-21, keeps its load. A failed page ends only its holders'
    loads, and a finished request's load leaves the index."""
    cfg = ConnectorConfig.from_extra({"socket_path": str(tmp_path / "none.sock"),
                                      "tokens_per_block": TPB, "model_id": "m"},
                                     block_size=PAGE, default_model_id="m")
    sched = SchedulerSide(cfg, LAYOUT, PAGE, 1)
    try:
        _admit(sched, "A", [10, 11, 12, 13], blocks=2)
        _admit(sched, "C", [10, 11, 20, 21], blocks=2, skip_pages=2)
        a, c = sched._states["A"], sched._states["C"]
        assert a.load is not None and c.load is not None
        _admit(sched, "B", [12, 13, 14, 15], blocks=2)
        b = sched._states["B"]
        assert a.load is None and b.load is not None and c.load is not None
        assert b.load.page_ids == [12, 13, 14, 15]
        sched.update_connector_output(NS(kv_connector_worker_meta=KVTierWorkerMetadata(),
                                         invalid_block_ids={12}))
        assert b.load is None and b.load_failed and not a.load_failed
        assert c.load is not None and not c.load_failed
        # D gets page 10 fresh once A and C are gone: nothing of theirs is left to end
        sched.request_finished(_request("C", []))
        assert len(sched._load_pages) == 0
        _admit(sched, "D", [10, 11, 30, 31], blocks=2)
        assert sched._states["D"].load is not None and len(sched._load_pages) == 1
    finally:
        sched.shutdown()
