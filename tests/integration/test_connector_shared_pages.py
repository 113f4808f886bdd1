"""A load that fails on pages vLLM's prefix cache shared with another request (scheduler and
worker sides driven directly, against a real daemon and real CPU KV caches).

vLLM caches a synchronously loaded request's pages as soon as it allocates them, so a second
request scheduled in the same step can take them as its own prefix hit. When the load
fails, vLLM recomputes both; what the second request computed on those pages in that step
is not its KV and must not be saved (it once was: a later engine loaded it and generated
wrong tokens from the first one on).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")
torch = pytest.importorskip("torch")

from kvtier.connectors.vllm.config import ConnectorConfig  # noqa: E402
from kvtier.connectors.vllm.metadata import (  # noqa: E402
    KVTierConnectorMetadata,
    TransferSpec,
)
from kvtier.connectors.vllm.scheduler import SchedulerSide  # noqa: E402
from kvtier.connectors.vllm.worker import WorkerSide  # noqa: E402

from kvtier.keys import block_keys  # noqa: E402
from kvtier.layout import KVLayout  # noqa: E402
from tests.support.daemon import DaemonProcess  # noqa: E402
from tests.support.vllm_fakes import fake as NS  # noqa: E402

LAYERS, PAGE, TPB, HEADS, HEAD_DIM, NUM_PAGES = 2, 32, 64, 2, 32, 32
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="float32",
                  tokens_per_block=TPB)
MODEL = "shared-pages"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("shared-pages"), cpu_bytes="32MiB") as d:
        yield d


def config(d: DaemonProcess) -> ConnectorConfig:
    return ConnectorConfig.from_extra({"socket_path": str(d.socket), "tokens_per_block": TPB,
                                       "model_id": MODEL}, block_size=PAGE,
                                      default_model_id=MODEL)


def request(rid: str, ids: list[int]) -> Any:
    return NS(request_id=rid, all_token_ids=ids, num_prompt_tokens=len(ids),
              num_tokens=len(ids), cache_salt=None, mm_features=None, prompt_embeds=None,
              lora_request=None)


def setup(d: DaemonProcess, seed: int) -> tuple[WorkerSide, SchedulerSide, Any, Any, Any]:
    """A worker and a scheduler side on ``d``, X (2 blocks) stored by an earlier engine,
    and requests A = X + 40 tokens and B = X + 100 tokens (3 full blocks); with the
    namespace and B's keys."""
    rng = np.random.default_rng(seed)
    x = [int(t) for t in rng.integers(1, 30000, 2 * TPB)]
    a_ids = x + [int(t) for t in rng.integers(1, 30000, 40)]
    b_ids = x + [int(t) for t in rng.integers(1, 30000, 100)]
    g = torch.Generator().manual_seed(seed)
    kv = {f"model.layers.{i}.self_attn": torch.randn(NUM_PAGES, HEADS, PAGE, 2 * HEAD_DIM,
                                                     generator=g) for i in range(LAYERS)}
    w = WorkerSide(config(d), LAYOUT, PAGE, 0, 1)
    w.register_kv_caches(kv)
    sched = SchedulerSide(config(d), LAYOUT, PAGE, 1)
    w.save(KVTierConnectorMetadata(saves=[TransferSpec(
        "x", None, np.asarray(x, dtype=np.uint32), 0, [[1, 2], [3, 4]], save_id=1)]))
    deadline = time.monotonic() + 30
    while "x" not in w.get_finished({"x"})[0]:      # its save is over
        assert time.monotonic() < deadline
        time.sleep(0.005)
    ns = sched.link.namespace(None, 0)
    keys = block_keys(ns, b_ids)
    assert sched.link.lookup_result(ns, keys[:2]).hits == 2
    return w, sched, (request("A", a_ids), request("B", b_ids)), ns, keys


def admit_and_lose(sched: SchedulerSide, a: Any, ns: Any, keys: Any) -> list[int]:
    """A is admitted: kvtier holds its 2 leading blocks, vLLM loads them into pages 5..8;
    they vanish before the load (an eviction, a restart, a bad frame). A's pages."""
    n, _ = sched.get_num_new_matched_tokens(a, 0)
    assert n == 2 * TPB
    a_pages = [5, 6, 7, 8, 9, 10]
    sched.update_state_after_alloc(a, NS(get_block_ids=lambda: (a_pages,)), n)
    sched.link.call(lambda c: c.delete(ns, keys[:2]), 0)
    return a_pages


def test_a_save_built_on_pages_another_request_failed_to_load_is_dropped(
        daemon: DaemonProcess) -> None:
    w, sched, (a, b), ns, keys = setup(daemon, 5)
    try:
        a_pages = admit_and_lose(sched, a, ns, keys)
        # B, scheduled in the same step, gets pages 5..8 from vLLM's prefix cache
        n, _ = sched.get_num_new_matched_tokens(b, 2 * TPB)
        assert n == 0
        b_pages = [5, 6, 7, 8, 11, 12, 13, 14]
        sched.update_state_after_alloc(b, NS(get_block_ids=lambda: (b_pages,)), 0)
        meta = sched.build_connector_meta(NS(
            preempted_req_ids=[], num_scheduled_tokens={"A": 40, "B": 100},
            total_num_scheduled_tokens=140,
            scheduled_new_reqs=[NS(req_id="A", block_ids=(a_pages,), num_computed_tokens=128),
                                NS(req_id="B", block_ids=(b_pages,), num_computed_tokens=128)],
            scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                     num_computed_tokens=[])))
        assert [s.req_id for s in meta.loads] == ["A"]
        (save,) = meta.saves
        assert (save.req_id, save.first_block, save.end_block) == ("B", 0, 3)
        assert save.loaded_pages == [(0, 5, 0), (0, 6, 0), (1, 7, 0), (1, 8, 0)]
        # the worker runs the step: A's load fails, B's save must not be stored
        w.start_load_kv(meta)
        for name in w.layer_index:
            w.wait_for_layer_load(name)
        w.save(meta)
        failed = w.take_load_errors()
        assert {5, 6, 7, 8} <= failed
        assert w.worker_meta().counters.get("dropped_saves") == 1
        sched.update_connector_output(NS(kv_connector_worker_meta=None,
                                         invalid_block_ids=failed))
        assert sched._states["B"].known_blocks == 0     # saved again once recomputed
        assert sched.link.lookup_result(ns, keys[:3]).hits == 0
    finally:
        sched.shutdown()
        w.shutdown()


def test_with_async_scheduling_a_save_one_step_later_is_dropped_too(
        daemon: DaemonProcess) -> None:
    """vLLM's async scheduling (its default on GPUs) schedules step N+1 before it has step
    N's output: B takes the pages A loads in step N as its prefix in step N+1, and the
    failure of A's load reaches the scheduler only after. B's save of step N+1 is cut all
    the same: the scheduler names the loads whose step it has no output of yet."""
    w, sched, (a, b), ns, keys = setup(daemon, 6)
    no_cached = NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    try:
        a_pages = admit_and_lose(sched, a, ns, keys)
        step_n = sched.build_connector_meta(NS(
            preempted_req_ids=[], num_scheduled_tokens={"A": 40},
            total_num_scheduled_tokens=40,
            scheduled_new_reqs=[NS(req_id="A", block_ids=(a_pages,), num_computed_tokens=128)],
            scheduled_cached_reqs=no_cached))
        # step N+1 is scheduled before step N's output: B takes A's pages as its prefix
        assert sched.get_num_new_matched_tokens(b, 2 * TPB)[0] == 0
        b_pages = [5, 6, 7, 8, 11, 12, 13, 14]
        sched.update_state_after_alloc(b, NS(get_block_ids=lambda: (b_pages,)), 0)
        step_n1 = sched.build_connector_meta(NS(
            preempted_req_ids=[], num_scheduled_tokens={"A": 1, "B": 100},
            total_num_scheduled_tokens=101,
            scheduled_new_reqs=[NS(req_id="B", block_ids=(b_pages,), num_computed_tokens=128)],
            scheduled_cached_reqs=NS(req_ids=["A"], new_block_ids=[None],
                                     resumed_req_ids=set(), num_computed_tokens=[168])))
        (save,) = step_n1.saves
        assert save.req_id == "B" and save.loaded_pages[0] == (0, 5, step_n.step)
        # the workers run step N (A's load fails), then step N+1
        outputs = []
        for meta in (step_n, step_n1):
            w.start_load_kv(meta)
            for name in w.layer_index:
                w.wait_for_layer_load(name)
            w.save(meta)
            outputs.append((w.take_load_errors(), w.worker_meta()))
        (failed, wmeta_n), (_, wmeta_n1) = outputs
        assert {5, 6, 7, 8} <= failed and wmeta_n.step == step_n.step
        assert wmeta_n1.counters.get("dropped_saves") == 1
        for invalid, wmeta in outputs:
            sched.update_connector_output(NS(kv_connector_worker_meta=wmeta,
                                             invalid_block_ids=invalid))
        assert sched.outcomes.confirmed(2**31) == set()   # both steps' outcomes are known
        assert sched.link.lookup_result(ns, keys[:3]).hits == 0
    finally:
        sched.shutdown()
        w.shutdown()


def test_a_sharer_saves_failed_pages_only_once_a_step_has_rewritten_them(
        daemon: DaemonProcess) -> None:
    """vLLM rolls back only the first request holding a failed page; B, sharing it, counts
    it computed and relies on A rewriting it. A is aborted first: nobody rewrites it, and
    B's blocks on it must never be saved (B saved them in its next step, and a fresh engine
    loaded them), nor B's own blocks after them, recomputed on them. Once a request writes
    those pages whole again on a sound prefix, B saves them."""
    w, sched, (a, b), ns, keys = setup(daemon, 7)
    no_cached = NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])

    def step(new: list[Any], cached: Any, scheduled: dict[str, int]) -> KVTierConnectorMetadata:
        return sched.build_connector_meta(NS(
            preempted_req_ids=[], num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_new_reqs=new, scheduled_cached_reqs=cached))

    try:
        a_pages = admit_and_lose(sched, a, ns, keys)
        assert sched.get_num_new_matched_tokens(b, 2 * TPB)[0] == 0
        b_pages = [5, 6, 7, 8, 11, 12, 13, 14]
        sched.update_state_after_alloc(b, NS(get_block_ids=lambda: (b_pages,)), 0)
        first = step([NS(req_id="A", block_ids=(a_pages,), num_computed_tokens=128),
                      NS(req_id="B", block_ids=(b_pages,), num_computed_tokens=128)],
                     no_cached, {"A": 40, "B": 100})
        assert [s.req_id for s in first.saves] == ["B"]     # (the worker cuts it)
        sched.update_connector_output(NS(kv_connector_worker_meta=None,
                                         invalid_block_ids={5, 6, 7, 8}))
        sched.request_finished(a)                           # A is aborted
        # B redoes the step vLLM dropped (tokens 128..228) on pages nobody rewrote
        again = step([], NS(req_ids=["B"], new_block_ids=[None], resumed_req_ids=set(),
                            num_computed_tokens=[128]), {"B": 100})
        assert again.saves == []
        # C computes X from its first token into those pages: they hold X's KV again
        c = request("C", list(b.all_token_ids[:2 * TPB]) + list(range(1, 23)))
        sched.update_state_after_alloc(c, NS(get_block_ids=lambda: ([5, 6, 7, 8, 15],)), 0)
        rewrite = step([NS(req_id="C", block_ids=([5, 6, 7, 8, 15],), num_computed_tokens=0)],
                       NS(req_ids=["B"], new_block_ids=[None], resumed_req_ids=set(),
                          num_computed_tokens=[228]), {"C": 150, "B": 1})
        # B saves X's blocks, now sound; its own block 2, recomputed on the bad prefix, never
        saved = {s.req_id: (s.first_block, s.end_block) for s in rewrite.saves}
        assert saved == {"C": (0, 2), "B": (0, 2)}
        later = step([], NS(req_ids=["B"], new_block_ids=[None], resumed_req_ids=set(),
                            num_computed_tokens=[229]), {"B": 1})
        assert later.saves == []
    finally:
        sched.shutdown()
        w.shutdown()


def test_a_load_that_failed_on_another_tp_rank_cuts_this_ranks_save(
        daemon: DaemonProcess) -> None:
    """TP ranks load their own shards; when rank 1's failed, what rank 0 computed in the
    step depends on it (the all-reduce after attention): rank 0 cuts its save where rank 1
    does (kvtier.connectors.vllm.ranks), though its own load succeeded."""
    asked: list[list[int | None]] = []

    def other_rank_failed_at_block_1(cuts: list[int | None]) -> list[int | None]:
        asked.append(list(cuts))
        return [1 for _ in cuts]

    g = torch.Generator().manual_seed(8)
    kv = {f"model.layers.{i}.self_attn": torch.randn(NUM_PAGES, HEADS, PAGE, 2 * HEAD_DIM,
                                                     generator=g) for i in range(LAYERS)}
    w = WorkerSide(config(daemon), LAYOUT, PAGE, 0, 2, agree=other_rank_failed_at_block_1)
    w.register_kv_caches(kv)
    toks = np.random.default_rng(8).integers(1, 30000, 3 * TPB, dtype=np.uint32)
    try:
        plain = TransferSpec("p", None, toks, 0, [[1, 2], [3, 4], [5, 6]], save_id=1)
        w.save(KVTierConnectorMetadata(saves=[plain], step=0))
        assert asked == []                # no load in its step to disagree on
        cut = TransferSpec("q", None, toks[::-1].copy(), 0, [[1, 2], [3, 4], [5, 6]],
                           save_id=2, loaded_pages=[(0, 1, 1), (0, 2, 1)])
        w.save(KVTierConnectorMetadata(saves=[cut], step=1))
        assert asked == [[None]]          # rank 0's own loads were sound
        over, deadline = w.get_finished({"p", "q"})[0], time.monotonic() + 30
        while not {"p", "q"} <= over:   # both saves are over
            assert time.monotonic() < deadline
            time.sleep(0.005)
            over |= w.get_finished(set())[0]
        ns = w.link.namespace(None, 0)
        assert w.link.lookup_result(ns, block_keys(ns, toks)).hits == 3
        q_keys = block_keys(ns, toks[::-1].copy())
        assert w.link.lookup_result(ns, q_keys).hits == 1   # block 0 only
    finally:
        w.shutdown()
