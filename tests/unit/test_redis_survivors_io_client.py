"""redis.url and the TLS context (kvtier.tiers.redis_client), the checks no other test
pinned (mutation review): a unix socket is never a cluster, the db number's upper bound,
the password masked in the cluster-db error, a client key in its own file, and
``tls_verify`` switching verification off and only then."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from kvtier.config import RedisConfig
from kvtier.errors import ConfigError
from kvtier.tiers.redis_client import MAX_DB, RedisMode, parse_target, tls_context
from tests.support.certs import self_signed


@pytest.mark.parametrize(("url", "cluster"), [
    ("unix+cluster:///run/redis.sock", False),
    ("unix:///run/redis.sock", True),
])
def test_a_unix_socket_is_never_a_cluster(url: str, cluster: bool) -> None:
    """A cluster's nodes are discovered by host:port: over a unix socket the router would
    be handed addresses it cannot reach (refused up front, with its reason)."""
    with pytest.raises(ConfigError, match="unix:// socket"):
        parse_target(RedisConfig(url=url, cluster=cluster))


def test_the_largest_database_number_is_max_db() -> None:
    """``/MAX_DB`` is taken, one more is a ConfigError (not a db the server then refuses
    at every connect with a message far from the config)."""
    assert parse_target(RedisConfig(url=f"redis://h:6379/{MAX_DB}")).db == MAX_DB
    with pytest.raises(ConfigError, match="is not a database number"):
        parse_target(RedisConfig(url=f"redis://h:6379/{MAX_DB + 1}"))


def test_a_cluster_db_error_is_named_without_the_password() -> None:
    """The cluster-has-only-db-0 error lands in journald like the others: no password."""
    with pytest.raises(ConfigError, match="only db 0") as err:
        parse_target(RedisConfig(url="redis+cluster://u:s3cret@h:7000/3"))
    assert "s3cret" not in str(err.value) and "***@" in str(err.value)


def test_the_display_of_a_target_carries_no_credentials() -> None:
    """``display`` goes to logs and stats: host, port and path only."""
    t = parse_target(RedisConfig(url="rediss://kv:s3cret@cache.internal:6380/2"))
    assert t.display == "rediss://cache.internal:6380/2"
    assert t.tls and t.db == 2 and t.mode is RedisMode.SINGLE


def test_a_client_key_in_its_own_file_is_loaded(tmp_path: Path) -> None:
    """``redis.tls_key`` is passed with the certificate: dropped, a certificate without
    its key inside fails to load and mutual TLS cannot be configured at all."""
    cert, key = self_signed(tmp_path, "kvtier-test")
    ctx = tls_context(RedisConfig(url="rediss://h:1/0", tls_cert=str(cert),
                                  tls_key=str(key)))
    assert isinstance(ctx, ssl.SSLContext)
    with pytest.raises(ConfigError, match=r"^redis\.tls_cert/redis\.tls_key "):
        tls_context(RedisConfig(url="rediss://h:1/0", tls_cert=str(cert),
                                tls_key=str(cert)))


def test_verification_is_off_only_when_tls_verify_is_false() -> None:
    """The default verifies the server's certificate and name; ``tls_verify = false``
    turns both off (inverted, every default deployment would trust any server)."""
    ctx = tls_context(RedisConfig(url="rediss://h:1/0"))
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    loose = tls_context(RedisConfig(url="rediss://h:1/0", tls_verify=False))
    assert loose.verify_mode == ssl.CERT_NONE and not loose.check_hostname


def test_a_startup_node_without_a_port_is_on_redis_s_port() -> None:
    """``h2`` in a startup list means h2:6379, like the first host of any redis URL."""
    t = parse_target(RedisConfig(url="redis+cluster://h1:7000,h2,h3:7002"))
    assert t.seeds == (("h2", 6379), ("h3", 7002))


@pytest.mark.parametrize("url", ["http://h:6379/0", "tcp://h:6379", "h:6379"])
def test_a_scheme_other_than_redis_s_is_refused(url: str) -> None:
    """Only redis://, rediss:// and unix:// (a cluster suffix aside) are spoken."""
    with pytest.raises(ConfigError, match="is not supported"):
        parse_target(RedisConfig(url=url))
