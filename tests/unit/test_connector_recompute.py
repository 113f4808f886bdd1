"""The connector's reload-versus-recompute decision and its configuration."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.config import DEFAULT_MAX_INFLIGHT_SAVE_BYTES, ConnectorConfig
from kvtier.connectors.vllm.recompute import RecomputeModel

BLOCK = 1_000_000           # bytes per block
TPB = 100                   # tokens per block


def model(tps: float = 1000.0, **bw: float) -> RecomputeModel:
    """Recompute of a block takes 0.1 s at the default 1000 tokens/s."""
    return RecomputeModel(TPB, BLOCK, tps, dict(bw))


def test_unknown_bandwidth_loads_everything() -> None:
    assert model().worth_loading(["cpu", "nvme", "redis"], {}, 0, 3) == 3


def test_the_first_block_slower_than_recompute_cuts_the_rest() -> None:
    measured = {"cpu": 100e6, "nvme": 20e6, "redis": 5e6}   # 0.01 s, 0.05 s, 0.2 s
    m = model()
    assert m.worth_loading(["cpu", "cpu", "redis", "cpu"], measured, 0, 4) == 2
    assert m.worth_loading(["nvme", "nvme"], measured, 0, 2) == 2
    assert m.worth_loading(["redis", "cpu"], measured, 0, 2) == 0


def test_blocks_already_local_are_not_judged() -> None:
    measured = {"redis": 5e6}
    assert model().worth_loading(["redis", "redis", "cpu"], measured, 2, 3) == 3


def test_configured_bandwidth_overrides_the_measured_one() -> None:
    m = model(cpu=1e3)
    assert m.worth_loading(["cpu"], {"cpu": 1e12}, 0, 1) == 0
    assert model(redis=1e12).worth_loading(["redis"], {"redis": 1.0}, 0, 1) == 1


def test_prefill_throughput_is_measured_after_warmup() -> None:
    m = model(tps=1000.0)
    m.observe_step(1000, 10.0)        # warm-up step: ignored
    m.observe_step(10, 0.001)         # decode-sized: ignored
    assert m.prefill_tokens_per_s == 1000.0 and m.measured_steps == 0
    m.observe_step(5000, 1.0)
    assert m.prefill_tokens_per_s == pytest.approx(5000.0) and m.measured_steps == 1
    m.observe_step(10000, 1.0)
    assert 5000.0 < m.prefill_tokens_per_s < 10000.0
    assert m.recompute_s == pytest.approx(TPB / m.prefill_tokens_per_s)


def config(**extra: object) -> ConnectorConfig:
    return ConnectorConfig.from_extra(extra, block_size=32, default_model_id="m")


def test_data_path_config_defaults() -> None:
    c = config()
    assert c.max_inflight_save_bytes == DEFAULT_MAX_INFLIGHT_SAVE_BYTES
    assert c.skip_slower_than_recompute and c.tier_bandwidth == {}
    assert c.device_loads is None
    c = config(tier_bandwidth={"nvme": 2e9}, device_loads=True, max_inflight_save_bytes=4096,
               prefill_tokens_per_s=123.0, skip_slower_than_recompute=False)
    assert c.tier_bandwidth == {"nvme": 2e9} and c.device_loads is True
    assert c.max_inflight_save_bytes == 4096 and c.prefill_tokens_per_s == 123.0
    assert not c.skip_slower_than_recompute


@pytest.mark.parametrize("extra", [
    {"tier_bandwidth": {"ssd": 1e9}},
    {"tier_bandwidth": {"cpu": 0}},
    {"tier_bandwidth": [1, 2]},
    {"device_loads": "yes"},
    {"max_inflight_save_bytes": 0},
    {"prefill_tokens_per_s": -1.0},
])
def test_bad_data_path_config_is_refused(extra: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        config(**extra)
