"""The readers under doctor's rules: Prometheus histograms (window, mean, PromQL-style
quantiles), the engine scrape parser, the /v1/stats reader and the sampling plan. A wrong
bucket or a reset read as a negative window changes every finding built on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.doctor.histogram import Histogram

INF = float("inf")


def test_minus_after_a_counter_reset_keeps_the_newer_scrape() -> None:
    """An engine restart makes the histogram smaller: the window is the new counts, not
    negative ones."""
    old = Histogram((1.0, INF), (80.0, 100.0), 500.0, 100.0)
    new = Histogram((1.0, INF), (5.0, 10.0), 20.0, 10.0)
    assert new.minus(old) == new
    assert new.minus(new).count == 0


def test_mean_of_no_observations_is_none() -> None:
    assert Histogram((1.0, INF), (0.0, 0.0), 0.0, 0.0).mean() is None


def test_quantile_interpolates_like_promql() -> None:
    """histogram_quantile: linear within the bucket the rank falls in, counted from the
    bucket's lower bound and the observations below it; an empty bucket after the rank's
    one is not where the rank lies; in +Inf the last finite bound."""
    h = Histogram((1.0, 10.0, 100.0, INF), (50.0, 50.0, 90.0, 100.0), 0.0, 100.0)
    assert h.quantile(0.5) == pytest.approx(1.0)
    assert h.quantile(0.7) == pytest.approx(10.0 + 90.0 * (70.0 - 50.0) / 40.0)
    assert h.quantile(0.95) == pytest.approx(100.0)
    assert h.quantile(0.2) == pytest.approx(0.4)


def test_plus_merges_same_buckets_only() -> None:
    """Two engines' series add up; a series with other buckets is not mixed in."""
    a = Histogram((1.0, INF), (1.0, 2.0), 3.0, 2.0)
    assert a.plus(a) == Histogram((1.0, INF), (2.0, 4.0), 6.0, 4.0)
    assert a.plus(Histogram((5.0, INF), (1.0, 1.0), 9.0, 1.0)) == a


TWO_ENGINES = """\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} 0.3
vllm:kv_cache_usage_perc{engine="1"} 0.9
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 0
vllm:num_requests_running{engine="1"} 7
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu="0"} 100
DCGM_FI_DEV_GPU_UTIL{gpu="1"} 50
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{engine="0",num_gpu_blocks="100",block_size="16"} 1
vllm:cache_config_info{engine="1",num_gpu_blocks="200",block_size="16"} 1
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0"} 2
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf"} 4
vllm:time_to_first_token_seconds_count{engine="0"} 4
vllm:time_to_first_token_seconds_sum{engine="0"} 6
vllm:time_to_first_token_seconds_bucket{engine="1",le="1.0"} 1
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf"} 6
vllm:time_to_first_token_seconds_count{engine="1"} 6
vllm:time_to_first_token_seconds_sum{engine="1"} 14
"""


def test_data_parallel_scrape_is_read_per_metric_kind() -> None:
    """KV usage: the fullest engine (not a sum over 100%); running: summed, a 0 counts as
    present; DCGM gauges: the mean; the pool: blocks x block size of every engine;
    histograms: every engine's buckets, sums and counts added."""
    from kvtier.doctor import engine as m
    from kvtier.doctor.engine import parse_engine

    e = parse_engine(TWO_ENGINES, "e.prom")
    assert e.get(m.KV_USAGE) == 0.9
    assert e.get(m.RUNNING) == 7.0
    assert e.get(m.GPU_UTIL) == 75.0
    assert e.kv_capacity_tokens == 300 * 16
    ttft = e.histogram(m.TTFT)
    assert ttft is not None
    assert (ttft.counts, ttft.count, ttft.total) == ((3.0, 10.0), 10.0, 20.0)
    partial = TWO_ENGINES.replace('engine="1",num_gpu_blocks="200",', 'engine="1",')
    assert parse_engine(partial, "e.prom").kv_capacity_tokens is None


def test_zero_is_a_value_not_a_missing_metric() -> None:
    from kvtier.doctor import engine as m
    from kvtier.doctor.engine import parse_engine

    e = parse_engine("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n",
                     "e.prom")
    assert e.get(m.WAITING) == 0.0


def test_older_vllm_names_are_read() -> None:
    """vLLM before v1: gpu_cache_usage_perc and time_per_output_token_seconds."""
    from kvtier.doctor import engine as m
    from kvtier.doctor.engine import parse_engine

    text = ("# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.5\n"
            "# TYPE vllm:time_per_output_token_seconds histogram\n"
            'vllm:time_per_output_token_seconds_bucket{le="+Inf"} 2\n'
            "vllm:time_per_output_token_seconds_count 2\n"
            "vllm:time_per_output_token_seconds_sum 0.1\n")
    e = parse_engine(text, "e.prom")
    assert e.get(m.KV_USAGE) == 0.5
    itl = e.histogram(m.ITL)
    assert itl is not None and itl.mean() == pytest.approx(0.05)


def test_gpu_scrape_overrides_the_engine_s_dcgm_gauges() -> None:
    """--gpu-metrics is the operator's explicit source: its values replace stale ones."""
    from kvtier.doctor import engine as m
    from kvtier.doctor.engine import EngineSample, merge

    e = EngineSample("e", {m.GPU_UTIL[0]: 10.0})
    g = EngineSample("g", {m.GPU_UTIL[0]: 95.0})
    assert merge(e, g).get(m.GPU_UTIL) == 95.0


def test_stats_tier_fields() -> None:
    """A tier of capacity 0 has no used share (not a division by zero); ``up`` is read only
    as a JSON boolean (the string "false" is not a tier that is up); a ``true`` count is no
    number; evictions.capacity and the connector's context P99 are read from their keys."""
    from kvtier.doctor.stats import parse_stats

    s = parse_stats('{"tiers": {"a": {"capacity_bytes": 0, "used_bytes": 0, "up": "false",'
                    ' "allocation_failures": true, "evictions": {"capacity": 7}}},'
                    ' "connector": {"context_tokens_p50": 100, "context_tokens_p99": 900},'
                    ' "version": 1.5}', "s.json")
    a = s.tiers["a"]
    assert a.used_share is None and a.up is None and a.allocation_failures is None
    assert a.evictions_capacity == 7.0
    assert (s.context_p50, s.context_p99) == (100.0, 900.0)
    assert s.version is None


def test_collect_plan_for_files_and_the_interval(tmp_path: Path) -> None:
    """Saved files are each read once (never sleeping); the interval comes from the
    daemon's uptime between the last two snapshots, the default when it went back."""
    from kvtier.doctor.collect import DEFAULT_INTERVAL_S, Request, collect

    paths = []
    for i, up in enumerate((100.0, 107.0, 110.0)):
        p = tmp_path / f"s{i}.json"
        p.write_text(json.dumps({"daemon": {"uptime_s": up}}))
        paths.append(str(p))
    slept: list[float] = []
    got = collect(Request(stats=tuple(paths), stats_explicit=True, samples=5),
                  sleep=slept.append)
    assert len(got.stats) == 3 and slept == []
    assert got.interval_s == pytest.approx(3.0)
    Path(paths[2]).write_text(json.dumps({"daemon": {"uptime_s": 1.0}}))
    got = collect(Request(stats=tuple(paths), stats_explicit=True))
    assert got.interval_s == DEFAULT_INTERVAL_S
    one = collect(Request(stats=(paths[0],), stats_explicit=True))
    assert one.interval_s is None


def test_negative_pool_size_is_refused() -> None:
    """num_gpu_blocks -5 is no KV pool: a negative capacity made every demand "over the
    pool" (pattern 8 on a broken exporter)."""
    from kvtier.doctor.engine import parse_engine
    from kvtier.doctor.errors import DoctorError

    text = ("# TYPE vllm:cache_config_info gauge\n"
            'vllm:cache_config_info{num_gpu_blocks="-5",block_size="16"} 1\n')
    with pytest.raises(DoctorError, match="not a KV pool size"):
        parse_engine(text, "e.prom")


def test_each_engine_scrape_gets_the_gpu_scrape_taken_with_it(tmp_path: Path) -> None:
    """--gpu-metrics files pair with --engine-metrics files in order (the last one for the
    rest): every scrape showing the last GPU reading hid a GPU that became busy."""
    from kvtier.doctor import engine as m
    from kvtier.doctor.collect import Request, collect

    engines, gpus = [], []
    for i in range(3):
        e = tmp_path / f"e{i}.prom"
        e.write_text("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n")
        engines.append(str(e))
    for i in range(2):
        g = tmp_path / f"g{i}.prom"
        g.write_text(f"# TYPE DCGM_FI_DEV_GPU_UTIL gauge\nDCGM_FI_DEV_GPU_UTIL {10 * (i + 1)}\n")
        gpus.append(str(g))
    got = collect(Request(stats=(), engine=tuple(engines), gpu=tuple(gpus)))
    assert [e.get(m.GPU_UTIL) for e in got.engine] == [10.0, 20.0, 20.0]


def test_zero_samples_is_refused() -> None:
    from kvtier.doctor.collect import Request, collect
    from kvtier.doctor.errors import DoctorError

    with pytest.raises(DoctorError, match="--samples must be at least 1"):
        collect(Request(samples=0))


def test_report_counts_and_status() -> None:
    """"1 finding" (not "1 findings") in the text head; --json says "healthy" with none."""
    from kvtier.doctor.collect import Collected
    from kvtier.doctor.report import render_text, to_json
    from kvtier.doctor.rules import diagnose
    from kvtier.doctor.signals import Signals

    s = Signals(samples=2, interval_s=10.0, preemptions=5.0)
    text = render_text(diagnose(s), s, Collected())
    assert text.startswith("kvtier doctor: 1 finding (2 samples 10 s apart)")
    quiet = Signals(samples=1, interval_s=None)
    assert to_json([], quiet, Collected())["status"] == "healthy"
    assert to_json(diagnose(s), s, Collected())["status"] == "findings"
