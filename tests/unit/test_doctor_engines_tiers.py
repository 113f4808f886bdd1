"""Doctor across data-parallel engines, over every tier usage, and with kvtier's own hits.

Each case starts from a fixture scenario and changes only what it is about: the engine
replicated as vLLM's data-parallel engines ``engine="0".."N-1"``, a tier's usage, or the
hits a KV connector (kvtier) serves.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvtier.doctor import engine as m
from kvtier.doctor.collect import Request, collect
from kvtier.doctor.engine import parse_engine
from kvtier.doctor.rules import Finding, Pattern, Thresholds, diagnose
from kvtier.doctor.signals import Signals, TierSignal, derive
from tests.support.doctor_scenarios import files

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _data_parallel(text: str, engines: int, kv_usage: float) -> str:
    """``text`` (one engine, ``engine="0"``) as ``engines`` identical DP engines, each at
    ``kv_usage``: vLLM writes one series per engine, cache_config_info included."""
    out = []
    for line in text.splitlines(keepends=True):
        if line.startswith("vllm:kv_cache_usage_perc"):
            line = re.sub(r"\} \S+$", f"}} {kv_usage}", line.rstrip()) + "\n"
        if 'engine="0"' in line:
            out += [line.replace('engine="0"', f'engine="{e}"') for e in range(engines)]
        else:
            out.append(line)
    return "".join(out)


def _findings(engine: list[str], stats: list[str], tmp_path: Path) -> list[Finding]:
    paths = []
    for i, text in enumerate(engine):
        p = tmp_path / f"engine-{i}.prom"
        p.write_text(text)
        paths.append(str(p))
    got = collect(Request(stats=tuple(stats), stats_explicit=True, engine=tuple(paths),
                          interval_s=10.0))
    return diagnose(derive(got.engine, got.stats, got.interval_s))


def test_cache_config_info_of_every_engine_is_summed() -> None:
    text = "# TYPE vllm:cache_config_info gauge\n" + "".join(
        f'vllm:cache_config_info{{block_size="16",engine="{e}",num_gpu_blocks="{n}"}} 1\n'
        for e, n in ((0, 1000), (1, 3000)))
    assert parse_engine(text, "dp.prom").kv_capacity_tokens == (1000 + 3000) * 16
    partial = text + 'vllm:cache_config_info{block_size="16",engine="2"} 1\n'
    assert parse_engine(partial, "dp.prom").kv_capacity_tokens is None


@pytest.mark.parametrize("engines", [1, 4])
def test_data_parallel_engines_compare_their_sum_with_every_engine_s_pool(
        tmp_path: Path, engines: int) -> None:
    """4 engines run 4x the sequences of one and have 4x its pool: no more short of KV
    than one engine alone, whose KV sits as full."""
    scrapes = [_data_parallel(Path(f).read_text(), engines, 0.92)
               for f in files("healthy", "engine")]
    assert parse_engine(scrapes[-1], "x").kv_capacity_tokens == engines * 30000 * 16
    assert _findings(scrapes, [], tmp_path) == []


def _tier_signals(used_share: float | None) -> Signals:
    return Signals(samples=2, interval_s=10.0,
                   tiers=(TierSignal("cpu", 180.0, used_share, up=True),))


@pytest.mark.parametrize("used", [0.0, 0.5, 0.79, 0.8, 0.85, 0.8999, 0.9, 0.95, 1.0, None])
def test_every_tier_with_allocation_failures_is_one_pattern(used: float | None) -> None:
    found = [f.pattern for f in diagnose(_tier_signals(used))]
    full = used is None or used >= Thresholds().tier_full
    assert found == [Pattern.TIER_PINNED if full else Pattern.FRAGMENTATION]


def test_allocation_failures_at_85_percent_used_are_fragmentation(tmp_path: Path) -> None:
    """The tier_pinned scenario with its cpu tier 85% used: 15% free that allocations
    cannot use is free space doctor must explain."""
    stats = []
    for i, f in enumerate(files("tier_pinned", "stats")):
        doc = json.loads(Path(f).read_text())
        cpu = doc["tiers"]["cpu"]
        cpu["used_bytes"] = int(cpu["capacity_bytes"] * 0.85)
        cpu["free_bytes"] = cpu["capacity_bytes"] - cpu["used_bytes"]
        (tmp_path / f"stats-{i}.json").write_text(json.dumps(doc))
        stats.append(str(tmp_path / f"stats-{i}.json"))
    engine = [Path(f).read_text() for f in files("tier_pinned", "engine")]
    found = _findings(engine, stats, tmp_path)
    assert [f.pattern for f in found] == [Pattern.FRAGMENTATION]
    assert "180 allocation failures" in found[0].evidence[0]


def _external(text: str, queries: float, hits: float) -> str:
    """``text`` with vLLM's KV connector prefix cache counters added."""
    lab = f'{{engine="0",model_name="{MODEL}"}}'
    return text + "".join(
        f"# TYPE vllm:external_prefix_cache_{name}_total counter\n"
        f"vllm:external_prefix_cache_{name}_total{lab} {value}\n"
        for name, value in (("queries", queries), ("hits", hits)))


@pytest.mark.parametrize(("kvtier_share", "fires"), [(0.5, False), (0.05, True)])
def test_hits_kvtier_loads_count_toward_the_prefix_hit_rate(
        tmp_path: Path, kvtier_share: float, fires: bool) -> None:
    """The GPU's prefix cache hits 3%; the connector loads ``kvtier_share`` of what it
    misses (vllm:external_prefix_cache_*). Prompts that kvtier serves do share prefixes."""
    scrapes = []
    for f in files("low_hit_rate", "engine"):
        s = parse_engine(Path(f).read_text(), f)
        q, h = s.get(m.PREFIX_QUERIES) or 0.0, s.get(m.PREFIX_HITS) or 0.0
        scrapes.append(_external(Path(f).read_text(), q - h, (q - h) * kvtier_share))
    found = _findings(scrapes, [], tmp_path)
    assert [f.pattern for f in found] == ([Pattern.LOW_PREFIX_HIT_RATE] if fires else [])
    if fires:
        assert any("KV connector's hits" in e for e in found[0].evidence)


def test_kvtier_lookups_hitting_is_not_a_low_hit_rate(tmp_path: Path) -> None:
    """The low_hit_rate scenario, but kvtier's own lookups hit 60% of the tokens looked up
    in the window: the advice to size kvtier's tiers down would be wrong."""
    docs = [json.loads(Path(f).read_text()) for f in files("low_hit_rate", "stats")]
    window = docs[1]["requests"]["lookup_tokens"] - docs[0]["requests"]["lookup_tokens"]
    docs[1]["requests"]["hit_tokens"] = docs[0]["requests"]["hit_tokens"] + int(0.6 * window)
    docs[1]["requests"]["prefix_hit_rate"] = 0.6
    stats = []
    for i, doc in enumerate(docs):
        (tmp_path / f"stats-{i}.json").write_text(json.dumps(doc))
        stats.append(str(tmp_path / f"stats-{i}.json"))
    engine = [Path(f).read_text() for f in files("low_hit_rate", "engine")]
    assert _findings(engine, stats, tmp_path) == []


def test_a_few_kvtier_hits_do_not_hide_a_low_hit_rate() -> None:
    """kvtier's rate counts once it has seen as many tokens as the GPU rate needs."""
    base = Signals(samples=2, interval_s=10.0, prefix_hit_rate=0.03,
                   prefix_queries=150_000.0, kvtier_hit_rate=0.6, kvtier_queries=500.0)
    assert [f.pattern for f in diagnose(base)] == [Pattern.LOW_PREFIX_HIT_RATE]
