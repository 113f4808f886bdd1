"""The connector's kv_role: what each role does, read once from vLLM's config."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.config import DEFAULT_REDIS_SYNC_TIMEOUT_S, ConnectorConfig


def config(role: str | None, **extra: object) -> ConnectorConfig:
    return ConnectorConfig.from_extra(dict(extra), block_size=16, default_model_id="m",
                                      role=role)


def test_roles_decide_saving_and_synchronous_write_through() -> None:
    both, producer, consumer = (config(r) for r in ("kv_both", "kv_producer", "kv_consumer"))
    assert (both.saves, both.producer) == (True, False)
    assert (producer.saves, producer.producer) == (True, True)
    assert (consumer.saves, consumer.producer) == (False, False)
    assert config(None).role == "kv_both"            # vLLM's kv_role unset
    assert producer.redis_sync_timeout_s == DEFAULT_REDIS_SYNC_TIMEOUT_S
    assert 0.9 * producer.timeout_s > DEFAULT_REDIS_SYNC_TIMEOUT_S
    assert config("kv_producer", redis_sync_timeout_s=4).redis_sync_timeout_s == 4.0


@pytest.mark.parametrize("bad", [{"redis_sync_timeout_s": 0}, {"redis_sync_timeout_s": "1"},
                                 {"redis_sync_timeout_s": True}])
def test_bad_sync_timeouts_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="redis_sync_timeout_s"):
        config("kv_producer", **bad)


def test_an_unknown_role_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="kv_producer"):
        config("kv_prefill")


@pytest.mark.parametrize(("field", "value", "said"), [
    ("pipeline_parallel_size", 2, "pipeline parallelism"),
    ("decode_context_parallel_size", 2, "decode_context_parallel_size=2"),
    ("prefill_context_parallel_size", 4, "prefill_context_parallel_size=4"),
])
def test_parallel_layouts_it_cannot_key_are_refused_at_start(field: str, value: int,
                                                              said: str) -> None:
    """Pipeline stages hold other layers under an identical layout, and context
    parallelism shards a page's tokens across ranks: keyed as usual, either would load
    another stage's or another shard's KV. The engine's start fails instead."""
    from types import SimpleNamespace

    from kvtier.connectors.vllm.geometry import check_parallelism

    plain = {"pipeline_parallel_size": 1, "decode_context_parallel_size": 1,
             "prefill_context_parallel_size": 1, "tensor_parallel_size": 4}
    check_parallelism(SimpleNamespace(**plain))   # tensor parallelism alone is fine
    with pytest.raises(ConfigError, match=said):
        check_parallelism(SimpleNamespace(**{**plain, field: value}))
