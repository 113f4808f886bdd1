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
