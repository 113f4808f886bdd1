"""The scheduler side's lookup (``SchedulerSide.get_num_new_matched_tokens`` and
``lookup.leading_blocks``), no daemon: the daemon's answer is given. When kvtier must add
nothing (an engine that may not load, a request that reads no prefix cache or cannot be
cached, one whose load failed or that was in flight at a cache reset), it claims no token
whatever the daemon holds; the recompute trade-off starts at vLLM's own hit; a lookup waits
only on a save of the block it needs next; every TP shard is asked. Each was found unpinned
by a mutation review of the connector: a test fails on its mutant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.link import DaemonLink
from kvtier.connectors.vllm.metadata import KVTierWorkerMetadata

from kvtier.keys import Namespace
from tests.support.connector_sched import (
    PROMPT,
    TPB,
    daemon_holds,
    request,
    scheduler,
    step,
)
from tests.support.vllm_fakes import fake as NS


def test_an_engine_that_may_not_load_claims_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``loads=False`` (context_reuse off for this engine): however much the daemon
    holds, no token is claimed (a claimed token would be loaded, not computed)."""
    sched = scheduler(tmp_path, loads=False)
    try:
        daemon_holds(monkeypatch)
        assert sched.get_num_new_matched_tokens(request("A", PROMPT), 0) == (0, False)
        assert sched.lookups == 0
    finally:
        sched.shutdown()


def test_a_request_that_skips_the_prefix_cache_claims_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that needs every prompt token computed (prompt logprobs, pooling) is
    never offered kvtier's blocks, and no lookup is made for it."""
    sched = scheduler(tmp_path)
    try:
        daemon_holds(monkeypatch)
        req = request("A", PROMPT, skip_reading_prefix_cache=True)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert sched.counters["lookups_prefix_read_off"] == 1 and sched.lookups == 0
    finally:
        sched.shutdown()


def test_a_multimodal_request_claims_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose KV is not a function of its token ids alone (an image) claims
    nothing even when the daemon holds blocks of the same token ids (another request's KV)."""
    sched = scheduler(tmp_path)
    try:
        daemon_holds(monkeypatch)
        req = request("A", PROMPT, mm_features=[object()])
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert sched.lookups == 0
    finally:
        sched.shutdown()


def test_a_request_in_flight_at_a_cache_reset_claims_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request tracked when the weights changed is neither loaded nor saved again: vLLM
    asking again (after a preemption) gets no tokens."""
    sched = scheduler(tmp_path)
    try:
        daemon_holds(monkeypatch)
        req = request("A", PROMPT)
        sched.update_state_after_alloc(req, NS(get_block_ids=lambda: (list(range(10, 19)),)),
                                       0)
        assert sched.reset_cache()
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    finally:
        sched.shutdown()


def test_a_request_whose_load_failed_claims_nothing_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load failed: vLLM asks again and the request recomputes. Claiming the blocks again
    would cost it a second timeout or failure."""
    sched = scheduler(tmp_path)
    try:
        daemon_holds(monkeypatch)
        req = request("A", PROMPT)
        assert sched.get_num_new_matched_tokens(req, 0) == (4 * TPB, False)
        pages = list(range(10, 19))
        sched.update_state_after_alloc(req, NS(get_block_ids=lambda: (pages,)), 4 * TPB)
        meta = step(sched, {"A": (4 * TPB, 1)})
        sched.update_connector_output(NS(
            kv_connector_worker_meta=KVTierWorkerMetadata(step=meta.step),
            invalid_block_ids={12}))
        assert sched._states["A"].load_failed
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    finally:
        sched.shutdown()


def test_a_full_local_hit_asks_the_daemon_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own prefix cache holds every whole block: nothing to add, and no round trip
    on the scheduler's step."""
    sched = scheduler(tmp_path)
    try:
        asked = daemon_holds(monkeypatch)
        assert sched.get_num_new_matched_tokens(request("A", PROMPT), 4 * TPB) == (0, False)
        assert asked == [] and sched.lookups == 0
    finally:
        sched.shutdown()


def test_blocks_vllm_holds_are_not_weighed_against_recompute(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM holds blocks 0..1 itself; kvtier holds 0..3, the first two in a slow tier and the
    next two in a fast one. Only blocks past vLLM's hit are weighed: blocks 2..3 load (their
    reload is fast). Weighed from block 0, the slow head stopped everything."""
    sched = scheduler(tmp_path)
    try:
        daemon_holds(monkeypatch, tiers=["redis", "redis", "cpu", "cpu"],
                bandwidth={"redis": 1000.0})
        got = sched.get_num_new_matched_tokens(request("A", PROMPT), 2 * TPB)
        assert got == (2 * TPB, False)
        assert "A" not in sched._skips   # nothing past vLLM's hit was skipped
    finally:
        sched.shutdown()


def test_skipped_blocks_count_only_past_vllm_s_hit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM holds block 0; the daemon holds 0..3, all slow: the three past vLLM's hit are
    counted skipped, not the one vLLM had anyway."""
    sched = scheduler(tmp_path)
    try:
        daemon_holds(monkeypatch, tiers=["redis"] * 4, bandwidth={"redis": 1000.0})
        assert sched.get_num_new_matched_tokens(request("A", PROMPT), TPB) == (0, False)
        assert sched._skips == {"A": 3}
    finally:
        sched.shutdown()


def test_a_lookup_does_not_wait_on_a_save_of_blocks_vllm_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A's save of blocks 0..1 is planned, not acknowledged, not found by the daemon yet.
    B shares those blocks, and vLLM's prefix cache already holds both for it: the block it
    needs next is 2, in no save, so it is answered at once (0 tokens), not told to wait."""
    sched = scheduler(tmp_path)
    try:
        daemon_holds(monkeypatch, hits=0)
        sched.update_state_after_alloc(request("A", PROMPT[:2 * TPB + 1]),
                                       NS(get_block_ids=lambda: (list(range(10, 15)),)), 0)
        meta = step(sched, {"A": (0, 2 * TPB + 1)})
        assert [(s.first_block, s.end_block) for s in meta.saves] == [(0, 2)]
        b = request("B", PROMPT[:2 * TPB] + list(range(5000, 5000 + 2 * TPB + 1)))
        assert sched.get_num_new_matched_tokens(b, 2 * TPB) == (0, False)
        # and B, with nothing of it local, does wait on the save of its next block (0)
        assert sched.get_num_new_matched_tokens(b, 0) == (None, False)
    finally:
        sched.shutdown()


def test_an_async_engine_is_told_its_load_is_asynchronous(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``async_load`` the tokens come with True: vLLM must wait for the load before it
    schedules the request (told False, it computed on pages still being filled)."""
    sched = scheduler(tmp_path, async_load=True)
    try:
        daemon_holds(monkeypatch)
        assert sched.get_num_new_matched_tokens(request("A", PROMPT), 0) == (4 * TPB, True)
    finally:
        sched.shutdown()


def test_every_tp_shard_is_asked_and_the_least_held_counts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 2: rank 1's shard holds 1 block, rank 0's all 4. A block is usable only when every
    shard of it is: 1 block is claimed, never rank 0's 4 (rank 1 would load what it lacks)."""
    sched = scheduler(tmp_path, tp_size=2)
    try:
        ns1 = sched.link.namespace(None, 1)
        asked = daemon_holds(monkeypatch, per_rank={ns1: 1})
        assert sched.get_num_new_matched_tokens(request("A", PROMPT), 0) == (TPB, False)
        assert set(asked) == {sched.link.namespace(None, 0), ns1}
    finally:
        sched.shutdown()


def test_a_shard_that_cannot_be_asked_is_a_miss(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 2: rank 0's shard holds every block, rank 1's lookup gets no answer (the daemon
    went away mid-lookup): nothing is claimed, not rank 0's blocks."""
    sched = scheduler(tmp_path, tp_size=2)
    try:
        ns1 = sched.link.namespace(None, 1)
        monkeypatch.setattr(DaemonLink, "leading_bound", lambda self, keys: None)
        monkeypatch.setattr(DaemonLink, "lookup_result", lambda self, ns, keys: None
                            if ns == ns1 else NS(hits=len(keys), tiers=["cpu"] * len(keys),
                                                 bandwidth={}))
        assert sched.get_num_new_matched_tokens(request("A", PROMPT), 0) == (0, False)
    finally:
        sched.shutdown()


def _filtered(monkeypatch: pytest.MonkeyPatch, present: int,
              tiers: dict[Namespace, list[str]] | None = None) -> list[int]:
    """A presence filter that finds the first ``present`` blocks of every chain, and a
    daemon holding every block it is asked for (in ``tiers[ns]``, else cpu); the number of
    keys each lookup sent."""
    sent: list[int] = []

    def lookup(self: DaemonLink, ns: Namespace, keys: list[Any]) -> Any:
        sent.append(len(keys))
        return NS(hits=len(keys), tiers=(tiers or {}).get(ns, ["cpu"] * 8)[:len(keys)],
                  bandwidth={"redis": 1000.0})

    monkeypatch.setattr(DaemonLink, "leading_bound", lambda self, keys: min(len(keys), present))
    monkeypatch.setattr(DaemonLink, "lookup_result", lookup)
    return sent


def test_a_filter_that_finds_nothing_past_vllm_s_hit_claims_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The presence filter rules out block 0: no round trip, and nothing claimed (the
    whole prompt claimed on no lookup at all would be loaded from blocks no tier holds)."""
    sched = scheduler(tmp_path)
    try:
        sent = _filtered(monkeypatch, present=0)
        assert sched.get_num_new_matched_tokens(request("A", PROMPT), 0) == (0, False)
        assert sent == [] and sched.counters["lookups_without_round_trip"] == 1
    finally:
        sched.shutdown()


def test_a_filter_bound_at_vllm_s_hit_makes_no_round_trip(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM holds 2 blocks and the filter finds no more than those 2: answered without a
    round trip on the scheduler's step."""
    sched = scheduler(tmp_path)
    try:
        sent = _filtered(monkeypatch, present=2)
        assert sched.get_num_new_matched_tokens(request("A", PROMPT), 2 * TPB) == (0, False)
        assert sent == [] and sched.counters["lookups_without_round_trip"] == 1
    finally:
        sched.shutdown()


def test_the_filter_bounds_the_whole_chain_not_its_head(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The filter finds 3 of 4 blocks: the daemon is asked for exactly those 3 (the bound
    of the whole chain, not of its first block), and 3 blocks are claimed."""
    sched = scheduler(tmp_path)
    try:
        sent = _filtered(monkeypatch, present=3)
        assert sched.get_num_new_matched_tokens(request("A", PROMPT), 0) == (3 * TPB, False)
        assert sent == [3]
    finally:
        sched.shutdown()


def test_the_slowest_shard_decides_what_is_worth_loading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 2: rank 0's shard of every block is in a slow tier, rank 1's in a fast one.
    Loading a block means loading both shards: none is worth it (rank 1's answer, asked
    last, must not overrule rank 0's)."""
    sched = scheduler(tmp_path, tp_size=2)
    try:
        _filtered(monkeypatch, present=4,
                  tiers={sched.link.namespace(None, 0): ["redis"] * 4})
        assert sched.get_num_new_matched_tokens(request("A", PROMPT), 0) == (0, False)
        assert sched._skips == {"A": 4}
    finally:
        sched.shutdown()
