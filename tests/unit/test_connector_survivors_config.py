"""kv_connector_extra_config and kv_role, value by value (mutation review survivors): every
bad value is a ConfigError naming its key, every default is the documented one, and vLLM's
own fields (kv_role, block_size) are the ones read."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.errors import ConfigError
from kvtier.layout import default_tokens_per_block
from kvtier.weights import WEIGHTS_MARK

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.config import (
    DEFAULT_MAX_INFLIGHT_SAVE_BYTES,
    DEFAULT_PREFILL_TOKENS_PER_S,
    ConnectorConfig,
)


def config(extra: dict[str, Any] | None = None, *, block_size: int = 16,
           role: str | None = None, weights: Any = None) -> ConnectorConfig:
    return ConnectorConfig.from_extra(extra, block_size=block_size, default_model_id="m",
                                      role=role, weights=weights)


@pytest.mark.parametrize(("key", "bad"), [
    ("tokens_per_block", 0), ("tokens_per_block", -16), ("tokens_per_block", True),
    ("tokens_per_block", 24), ("tokens_per_block", "64"), ("tokens_per_block", 64.0),
    ("max_inflight_save_bytes", 0), ("max_inflight_save_bytes", True),
    ("timeout_s", 0), ("timeout_s", -1.0), ("timeout_s", True), ("timeout_s", "2"),
    ("reconnect_min_s", 0.0), ("reconnect_max_s", False), ("prefill_tokens_per_s", 0),
    ("tier_bandwidth", {"gpu": 1e9}), ("tier_bandwidth", {"cpu": 0}),
    ("tier_bandwidth", {"cpu": -1.0}), ("tier_bandwidth", {"cpu": True}),
    ("tier_bandwidth", {"cpu": "1e9"}), ("tier_bandwidth", [("cpu", 1e9)]),
    ("device_loads", "yes"), ("device_loads", 1), ("device_loads", "false"),
    ("async_load", "false"), ("async_load", 1), ("save_decode_tokens", None),
    ("skip_slower_than_recompute", "no"), ("presence_filter", 0),
    ("context_reuse", "yes"), ("context_reuse", True),
    ("model_fingerprint", ""), ("model_fingerprint", 5),
    ("model_fingerprint", f"v1{WEIGHTS_MARK}x"),
    ("tokens_per_blok", 64),
])
def test_each_bad_value_is_a_config_error_naming_its_key(key: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=key):
        config({key: bad})


def test_tokens_per_block_is_a_multiple_of_vllm_s_page() -> None:
    assert config({"tokens_per_block": 96}, block_size=32).tokens_per_block == 96
    with pytest.raises(ConfigError, match="multiple of vLLM's block_size=32"):
        config({"tokens_per_block": 48}, block_size=32)


def test_the_defaults_are_the_documented_ones() -> None:
    cfg = config(None)
    assert cfg.tokens_per_block == default_tokens_per_block(16)
    assert config(None, block_size=48).tokens_per_block == default_tokens_per_block(48)
    assert (cfg.save_decode_tokens, cfg.async_load, cfg.skip_slower_than_recompute,
            cfg.presence_filter, cfg.device_loads) == (False, False, True, True, None)
    assert (cfg.timeout_s, cfg.reconnect_min_s, cfg.reconnect_max_s) == (2.0, 0.5, 10.0)
    assert cfg.max_inflight_save_bytes == DEFAULT_MAX_INFLIGHT_SAVE_BYTES
    assert cfg.prefill_tokens_per_s == DEFAULT_PREFILL_TOKENS_PER_S
    assert (cfg.role, cfg.context_reuse, cfg.tier_bandwidth) == ("kv_both", "auto", {})


def test_each_value_given_is_the_one_used(tmp_path: Path) -> None:
    sock = tmp_path / "k.sock"
    cfg = config({"socket_path": str(sock), "timeout_s": 3, "reconnect_min_s": 0.25,
                  "reconnect_max_s": 4, "max_inflight_save_bytes": 1024,
                  "prefill_tokens_per_s": 500, "tier_bandwidth": {"nvme": 2e9, "cpu": 1},
                  "save_decode_tokens": True, "async_load": True,
                  "skip_slower_than_recompute": False, "presence_filter": False,
                  "context_reuse": "off"})
    assert cfg.socket_path == sock
    assert (cfg.timeout_s, cfg.reconnect_min_s, cfg.reconnect_max_s) == (3.0, 0.25, 4.0)
    assert (cfg.max_inflight_save_bytes, cfg.prefill_tokens_per_s) == (1024, 500.0)
    assert cfg.tier_bandwidth == {"nvme": 2e9, "cpu": 1.0}
    assert (cfg.save_decode_tokens, cfg.async_load, cfg.skip_slower_than_recompute,
            cfg.presence_filter, cfg.context_reuse) == (True, True, False, False, "off")


@pytest.mark.parametrize(("given", "read"), [("auto", None), (None, None), (True, True),
                                             (False, False)])
def test_device_loads_is_true_false_or_auto(given: object, read: bool | None) -> None:
    assert config({"device_loads": given}).device_loads is read


def test_the_reconnect_backoff_never_ends_below_where_it_starts() -> None:
    cfg = config({"reconnect_min_s": 2.0, "reconnect_max_s": 0.5})
    assert (cfg.reconnect_min_s, cfg.reconnect_max_s) == (2.0, 2.0)


def test_the_namespace_and_weights_mark_name_the_model() -> None:
    """Two deployments of one model under other namespaces, or of other weights, never
    share KV; "off" appends nothing and a version string is appended as it is."""
    assert config({"namespace": "prod"}).model_id == "prod/m"
    assert config({"namespace": "prod", "model_id": "org/x"}).model_id == "prod/org/x"
    assert config({"namespace": ""}).model_id == "m"
    asked: list[int] = []

    def weights() -> str:
        asked.append(1)
        return "abc"

    assert config({}, weights=weights).model_id == f"m{WEIGHTS_MARK}abc"
    assert config({"model_fingerprint": "off"}, weights=weights).model_id == "m"
    assert config({"model_fingerprint": "v7"}, weights=weights).model_id == \
        f"m{WEIGHTS_MARK}v7"
    assert asked == [1]          # only "auto" computes the checkpoint's fingerprint


def test_a_model_id_the_daemon_would_refuse_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="model_id"):
        config({"model_id": "m" * 5000})


def vllm_config(block_size: int, role: str | None, extra: dict[str, Any]) -> Any:
    transfer = SimpleNamespace(kv_connector_extra_config=extra)
    if role is not None:
        transfer.kv_role = role
    return SimpleNamespace(kv_transfer_config=transfer,
                           model_config=SimpleNamespace(model="org/model"),
                           cache_config=SimpleNamespace(block_size=block_size))


def test_from_vllm_reads_kv_role_block_size_and_the_model() -> None:
    """A consumer engine never saves: the role comes from vLLM's ``kv_role`` (read as
    kv_both, a consumer saved over the producer's KV); tokens_per_block is checked
    against the engine's own page size."""
    off = {"model_fingerprint": "off"}
    consumer = ConnectorConfig.from_vllm(vllm_config(32, "kv_consumer", off))
    assert (consumer.role, consumer.saves, consumer.model_id) == (
        "kv_consumer", False, "org/model")
    assert consumer.tokens_per_block == default_tokens_per_block(32)
    assert ConnectorConfig.from_vllm(vllm_config(16, None, off)).role == "kv_both"
    with pytest.raises(ConfigError, match="block_size=32"):
        ConnectorConfig.from_vllm(vllm_config(32, "kv_both", {**off,
                                                              "tokens_per_block": 48}))
    with pytest.raises(ConfigError, match="kv_role"):
        ConnectorConfig.from_vllm(vllm_config(16, "kv_prefill", off))
