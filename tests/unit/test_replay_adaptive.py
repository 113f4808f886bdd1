"""Acceptance of the adaptive default policy and of ``hindsight`` (issue 13) on the shared
trace and on every workload generator: never below 0.99x the better of LRU and LFU at 1-40%
of the unique blocks, 1.18x LRU's token hits at 5% of the shared trace, and a live
miss-ratio curve that predicts full-size replays. (The hindsight checks had a module of
their own, which replayed LRU and LFU again for every point.)

Replays run in the store's order (``SimConfig.order``'s default, what kvtier does; since
2026-12-06, head first before). Measured then: adaptive / max(LRU, LFU) 0.995-1.175 on
these five workloads at 1-40% (lowest: agent_trace at 2%), so the 0.99 bound stands.

About 100 replays: minutes on a loaded 2-core machine (marked slow).
"""

from __future__ import annotations

import pytest

from kvtier.replay.simulator import ReplayResult, SimConfig, TierSpec, simulate
from kvtier.replay.trace import Trace, load_trace
from tests.support import workloads
from tests.support.paths import MOONCAKE_TRACE

TRACE = MOONCAKE_TRACE

FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20, 0.40)
GENERATORS = ("multi_turn_trace", "rag_trace", "agent_trace", "scan_trace")
NAMES = ("mooncake", *GENERATORS)

pytestmark = pytest.mark.slow

_traces: dict[str, Trace] = {}
_runs: dict[tuple[str, str, int], ReplayResult] = {}


def _trace(name: str) -> Trace:
    if name not in _traces:
        if name == "mooncake":
            if not TRACE.exists():
                pytest.skip("shared Mooncake trace not present")
            _traces[name] = load_trace(TRACE)
        else:
            _traces[name] = getattr(workloads, name)()
    return _traces[name]


def _run(name: str, policy: str, blocks: int) -> ReplayResult:
    key = (name, policy, blocks)
    if key not in _runs:
        cfg = SimConfig(tiers=(TierSpec("cpu", max(1, blocks), 25e9),))
        _runs[key] = simulate(_trace(name), policy, cfg)
    return _runs[key]


def _blocks(name: str, fraction: float) -> int:
    return int(_trace(name).n_unique_blocks * fraction)


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("policy", ["adaptive", "hindsight"])
def test_never_below_the_better_of_lru_and_lfu(policy: str, name: str,
                                                fraction: float) -> None:
    """The default (``adaptive``) and its starting mode on its own (``hindsight``), each
    against the same LRU and LFU replays (replayed once for both: a third of the time)."""
    cap = _blocks(name, fraction)
    best = max(_run(name, "lru", cap).hit_tokens, _run(name, "lfu", cap).hit_tokens)
    run = _run(name, policy, cap)
    assert run.hit_tokens >= 0.99 * best, (run.hit_tokens / best, run.modes)


def test_hindsight_hits_1_18x_lru_at_5_percent_on_the_shared_trace() -> None:
    """Issue 13: ``hindsight`` on its own, where ``cost`` reaches 1.13x (head first before
    2026-12-06: 1.205x, ``cost`` 1.18x)."""
    cap = _blocks("mooncake", 0.05)
    assert _run("mooncake", "hindsight", cap).hit_tokens >= 1.18 * _run(
        "mooncake", "lru", cap).hit_tokens


def test_adaptive_hits_1_18x_lru_at_5_percent_on_the_shared_trace() -> None:
    """Issue 13: the default starts in ``hindsight`` (OPTgen-trained), which its shadows keep
    on this trace (docs/replay-analysis.md, "a fourth attempt").

    Head first this was 1.2x (measured 1.205, mean over five capacities 0.92-1.08x 1.202).
    In the store's order LRU keeps chain roots longer and hits more (0.1577 -> 0.1596 of
    the tokens), and the ratio is 1.193 at 5%, mean 1.185, min 1.169 over the five
    capacities (``bench_replay.py --spread``, 2026-12-06; ``cost`` 1.132, mean 1.127):
    the bound is 1.18x, what the point and the mean support."""
    cap = _blocks("mooncake", 0.05)
    assert _run("mooncake", "adaptive", cap).hit_tokens >= 1.18 * _run(
        "mooncake", "lru", cap).hit_tokens


@pytest.mark.parametrize("fraction", [0.05, 0.10, 0.20])
def test_live_curve_predicts_full_size_replays_of_the_shared_trace(fraction: float) -> None:
    cap = _blocks("mooncake", fraction)
    run = _run("mooncake", "adaptive", cap)
    shadows = run.shadows[0]
    curve = {p["scale"]: p["hit_rate"] for p in shadows["mrc"]}  # type: ignore[attr-defined]
    assert float(shadows["sample_rate"]) < 0.1  # type: ignore[arg-type]  # a real miniature
    for scale in (0.5, 2.0):
        full = _run("mooncake", str(shadows["mode"]), int(cap * scale)).token_hit_rate
        assert abs(curve[scale] - full) <= 0.02, (scale, curve[scale], full)
