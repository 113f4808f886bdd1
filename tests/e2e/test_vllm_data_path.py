"""End to end, data path v2 (issue 11): real vLLM engines (in subprocesses) with configs the
shared in-process engine does not have, all against one daemon.

- the in-flight save bound is hit: saves are dropped and counted, outputs stay exact;
- a tier made artificially slow (configured bandwidth) makes the scheduler load fewer
  tokens, outputs stay exact;
- vLLM's own prefix cache (``enable_prefix_caching=True``) hits part of a kvtier block:
  the loaded block is overlaid on the locally computed page;
- ``save_decode_tokens``: the next chat turn loads KV of the previous answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import EngineRun
from tests.e2e.vllm_engine import BLOCK_SIZE, TOKENS_PER_BLOCK, kv_transfer_config, prompt
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.e2e

DECODE_TOKENS = 40
P_BOUND = prompt(21, 200)
P_SLOW = prompt(22, 260)
P_OVERLAY = prompt(23, 300)
P_LOCAL = P_OVERLAY[:BLOCK_SIZE + 8]          # one full page of P_OVERLAY, then 8 tokens
P_DECODE = prompt(24, 100)                    # 1 prompt block; prompt + answer span 2
NEXT_TURN = prompt(25, 30)
P_SHARED = prompt(29, 2 * TOKENS_PER_BLOCK)    # a prefix of 2 kvtier blocks, and two prompts
P_SHARED_A = P_SHARED + prompt(30, 40)         # on it: A loads it, B (3 full blocks) takes
P_SHARED_B = P_SHARED + prompt(31, 100)        # A's pages from vLLM's prefix cache


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("kvtierd-dp"), cpu_bytes="64MiB") as d:
        yield d


@pytest.fixture(scope="module")
def expected(run_engine: EngineRun) -> dict[str, Any]:
    """Tokens without kvtier: the single prompts, and the decode conversation's two turns."""
    singles, decode_turn1, decode_turn2 = run_engine(
        [{"prompts": [P_BOUND, P_SLOW, P_OVERLAY, P_LOCAL, P_SHARED_A, P_SHARED_B]},
         {"prompts": [P_DECODE], "max_tokens": DECODE_TOKENS},
         {"continue": {"phase": 1, "extra": NEXT_TURN}}], transfer=None)
    names = ("bound", "slow", "overlay", "local", "shared_a", "shared_b")
    out: dict[str, Any] = {n: t for n, (t, _) in zip(names, singles, strict=True)}
    out["decode1"], out["decode2"] = decode_turn1[0][0], decode_turn2[0][0]
    return out


def transfer(d: DaemonProcess, model_id: str, **extra: Any) -> dict[str, Any]:
    return kv_transfer_config(d.socket, model_id=model_id, **extra)


def test_save_bound_drops_and_counts(run_engine: EngineRun, daemon: DaemonProcess,
                                     expected: dict[str, Any]) -> None:
    """A bound below one block's bytes: every save is dropped (never waited for, never an
    error), counted, and the next run is a plain miss with the same tokens."""
    cfg = transfer(daemon, "bound", max_inflight_save_bytes=1000)
    (first,), (second,) = run_engine([{"prompts": [P_BOUND]}, {"prompts": [P_BOUND]}], cfg)
    assert first == (expected["bound"], 0)
    assert second == (expected["bound"], 0)
    counters = run_engine.counters  # type: ignore[attr-defined]
    assert counters["dropped_saves"] >= 2
    assert counters["dropped_save_bytes"] >= 2 * 3 * 64 * 1024
    assert counters.get("saved_blocks", 0) == 0


def test_slow_tier_loads_fewer_tokens(run_engine: EngineRun, daemon: DaemonProcess,
                                      expected: dict[str, Any]) -> None:
    """With the cpu tier configured at 1 KB/s a block would take a minute to reload, far
    more than recomputing it: the scheduler loads nothing, counts the skipped blocks, and
    the tokens are exact. The same blocks load in full with the measured bandwidth."""
    slow = transfer(daemon, "slow", tier_bandwidth={"cpu": 1000.0},
                    skip_slower_than_recompute=True)
    (first,), (second,) = run_engine([{"prompts": [P_SLOW]}, {"prompts": [P_SLOW]}], slow)
    assert first == (expected["slow"], 0)
    assert second == (expected["slow"], 0)
    counters = run_engine.counters  # type: ignore[attr-defined]
    n_blocks = len(P_SLOW) // TOKENS_PER_BLOCK
    assert counters["skipped_slower_than_recompute"] == n_blocks
    assert counters["skipped_tokens_slower_than_recompute"] == n_blocks * TOKENS_PER_BLOCK
    ((fast,),) = run_engine([{"prompts": [P_SLOW]}], transfer(daemon, "slow"))
    assert fast == (expected["slow"], n_blocks * TOKENS_PER_BLOCK)


def test_local_prefix_hit_inside_a_kvtier_block(run_engine: EngineRun, daemon: DaemonProcess,
                                                expected: dict[str, Any]) -> None:
    """vLLM's prefix cache holds the first page (32 tokens) of P_OVERLAY, kvtier holds its 4
    blocks (from another engine): the first block is loaded onto the page vLLM kept."""
    cfg = transfer(daemon, "overlay")
    ((feed,),) = run_engine([{"prompts": [P_OVERLAY]}], cfg)
    assert feed == (expected["overlay"], 0)
    local, overlay = run_engine([{"prompts": [P_LOCAL]}, {"prompts": [P_OVERLAY]}], cfg,
                                prefix_caching=True)
    assert local[0][0] == expected["local"]
    tokens, cached = overlay[0]
    assert tokens == expected["overlay"]
    assert cached == 4 * TOKENS_PER_BLOCK       # 32 from vLLM's cache + 224 from kvtier


def test_save_decode_tokens_next_turn_loads_the_answer(
        run_engine: EngineRun, daemon: DaemonProcess, expected: dict[str, Any]) -> None:
    """With ``save_decode_tokens`` the answer's KV is offloaded too: the next turn (prompt +
    answer + new tokens) loads 2 blocks, where prompts alone would give 1."""
    cfg = transfer(daemon, "decode", save_decode_tokens=True)
    turn1, turn2 = run_engine([{"prompts": [P_DECODE], "max_tokens": DECODE_TOKENS},
                               {"continue": {"phase": 0, "extra": NEXT_TURN}}], cfg)
    assert turn1[0] == (expected["decode1"], 0)
    assert turn2[0][0] == expected["decode2"]
    computed = len(P_DECODE) + DECODE_TOKENS - 1     # the last answer token has no KV yet
    assert turn2[0][1] == computed // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK == 128



@pytest.mark.parametrize("role", ["kv_both", "kv_producer"])
def test_blocks_lost_between_lookup_and_load_never_become_wrong_kv(
        run_engine: EngineRun, daemon: DaemonProcess, role: str) -> None:
    """Blocks 1 and 2 of a prompt vanish between its lookup and its load (an eviction, a
    restart, a corrupt frame): vLLM recomputes them, and nothing computed on the pages that
    did not load is saved (once, the same step's save stored blocks built on them, and the
    next full hit generated wrong tokens). Every run's tokens equal a run without kvtier."""
    q = prompt(26 if role == "kv_both" else 27, 5 * TOKENS_PER_BLOCK + 20)
    shares = q[:3 * TOKENS_PER_BLOCK] + prompt(28, 20)   # stores exactly blocks 0..2 of q
    baseline = run_engine([{"prompts": [q]}], transfer=None)[0][0][0]
    runs = run_engine([{"prompts": [shares]}, {"prompts": [q], "lose_blocks_at_load": [1, 3]},
                       {"prompts": [q]}],
                      transfer={**transfer(daemon, f"lost-{role}"), "kv_role": role})
    (failed, cached_at_failure), (again, cached_again) = runs[1][0], runs[2][0]
    assert cached_at_failure > 0           # it did load (and lose) from kvtier
    assert failed == baseline
    assert again == baseline and cached_again > 0


def test_a_failed_load_shared_through_vllms_prefix_cache_is_not_saved(
        run_engine: EngineRun, daemon: DaemonProcess, expected: dict[str, Any]) -> None:
    """A and B share a prefix that kvtier holds; in one batch of an engine with vLLM's prefix
    cache, A loads it and B takes A's pages as a local hit; the prefix's blocks vanish
    before the load. vLLM recomputes both; B's save of that step, built on the pages that
    did not load, used to be stored, and a fresh engine then loaded it and generated wrong
    tokens from the first one on (tests/integration/test_connector_shared_pages.py)."""
    cfg = transfer(daemon, "shared-failed")
    run_engine([{"prompts": [P_SHARED + prompt(32, 30)], "max_tokens": 2}], cfg)
    ((a, _), (b, _)), = run_engine(
        [{"prompts": [P_SHARED_A, P_SHARED_B], "lose_blocks_at_load": [0, 2]}], cfg,
        prefix_caching=True)
    assert (a, b) == (expected["shared_a"], expected["shared_b"])
    (b_again,), (a_again,) = run_engine([{"prompts": [P_SHARED_B]}, {"prompts": [P_SHARED_A]}],
                                        cfg)
    assert b_again[0] == expected["shared_b"] and a_again[0] == expected["shared_a"]
    assert b_again[1] > 0 and a_again[1] > 0     # both loaded what kvtier holds


def test_a_daemon_that_stops_answering_mid_load_costs_one_timeout(
        run_engine: EngineRun, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two prompts load asynchronously; the daemon is stopped (SIGSTOP, 6 s) right after
    the first load copied its first layer (that load has its slots leased and finishes).
    The second load's request times out and vLLM recomputes that prompt; it asks the
    connector again, which no longer asks the daemon for a request whose load failed (its
    scheduler connection would have found the stall anew: a second timeout for the same
    request). The tokens are the baseline's."""
    qs = [prompt(29, 4 * TOKENS_PER_BLOCK + 10), prompt(30, 4 * TOKENS_PER_BLOCK + 20)]
    baseline = [t for t, _ in run_engine([{"prompts": qs}], transfer=None)[0]]
    d = DaemonProcess(tmp_path_factory.mktemp("kvtierd-stall"), nvme_bytes="0")
    d.start()
    try:
        assert d.proc is not None
        cfg = {**transfer(d, "stall", async_load=True, timeout_s=1.0)}
        stored, stalled = run_engine(
            [{"prompts": qs},
             {"prompts": qs, "stall_daemon_at_load": {"pid": d.proc.pid, "seconds": 6.0}}],
            cfg)
        last = max(tmp_path_factory.getbasetemp().glob("engine*/stderr.log"),
                   key=lambda f: f.stat().st_mtime)
        log = last.read_text()
    finally:
        d.kill()
    assert [t for t, _ in stored] == baseline and [t for t, _ in stalled] == baseline
    assert "no reply to get_prepare within" in log, log[-3000:]
    assert "no reply to lookup within" not in log, log[-3000:]
