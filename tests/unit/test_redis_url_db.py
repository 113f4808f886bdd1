"""redis.url's database number and TLS files (kvtier.tiers.redis_client): a db that is not
one integer >= 0 is a ConfigError naming redis.url (it used to mean db 0 silently), and a
TLS file that cannot be loaded is a ConfigError naming its setting and path."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import Config, RedisConfig
from kvtier.config_checks import check_redis_files, validate
from kvtier.errors import ConfigError
from kvtier.tiers.redis_client import parse_target, tls_context
from kvtier.tiers.redis_route import conn_options


@pytest.mark.parametrize(("url", "db"), [
    ("redis://h:6379/0", 0), ("redis://h:6379/7", 7), ("redis://h:6379", 0),
    ("redis://h:6379/", 0), ("redis://h:6379/12/", 12), ("unix:///run/r.sock", 0),
    ("unix:///run/r.sock?db=3", 3), ("unix:///run/r.sock?db=", 0),
    ("redis+cluster://h:7000/0", 0), ("redis+cluster://h:7000", 0),
])
def test_database_numbers_that_are_taken(url: str, db: int) -> None:
    cfg = RedisConfig(url=url)
    target = parse_target(cfg)
    assert target.db == db
    assert conn_options(cfg, target)[1].db == db


@pytest.mark.parametrize("url", [
    "redis://h:6379/-1", "redis://h:6379/7abc", "redis://h:6379/1/2", "redis://h:6379/ 1",
    "redis://h:6379/\u00b2", "rediss://u:pw@h:6379/x", "unix:///run/r.sock?db=abc",
    "unix:///run/r.sock?db=-2", "unix:///run/r.sock?db=1&db=2",
])
def test_a_database_that_is_not_one_integer_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match=r"redis\.url .*is not a database number") as err:
        parse_target(RedisConfig(url=url))
    assert "pw" not in str(err.value)


def test_a_cluster_has_only_db_0() -> None:
    with pytest.raises(ConfigError, match="only db 0"):
        parse_target(RedisConfig(url="redis+cluster://h:7000/3"))


def test_tls_files_that_cannot_be_loaded_name_the_setting_and_path(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "ca.pem"
    with pytest.raises(ConfigError, match=f"^redis.tls_ca {missing}: No such file"):
        tls_context(RedisConfig(url="rediss://h:1/0", tls_ca=str(missing)))
    garbage = tmp_path / "bad.pem"
    garbage.write_text("garbage\n")
    with pytest.raises(ConfigError, match=f"^redis.tls_ca {garbage}: .*give a PEM CA"):
        tls_context(RedisConfig(url="rediss://h:1/0", tls_ca=str(garbage)))
    with pytest.raises(ConfigError, match=f"^redis.tls_cert {garbage}"):
        tls_context(RedisConfig(url="rediss://h:1/0", tls_cert=str(garbage)))


def _enabled(url: str, tls_ca: str = "", tls_cert: str = "", tls_key: str = "") -> Config:
    cfg = Config()
    cfg.redis = RedisConfig(enabled=True, url=url, tls_ca=tls_ca, tls_cert=tls_cert,
                            tls_key=tls_key)
    return cfg


def test_the_serve_check_of_tls_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"redis\.tls_ca /nonexistent/ca\.pem: No such file"):
        check_redis_files(_enabled(url="rediss://h:1/0", tls_ca="/nonexistent/ca.pem"))
    with pytest.raises(ConfigError, match=f"redis.tls_cert {tmp_path}: is not a regular"):
        check_redis_files(_enabled(url="rediss://h:1/0", tls_cert=str(tmp_path)))
    check_redis_files(_enabled(url="redis://h:1/0", tls_ca="/nonexistent"))   # no TLS
    with pytest.raises(ConfigError, match=r"redis\.tls_key is set without redis\.tls_cert"):
        validate(_enabled(url="rediss://h:1/0", tls_key=str(tmp_path / "k.pem")))
