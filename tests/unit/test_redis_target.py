"""redis.url forms (kvtier.tiers.redis_client.parse_target): a cluster may name several
startup nodes, anything else only one; every malformed form is one ConfigError."""

from __future__ import annotations

import pytest

from kvtier.config import RedisConfig
from kvtier.errors import ConfigError
from kvtier.tiers.redis_client import RedisMode, parse_target
from kvtier.tiers.redis_route import conn_options


def test_a_cluster_url_may_name_several_startup_nodes() -> None:
    cfg = RedisConfig(url="redis+cluster://kv:s3cret@h1:7000,h2:7001,[::1]:7002/0")
    t = parse_target(cfg)
    assert t.mode is RedisMode.CLUSTER
    assert t.seeds == (("h2", 7001), ("::1", 7002))
    assert "s3cret" not in t.display and "h1:7000,h2:7001" in t.display
    seed, opts = conn_options(cfg, t)
    assert (seed.host, seed.port) == ("h1", 7000)
    assert (opts.username, opts.password) == ("kv", "s3cret")
    assert parse_target(RedisConfig(url="redis+cluster://h1:7000")).seeds == ()


@pytest.mark.parametrize(("url", "said"), [
    ("redis://h1:6379,h2:6379/0", "only a cluster"),
    ("redis+cluster://h1:7000,h2:99999", "malformed"),
    ("redis+cluster://h1:7000,:7001", "has no host"),
])
def test_bad_startup_node_lists_are_one_config_error(url: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        parse_target(RedisConfig(url=url))


@pytest.mark.parametrize("url", [
    "redis://u:s3cret@h:99999/0",              # port out of range
    "redis://u:s3cret@[::1/0",                 # a bad IPv6 literal
    "redis://u:s3cret@h1:6379,h2:6379/0",      # several servers without cluster mode
    "redis+cluster://u:s3cret@h1:7000,h2:99999",   # a malformed startup node
    "redis+cluster://u:s3cret@h1:7000,:7001",  # a startup node without a host
])
def test_a_malformed_url_is_named_without_its_password(url: str) -> None:
    """These errors printed the whole URL, password included, into the startup error that
    lands in journald (found by review); the db-number error already masked it."""
    with pytest.raises(ConfigError) as err:
        parse_target(RedisConfig(url=url))
    assert "s3cret" not in str(err.value) and "***@" in str(err.value)
