"""Pages that do not hold their prompt's KV (connectors/vllm/badpages.py), and the saves the
scheduler side plans around them (no daemon: a save is only planned here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.badpages import BadPages
from kvtier.connectors.vllm.config import ConnectorConfig
from kvtier.connectors.vllm.metadata import KVTierWorkerMetadata, TransferSpec
from kvtier.connectors.vllm.scheduler import SchedulerSide

from kvtier.layout import KVLayout
from tests.support.vllm_fakes import fake as NS

PAGE, TPB = 32, 64
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32",
                  tokens_per_block=TPB)


def test_a_page_rewritten_over_two_steps_is_sound_again() -> None:
    bad = BadPages(PAGE)
    pages = list(range(100, 108))
    assert bad.failed(pages, {102}) == 2 and bad.pages == set(pages[2:])
    bad.rewritten(pages, 64, 100)       # page 2 whole, page 3 up to its 4th token
    assert bad.pages == set(pages[3:])
    bad.rewritten(pages, 100, 130)      # page 3's rest, then page 4 in part
    assert bad.pages == set(pages[4:])


def test_a_write_from_a_page_s_middle_or_on_a_bad_prefix_does_not_clear() -> None:
    bad = BadPages(PAGE)
    pages = list(range(200, 206))
    bad.failed(pages, {201})
    bad.rewritten(pages, 40, 64)        # page 1 from its middle, nothing before it on record
    assert 201 in bad.pages
    clean = BadPages(PAGE)
    clean.failed([9, 10], {9})
    clean.rewritten(pages, 0, 192)      # another request's pages: all sound, nothing to do
    assert clean.pages == {9, 10}
    sharer = [9, 10, 11, 12]            # holds the bad pages 9, 10 as its prefix
    clean.rewritten(sharer, 64, 128)    # computes pages 11, 12 on them: bad too
    assert clean.pages == {9, 10, 11, 12}


def test_a_load_that_succeeds_makes_a_page_sound() -> None:
    bad = BadPages(PAGE)
    bad.failed([5, 6, 7], {5})
    bad.loaded({6, 7, 8})
    assert bad.pages == {5}


def _step(sched: SchedulerSide, computed: int, n: int) -> list[tuple[int, int]]:
    """One scheduler step of request A: ``n`` tokens scheduled from ``computed``; the
    (first, end) blocks of the saves it plans."""
    meta = sched.build_connector_meta(NS(
        preempted_req_ids=[], num_scheduled_tokens={"A": n}, total_num_scheduled_tokens=n,
        scheduled_new_reqs=[], scheduled_cached_reqs=NS(
            req_ids=["A"], new_block_ids=[None], resumed_req_ids=set(),
            num_computed_tokens=[computed])))
    return [(s.first_block, s.end_block) for s in meta.saves]


def request(ids: list[int]) -> Any:
    return NS(request_id="A", all_token_ids=ids, num_prompt_tokens=len(ids),
              num_tokens=len(ids), cache_salt=None, mm_features=None, prompt_embeds=None,
              lora_request=None)


def test_a_recompute_in_chunks_that_end_mid_page_is_saved_again(tmp_path: Path) -> None:
    """After a failed load vLLM recomputes a 512-token prompt in chunks of 250 and 262
    tokens (a decode token in the budget ends the first mid-page): blocks 3..7 were never
    saved again (review repro)."""
    cfg = ConnectorConfig.from_extra({"socket_path": str(tmp_path / "none.sock"),
                                      "tokens_per_block": TPB, "model_id": "m"},
                                     block_size=PAGE, default_model_id="m")
    sched = SchedulerSide(cfg, LAYOUT, PAGE, 1)
    ids = list(range(1, 513))
    pages = list(range(100, 117))
    sched.update_state_after_alloc(request(ids), NS(get_block_ids=lambda: (pages,)), 0)
    state = sched._states["A"]
    state.known_blocks = 4              # 4 blocks loaded into pages 100..107 ...
    state.load = TransferSpec("A", None, np.asarray(ids[:256], dtype=np.uint32), 0,
                              [[100, 101], [102, 103], [104, 105], [106, 107]])
    sched.update_connector_output(NS(kv_connector_worker_meta=KVTierWorkerMetadata(),
                                     invalid_block_ids={100, 101}))   # ... the first failed

    try:
        assert state.known_blocks == 0
        assert _step(sched, 0, 250) == [(0, 3)]
        assert _step(sched, 250, 262) == [(3, 8)]
        assert sched._bad.pages == {116}    # the page the decode writes next
    finally:
        sched.shutdown()


def test_a_request_relies_on_the_bad_pages_it_counts_computed_past_what_was_rewritten() -> None:
    bad = BadPages(4)
    pages = [10, 11, 12, 13]
    assert bad.relied_on(pages, 16) == []               # nothing bad: nothing to report
    bad.failed(pages, {11})                             # 11, 12, 13 bad
    assert bad.relied_on(pages, 4) == []                # counts page 10 only
    assert bad.relied_on(pages, 5) == [11]              # one token of 11 is counted
    assert bad.relied_on(pages, 16) == [11, 12, 13]
    bad.rewritten(pages, 4, 6)                          # 11 rewritten up to its 2nd token
    assert bad.relied_on(pages, 6) == []                # reads only what was rewritten
    assert bad.relied_on(pages, 7) == [11]
    bad.rewritten(pages, 6, 8)                          # 11 whole again
    assert bad.relied_on(pages, 8) == [] and bad.relied_on(pages, 9) == [12]


def test_a_speculative_step_saves_no_block_ending_among_its_drafts(tmp_path: Path) -> None:
    """With save_decode_tokens, a decode step that also computes 4 draft tokens counted
    them computed: the block they end was saved with KV of tokens not in all_token_ids
    (drafts may be rejected) and keyed by fewer tokens than it holds (found by review)."""
    cfg = ConnectorConfig.from_extra({"socket_path": str(tmp_path / "none.sock"),
                                      "tokens_per_block": TPB, "model_id": "m",
                                      "save_decode_tokens": True},
                                     block_size=PAGE, default_model_id="m")
    sched = SchedulerSide(cfg, LAYOUT, PAGE, 1)
    ids = list(range(1, 101))                    # a 100-token prompt
    req = NS(request_id="A", all_token_ids=ids, num_prompt_tokens=100, num_tokens=100,
             cache_salt=None, mm_features=None, prompt_embeds=None, lora_request=None)
    pages = [100, 101, 102, 103]
    sched.update_state_after_alloc(req, NS(get_block_ids=lambda: (pages,)), 0)

    try:
        assert _step(sched, 0, 100) == [(0, 1)]          # the prompt's one whole block
        ids.extend(range(1001, 1028))            # 27 tokens decoded: 127 known
        assert _step(sched, 126, 5) == []                # the last token + 4 drafts: 131 computed
        ids.append(2000)                         # a step later, token 128 is known
        assert _step(sched, 127, 1) == [(1, 2)]          # block 1 is whole now: saved
    finally:
        sched.shutdown()
