"""The scheduler side's plans around a request's life, no daemon (a save is only planned
here; a lookup's answer is given): pages kept while a save still reads them, no save
holding a bad page, a lookup waiting only on a save of its next block, a resumed request's
pages, a cache reset, and a producer saving the prefix it loaded. Each was found unpinned by
a mutation review: a test fails on its mutant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.config import ConnectorConfig
from kvtier.connectors.vllm.link import DaemonLink
from kvtier.connectors.vllm.metadata import KVTierWorkerMetadata
from kvtier.connectors.vllm.scheduler import SchedulerSide

from kvtier.layout import KVLayout
from tests.support.vllm_fakes import fake as NS

PAGE, TPB = 32, 64
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32",
                  tokens_per_block=TPB)


def _request(rid: str, ids: list[int]) -> Any:
    return NS(request_id=rid, all_token_ids=ids, num_prompt_tokens=len(ids),
              num_tokens=len(ids), cache_salt=None, mm_features=None, prompt_embeds=None,
              lora_request=None)


def _sched(tmp_path: Path, role: str | None = None) -> SchedulerSide:
    """A scheduler side whose daemon socket leads nowhere."""
    cfg = ConnectorConfig.from_extra({"socket_path": str(tmp_path / "none.sock"),
                                      "tokens_per_block": TPB, "model_id": "m"},
                                     block_size=PAGE, default_model_id="m", role=role)
    return SchedulerSide(cfg, LAYOUT, PAGE, 1)


def _daemon_answers(monkeypatch: pytest.MonkeyPatch, hits: int | None = None,
                    tier: str = "cpu", bandwidth: dict[str, float] | None = None) -> None:
    """Lookups answered as a daemon holding the first ``hits`` blocks (all when None) in
    ``tier`` would, with no presence filter."""
    monkeypatch.setattr(DaemonLink, "leading_bound", lambda self, keys: None)
    monkeypatch.setattr(DaemonLink, "lookup_result", lambda self, ns, keys: NS(
        hits=len(keys) if hits is None else min(len(keys), hits),
        tiers=[tier] * len(keys), bandwidth=bandwidth or {}))


def test_a_request_finished_while_its_save_runs_keeps_its_pages(tmp_path: Path) -> None:
    """A request whose save no worker has acknowledged yet keeps its pages until the
    workers report it sent (vLLM would hand them to another request while the save still
    copies them: the block stored would hold that request's KV). Once every worker
    acknowledged its saves, it is freed at once and named undelayed to the workers (a
    worker that reported it in finished_sending later would fail vLLM's assertion that the
    request still exists: an engine crash)."""
    sched = _sched(tmp_path)
    try:
        for rid, first in (("A", 10), ("B", 20)):
            pages = list(range(first, first + 5))
            sched.update_state_after_alloc(_request(rid, list(range(1, 2 * TPB + 2))),
                                           NS(get_block_ids=lambda p=pages: (p,)), 0)
        meta = sched.build_connector_meta(NS(
            preempted_req_ids=[], num_scheduled_tokens={"A": 129, "B": 129},
            total_num_scheduled_tokens=258, scheduled_new_reqs=[],
            scheduled_cached_reqs=NS(req_ids=["A", "B"], new_block_ids=[None, None],
                                     resumed_req_ids=set(), num_computed_tokens=[0, 0])))
        _, save_b = (s.save_id for s in meta.saves)
        sched.update_connector_output(NS(
            kv_connector_worker_meta=KVTierWorkerMetadata(saves_done={save_b: 1}),
            invalid_block_ids=set()))
        assert sched.request_finished(_request("A", [])) == (True, None)
        assert sched.request_finished(_request("B", [])) == (False, None)
        meta = sched.build_connector_meta(NS(
            preempted_req_ids=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
            scheduled_new_reqs=[], scheduled_cached_reqs=NS(
                req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])))
        assert meta.undelayed == ["B"]   # else a worker reports B sent: vLLM asserts it lives
    finally:
        sched.shutdown()


def test_no_save_includes_a_bad_second_page_of_a_block(tmp_path: Path) -> None:
    """The second page of block 0 failed to load and the request was not rolled back (a
    sharer under async scheduling, no stale reports): it goes on computing past it. No
    save may hold that page, so block 0 (and everything after it) is not saved; rounding
    the bad page's block up saved block 0 with another prompt's (or zeroed) KV in it."""
    sched = _sched(tmp_path)
    try:
        ids = list(range(1, 201))
        pages = list(range(100, 107))
        sched.update_state_after_alloc(_request("A", ids), NS(get_block_ids=lambda: (pages,)), 0)
        sched.update_connector_output(NS(kv_connector_worker_meta=KVTierWorkerMetadata(),
                                         invalid_block_ids={101}))
        assert sched._bad.pages == set(pages[1:])
        meta = sched.build_connector_meta(NS(
            preempted_req_ids=[], num_scheduled_tokens={"A": 136},
            total_num_scheduled_tokens=136, scheduled_new_reqs=[],
            scheduled_cached_reqs=NS(req_ids=["A"], new_block_ids=[None],
                                     resumed_req_ids=set(), num_computed_tokens=[64])))
        assert meta.saves == [] and sched._states["A"].known_blocks == 0
    finally:
        sched.shutdown()


def test_a_load_confirmed_and_failed_in_one_output_leaves_its_pages_bad(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers' report of a step confirms its loads over, and the same output names the
    one that failed: its pages are bad (the step's loads include it, but it did not
    succeed). Taken as loaded, the failed page was good again at once: a sharer's save
    included it, and nothing rolled the sharer back."""
    sched = _sched(tmp_path)
    try:
        _daemon_answers(monkeypatch)
        req = _request("A", list(range(1, 2 * TPB + 2)))
        assert sched.get_num_new_matched_tokens(req, 0) == (2 * TPB, False)
        pages = [100, 101, 102, 103, 104]
        sched.update_state_after_alloc(req, NS(get_block_ids=lambda: (pages,)), 2 * TPB)
        meta = sched.build_connector_meta(NS(
            preempted_req_ids=[], num_scheduled_tokens={"A": 1},
            total_num_scheduled_tokens=1, scheduled_new_reqs=[],
            scheduled_cached_reqs=NS(req_ids=["A"], new_block_ids=[None],
                                     resumed_req_ids=set(), num_computed_tokens=[2 * TPB])))
        assert [s.page_ids for s in meta.loads] == [[100, 101, 102, 103]]
        sched.update_connector_output(NS(
            kv_connector_worker_meta=KVTierWorkerMetadata(step=meta.step),
            invalid_block_ids={102}))
        assert sched._bad.pages == {102, 104}   # 103 loaded whole; 104 computed on 102
        assert sched._states["A"].load_failed
    finally:
        sched.shutdown()


def test_decode_tokens_are_not_saved_by_default(tmp_path: Path) -> None:
    """Without ``save_decode_tokens`` only the prompt's whole blocks are saved: a block
    that ends among generated tokens is not (every long generation would otherwise write
    a block per 64 tokens it decodes, crowding out the prompts' blocks)."""
    sched = _sched(tmp_path)
    try:
        ids = list(range(1, 101))                     # a 100-token prompt
        req = _request("A", ids)
        sched.update_state_after_alloc(req, NS(get_block_ids=lambda: ([100, 101, 102, 103,
                                                                      104],)), 0)

        def step(computed: int, n: int) -> list[tuple[int, int]]:
            meta = sched.build_connector_meta(NS(
                preempted_req_ids=[], num_scheduled_tokens={"A": n},
                total_num_scheduled_tokens=n, scheduled_new_reqs=[],
                scheduled_cached_reqs=NS(req_ids=["A"], new_block_ids=[None],
                                         resumed_req_ids=set(),
                                         num_computed_tokens=[computed])))
            return [(s.first_block, s.end_block) for s in meta.saves]

        assert step(0, 100) == [(0, 1)]
        ids.extend(range(1001, 1041))                 # 40 tokens decoded: 140 known
        assert step(138, 1) == []                     # 139 computed: block 1 is whole
    finally:
        sched.shutdown()


def test_a_lookup_waits_only_on_a_save_of_its_next_block(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A's save of blocks 0..1 is committed (the daemon finds them) but not acknowledged
    yet. B shares those two blocks and goes on: its next block (2) is in no save, so it
    loads the two at once; waiting on A's save of blocks it already found would hold it
    back a step or more (up to PENDING_SAVE_WAIT_S) for nothing."""
    sched = _sched(tmp_path)
    try:
        _daemon_answers(monkeypatch, hits=2)
        prompt = list(range(1, 2 * TPB + 2))
        sched.update_state_after_alloc(_request("A", prompt),
                                       NS(get_block_ids=lambda: (list(range(10, 15)),)), 0)
        meta = sched.build_connector_meta(NS(
            preempted_req_ids=[], num_scheduled_tokens={"A": len(prompt)},
            total_num_scheduled_tokens=len(prompt), scheduled_new_reqs=[],
            scheduled_cached_reqs=NS(req_ids=["A"], new_block_ids=[None],
                                     resumed_req_ids=set(), num_computed_tokens=[0])))
        assert [(s.first_block, s.end_block) for s in meta.saves] == [(0, 2)]
        b = _request("B", prompt[:2 * TPB] + list(range(5000, 5000 + 2 * TPB + 1)))
        assert sched.get_num_new_matched_tokens(b, 0) == (2 * TPB, sched.config.async_load)
    finally:
        sched.shutdown()


def _step(sched: SchedulerSide, computed: int, n: int, new_ids: Any, *,
          resumed: bool = False, preempted: bool = False) -> list[list[list[int]]]:
    """One step of request A (``n`` tokens from ``computed``): the pages of its saves."""
    meta = sched.build_connector_meta(NS(
        preempted_req_ids=["A"] if preempted else [], num_scheduled_tokens={"A": n},
        total_num_scheduled_tokens=n, scheduled_new_reqs=[],
        scheduled_cached_reqs=NS(
            req_ids=[] if preempted else ["A"], new_block_ids=[] if preempted else [new_ids],
            resumed_req_ids={"A"} if resumed else set(),
            num_computed_tokens=[] if preempted else [computed])))
    return [s.pages for s in meta.saves]


def test_a_resumed_request_saves_its_later_blocks_from_their_own_pages(tmp_path: Path) -> None:
    """A is preempted in the middle of its chunked prefill. When vLLM resumes it, the
    connector sees its pages twice: whole at allocation, and whole again as the resumed
    request's new block ids; they replace what it held, never add to it. Added, a later
    chunk's block was saved from the pages of the prompt's first blocks (another block's
    KV stored under its key: wrong tokens for every later hit on it)."""
    sched = _sched(tmp_path)
    try:
        ids = list(range(1, 4 * TPB + 2))
        req = NS(request_id="A", all_token_ids=ids, num_prompt_tokens=len(ids),
                 num_tokens=len(ids), cache_salt=None, mm_features=None, prompt_embeds=None,
                 lora_request=None)
        sched.update_state_after_alloc(req, NS(get_block_ids=lambda: ([10, 11, 12, 13],)), 0)
        assert _step(sched, 0, 2 * TPB, None) == [[[10, 11], [12, 13]]]
        assert _step(sched, 0, 0, None, preempted=True) == []
        resumed = [10, 11, 12, 13, 14, 15]      # its two blocks a prefix-cache hit, one new
        sched.update_state_after_alloc(req, NS(get_block_ids=lambda: (resumed,)), 0)
        assert _step(sched, 2 * TPB, TPB, (resumed,), resumed=True) == [[[14, 15]]]
        assert _step(sched, 3 * TPB, TPB, ([16, 17],)) == [[[16, 17]]]
    finally:
        sched.shutdown()


def test_a_request_in_flight_at_a_reset_saves_nothing_more(tmp_path: Path) -> None:
    """A request in flight when the weights change holds KV of the old weights and goes
    on with the new: what it computes after the reset is saved under no name (its salt is
    the old weights', so an engine still on them would load the new weights' KV as its
    own: wrong tokens). A request arriving after the reset saves under the new salt."""
    sched = _sched(tmp_path)
    try:
        def req(rid: str) -> Any:
            ids = list(range(1, 2 * TPB + 2))
            return NS(request_id=rid, all_token_ids=ids, num_prompt_tokens=len(ids),
                      num_tokens=len(ids), cache_salt=None, mm_features=None,
                      prompt_embeds=None, lora_request=None)
        sched.update_state_after_alloc(req("A"), NS(get_block_ids=lambda: ([1, 2, 3, 4, 5],)), 0)
        old_salt = sched._states["A"].salt
        assert sched.reset_cache()
        sched.update_state_after_alloc(req("B"), NS(get_block_ids=lambda: ([6, 7, 8, 9, 10],)), 0)
        meta = sched.build_connector_meta(NS(
            preempted_req_ids=[], num_scheduled_tokens={"A": 129, "B": 129},
            total_num_scheduled_tokens=258, scheduled_new_reqs=[],
            scheduled_cached_reqs=NS(req_ids=["A", "B"], new_block_ids=[None, None],
                                     resumed_req_ids=set(), num_computed_tokens=[0, 0])))
        assert [(s.req_id, s.end_block) for s in meta.saves] == [("B", 2)]
        assert meta.saves[0].cache_salt != old_salt
    finally:
        sched.shutdown()


def test_a_request_whose_adapter_changes_on_disk_saves_nothing_more(tmp_path: Path) -> None:
    """A LoRA request's salt names its adapter's fingerprint when it arrived; its files
    replaced before its next save (vLLM may have reloaded them: its later KV may be the new
    version's), that save and every later one of it are dropped, never published under the
    old version's name. A request of an unchanged adapter saves as before."""
    from kvtier.connectors.vllm import salts

    sched = _sched(tmp_path)
    salts._ADAPTER_FINGERPRINTS.clear()
    try:
        adapters = {}
        for name in ("x", "y"):
            d = tmp_path / name
            d.mkdir()
            (d / "adapter_config.json").write_text('{"r": 8}')
            (d / "adapter_model.safetensors").write_bytes(name.encode() * 4096)
            adapters[name] = d

        def req(rid: str, adapter: str) -> Any:
            ids = list(range(1, 2 * TPB + 2))
            lora = NS(lora_name=adapter, lora_path=str(adapters[adapter]), lora_int_id=7)
            return NS(request_id=rid, all_token_ids=ids, num_prompt_tokens=len(ids),
                      num_tokens=len(ids), cache_salt=None, mm_features=None,
                      prompt_embeds=None, lora_request=lora)

        def step(computed: int, n: int) -> list[tuple[str, int]]:
            """Both requests compute ``n`` tokens from ``computed``: the saves planned."""
            meta = sched.build_connector_meta(NS(
                preempted_req_ids=[], num_scheduled_tokens={"A": n, "B": n},
                total_num_scheduled_tokens=2 * n, scheduled_new_reqs=[],
                scheduled_cached_reqs=NS(req_ids=["A", "B"], new_block_ids=[None, None],
                                         resumed_req_ids=set(),
                                         num_computed_tokens=[computed, computed])))
            return [(s.req_id, s.end_block) for s in meta.saves]

        for rid, adapter, pages in (("A", "x", [1, 2, 3, 4, 5]), ("B", "y", [6, 7, 8, 9])):
            sched.update_state_after_alloc(req(rid, adapter),
                                           NS(get_block_ids=lambda p=pages: (p,)), 0)
        assert step(0, TPB) == [("A", 1), ("B", 1)]
        (adapters["x"] / "adapter_model.safetensors").write_bytes(b"z" * 4096)
        assert step(TPB, TPB + 1) == [("B", 2)]
    finally:
        sched.shutdown()
        salts._ADAPTER_FINGERPRINTS.clear()


@pytest.mark.parametrize("role", ["kv_producer", "kv_both"])
def test_a_producer_saves_the_prefix_it_loaded(tmp_path: Path, role: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill instance loads a 2-block prefix its daemon holds (maybe in cpu or nvme
    only): as a kv_producer it saves those blocks too, so that its synchronous commit
    makes the whole chain visible in Redis to the decode instance (a chain missing its
    head there is a miss for every block of it). kv_both does not save them again."""
    sched = _sched(tmp_path, role=role)
    try:
        _daemon_answers(monkeypatch, hits=2, tier="nvme")
        ids = list(range(1, 3 * TPB + 2))
        req = NS(request_id="A", all_token_ids=ids, num_prompt_tokens=len(ids),
                 num_tokens=len(ids), cache_salt=None, mm_features=None, prompt_embeds=None,
                 lora_request=None)
        assert sched.get_num_new_matched_tokens(req, 0)[0] == 2 * TPB
        sched.update_state_after_alloc(req, NS(get_block_ids=lambda: (list(range(10, 17)),)),
                                       2 * TPB)
        n = len(ids) - 2 * TPB
        meta = sched.build_connector_meta(NS(
            preempted_req_ids=[], num_scheduled_tokens={"A": n},
            total_num_scheduled_tokens=n, scheduled_new_reqs=[],
            scheduled_cached_reqs=NS(req_ids=["A"], new_block_ids=[None],
                                     resumed_req_ids=set(), num_computed_tokens=[2 * TPB])))
        saved = [(s.first_block, s.end_block) for s in meta.saves]
        assert saved == ([(0, 3)] if role == "kv_producer" else [(2, 3)])
    finally:
        sched.shutdown()


def test_an_unreachable_daemon_matches_no_tokens(tmp_path: Path) -> None:
    """No daemon at the socket: the lookup fails and kvtier offers nothing (0, not the
    whole prompt: a load planned on a miss would only fail and cost a recompute)."""
    sched = _sched(tmp_path)
    try:
        req = _request("A", list(range(1, 4 * TPB + 2)))
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert "A" not in sched._spans
    finally:
        sched.shutdown()


def test_blocks_slower_to_reload_than_to_recompute_are_not_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon holds all 4 blocks, but in a tier measured at 1 KB/s: reloading any of
    them is slower than recomputing it, so nothing is loaded (the 4 are counted skipped)."""
    sched = _sched(tmp_path)
    try:
        _daemon_answers(monkeypatch, tier="redis", bandwidth={"redis": 1000.0})
        req = _request("A", list(range(1, 4 * TPB + 2)))
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert sched._skips == {"A": 4}
    finally:
        sched.shutdown()
