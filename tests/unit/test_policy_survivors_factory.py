"""The daemon's policy wiring honours every config value, and the prefetch wait rules
(mutation review of kvtier.policy.factory and kvtier.policy.prefetch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.policy.adaptive import AdaptivePolicy, ShadowObserver
from kvtier.policy.admission import TierAdmission, WriteBudget
from kvtier.policy.cost import CostPolicy
from kvtier.policy.factory import (
    DEFAULT_BLOCK_TOKENS,
    H2D_BPS,
    NVME_READ_BPS,
    REDIS_READ_BPS,
    TYPICAL_BLOCK_BYTES,
    build_policies,
)
from kvtier.policy.hindsight import HindsightPolicy, HindsightStats
from kvtier.policy.prefetch import PrefetchWait, prefetch_deadline, wait_for_prefix
from kvtier.policy.stats import WorkloadStats
from kvtier.tiers.base import TierName

GIB = 2**30


def _built(tmp_path: Path, **over: Any) -> dict[str, Any]:
    overrides = {"daemon.data_dir": tmp_path, "nvme.enabled": False, **over}
    return build_policies(load_config(env={}, overrides=overrides))


def _cost(p: object) -> CostPolicy:
    assert isinstance(p, CostPolicy)
    return p


def test_adaptive_learns_with_optgen_sized_by_the_cpu_tier(tmp_path: Path) -> None:
    """Adaptive's observer feeds HindsightStats (off the request path, in gapped slices);
    only the cpu tier tells it its size in blocks, and each tier sizes its shadows from
    its own bytes."""
    built = _built(tmp_path, **{"policy.eviction": "adaptive", "cpu.bytes": 4 * GIB,
                                "hbm.bytes": GIB, "nvme.enabled": True,
                                "nvme.bytes": 16 * GIB})
    obs = built["observer"]
    assert isinstance(obs, ShadowObserver) and isinstance(obs.inner, HindsightStats)
    assert obs.defer is not None and obs.defer_after is not None
    make = built["policy_factory"]
    cpu, hbm, nvme = (make("adaptive", t) for t in (TierName.CPU, TierName.HBM, TierName.NVME))
    assert all(isinstance(p, AdaptivePolicy) for p in (cpu, hbm, nvme))
    assert (cpu._cap_bytes, hbm._cap_bytes, nvme._cap_bytes) == (4 * GIB, GIB, 16 * GIB)
    assert cpu._on_capacity is not None and hbm._on_capacity is None
    assert nvme._on_capacity is None
    assert nvme.shadows.above is cpu.shadows and hbm.shadows.above is None
    assert set(obs.shadows) == {"cpu", "hbm", "nvme"}
    cpu.insert(b"k" * 16, nbytes=GIB // 8)
    assert obs.inner.capacity_blocks == 32


def test_a_disabled_nvme_tier_has_no_capacity(tmp_path: Path) -> None:
    built = _built(tmp_path, **{"policy.eviction": "adaptive", "nvme.bytes": 16 * GIB})
    nvme = built["policy_factory"]("adaptive", TierName.NVME)
    assert isinstance(nvme, AdaptivePolicy) and nvme._cap_bytes == 0


def test_the_shadow_sample_rate_is_honoured(tmp_path: Path) -> None:
    built = _built(tmp_path, **{"policy.eviction": "adaptive",
                                "policy.shadow_sample_rate": 0.25})
    pol = built["policy_factory"]("adaptive", TierName.CPU)
    assert isinstance(pol, AdaptivePolicy)
    pol.insert(b"k" * 16, nbytes=2**20)
    assert pol.shadows.rate == 0.25


def test_the_learning_window_covers_sixteen_times_what_the_node_holds(tmp_path: Path) -> None:
    blocks = (64 * GIB) // TYPICAL_BLOCK_BYTES
    cpu_only = _built(tmp_path, **{"policy.eviction": "cost", "cpu.bytes": 64 * GIB,
                                   "nvme.bytes": 64 * GIB})["observer"]
    assert isinstance(cpu_only, WorkloadStats) and not isinstance(cpu_only, HindsightStats)
    assert cpu_only.horizon == 16 * blocks
    both = _built(tmp_path, **{"policy.eviction": "cost", "cpu.bytes": 64 * GIB,
                               "nvme.enabled": True, "nvme.bytes": 64 * GIB})["observer"]
    assert isinstance(both, WorkloadStats) and both.horizon == 32 * blocks


@pytest.mark.parametrize("nvme, redis, below_cpu, below_nvme", [
    (False, False, None, None),
    (True, False, NVME_READ_BPS, None),
    (False, True, REDIS_READ_BPS, REDIS_READ_BPS),
    (True, True, NVME_READ_BPS, REDIS_READ_BPS),
])
def test_each_tier_prices_a_reload_from_the_tier_below_it(
        tmp_path: Path, nvme: bool, redis: bool, below_cpu: float | None,
        below_nvme: float | None) -> None:
    built = _built(tmp_path, **{"policy.eviction": "cost", "nvme.enabled": nvme,
                                "redis.enabled": redis, "policy.model_params": 13e9})
    make = built["policy_factory"]
    hbm, cpu, nv = (_cost(make("cost", t)) for t in (TierName.HBM, TierName.CPU,
                                                     TierName.NVME))
    assert (hbm._reload_bw, cpu._reload_bw, nv._reload_bw) == (H2D_BPS, below_cpu, below_nvme)
    assert cpu._stats is built["observer"] and cpu._costs.prefill.params == 13e9
    assert cpu._costs.block_tokens == DEFAULT_BLOCK_TOKENS


def test_hindsight_sizes_its_stats_at_the_cpu_tier_only(tmp_path: Path) -> None:
    built = _built(tmp_path, **{"policy.eviction": "hindsight"})
    stats = built["observer"]
    assert isinstance(stats, HindsightStats)
    make = built["policy_factory"]
    cpu, hbm = make("hindsight", TierName.CPU), make("hindsight", TierName.HBM)
    assert isinstance(cpu, HindsightPolicy) and isinstance(hbm, HindsightPolicy)
    assert cpu._stats is stats and hbm._stats is stats
    assert cpu._size_stats and not hbm._size_stats
    for k in range(3):
        hbm.insert(k, nbytes=1, parent=None, depth=0)
    hbm.victim()
    assert stats.capacity_blocks == 0


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_a_simple_policy_has_no_observer(tmp_path: Path, eviction: str) -> None:
    built = _built(tmp_path, **{"policy.eviction": eviction})
    assert built["observer"] is None and built["eviction"] == eviction
    assert built["policy_factory"](eviction, TierName.CPU).name == eviction


def test_a_write_budget_admits_nvme_writes_with_a_burst(tmp_path: Path) -> None:
    assert _built(tmp_path)["admission"] is None
    adm = _built(tmp_path, **{"nvme.write_budget_bytes_per_s": 2**20})["admission"]
    assert isinstance(adm, TierAdmission)
    budget = adm._by_tier["nvme"]
    assert isinstance(budget, WriteBudget) and budget._rate == 2**20
    assert budget._burst == 2**26


@pytest.mark.parametrize("key, value", [("policy.eviction", "random"),
                                        ("policy.shadow_sample_rate", 1.5),
                                        ("policy.shadow_sample_rate", -0.1)])
def test_bad_policy_values_are_refused_with_a_config_error(
        tmp_path: Path, key: str, value: object) -> None:
    with pytest.raises(ConfigError):
        _built(tmp_path, **{key: value})


# ------------------------------------------------------------------ prefetch


def test_best_effort_returns_at_once_with_the_ready_prefix() -> None:
    assert prefetch_deadline(PrefetchWait.BEST_EFFORT, 9, 1.0, 5.0) == 5.0
    out = wait_for_prefix(PrefetchWait.BEST_EFFORT, [4.0, 5.0, 6.0], 5.0, per_block_s=1.0)
    assert (out.ready_blocks, out.return_at, out.late_blocks) == (2, 5.0, 1)


def test_a_timeout_grace_grows_with_the_blocks_from_its_base() -> None:
    assert prefetch_deadline(PrefetchWait.TIMEOUT, 4, 0.5, 10.0, base_s=1.0) == 13.0
    assert prefetch_deadline(PrefetchWait.TIMEOUT, -3, 0.5, 10.0, base_s=1.0) == 11.0


def test_a_block_landing_at_the_deadline_is_in_time() -> None:
    out = wait_for_prefix(PrefetchWait.TIMEOUT, [10.5, 11.0], 10.0, per_block_s=0.5)
    assert (out.ready_blocks, out.return_at, out.late_blocks) == (2, 11.0, 0)


def test_a_get_returns_when_its_last_block_lands_not_at_the_deadline() -> None:
    out = wait_for_prefix(PrefetchWait.TIMEOUT, [1.0, 10.2], 10.0, per_block_s=1.0,
                          base_s=5.0)
    assert (out.ready_blocks, out.return_at, out.late_blocks) == (2, 10.2, 0)
    waited = wait_for_prefix(PrefetchWait.WAIT, [10.3, 12.0], 10.0, per_block_s=0.0)
    assert (waited.ready_blocks, waited.return_at) == (2, 12.0)


def test_a_late_block_costs_the_whole_grace() -> None:
    out = wait_for_prefix(PrefetchWait.TIMEOUT, [10.1, 99.0], 10.0, per_block_s=1.0)
    assert (out.ready_blocks, out.return_at, out.late_blocks) == (1, 12.0, 1)


def test_nvme_shadows_model_the_cpu_tier_above_even_when_nvme_is_filled_first(
        tmp_path: Path) -> None:
    """kvtier.store.recovery inserts the surviving nvme blocks into the nvme policy before
    any block reaches the cpu tier: the nvme shadows must still end up modelling the cache
    of both tiers (cpu above nvme), as they do when the cpu tier is sized first. They were
    sized at the first nvme block and kept modelling nvme alone for good."""
    built = _built(tmp_path, **{"policy.eviction": "adaptive", "cpu.bytes": 4 * GIB,
                                "nvme.enabled": True, "nvme.bytes": 16 * GIB})
    make = built["policy_factory"]
    cpu, nvme = make("adaptive", TierName.CPU), make("adaptive", TierName.NVME)
    assert isinstance(cpu, AdaptivePolicy) and isinstance(nvme, AdaptivePolicy)
    nvme.insert(b"n" * 16, nbytes=GIB // 8)     # recovery: nvme frames first
    cpu.insert(b"c" * 16, nbytes=GIB // 8)      # then the cpu tier
    nvme.insert(b"m" * 16, nbytes=GIB // 8)     # and a demotion
    assert cpu.shadows.capacity_blocks == 32 and nvme.shadows.capacity_blocks == 128
    assert nvme.shadows.above_blocks == 32
