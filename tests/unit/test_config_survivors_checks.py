"""Mutation-review pins for kvtier.config_checks (the cross-field checks and floors of a
loaded config, the TLS files a serving daemon reads) and for how ``kvtier serve`` and the
other commands report a refused start."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier import config_checks
from kvtier.config import Config, RedisConfig, load_config
from kvtier.config_checks import check_redis_files, validate
from kvtier.errors import ConfigError


@pytest.mark.parametrize(("name", "top"), [
    ("listen_backlog", 65535), ("max_connections", 1 << 20),
    ("max_connections_per_client", 1 << 20), ("max_namespaces", 1 << 24),
    ("max_inflight_per_conn", 1 << 16), ("max_frame_bytes", 1 << 30),
])
def test_each_daemon_limit_allows_its_top_and_refuses_one_more(name: str, top: int) -> None:
    """The top itself is a valid setting (an operator who reads "at most 65535" and writes
    65535 must start); one more is one line naming the setting."""
    env_name = f"KVTIER_DAEMON_{name.upper()}"
    assert getattr(load_config(env={env_name: str(top)}).daemon, name) == top
    with pytest.raises(ConfigError, match=rf"^daemon\.{name} must be at most {top}, got "
                                          rf"{top + 1}$"):
        load_config(env={env_name: str(top + 1)})


def test_nvme_io_threads_top() -> None:
    assert load_config(env={"KVTIER_NVME_IO_THREADS": "1024"}).nvme.io_threads == 1024
    with pytest.raises(ConfigError, match=r"^nvme\.io_threads must be at most 1024, got 1025"):
        load_config(env={"KVTIER_NVME_IO_THREADS": "1025"})


@pytest.mark.parametrize(("low", "high", "ok"), [
    ("0", "30", False),          # a zero first wait: a failing disk probed in a busy loop
    ("0.5", "0.5", True),        # no doubling, but a fixed wait is a fine choice
    ("2", "1", False),
    ("0.001", "30", True),
])
def test_nvme_backoff_bounds(low: str, high: str, ok: bool) -> None:
    env = {"KVTIER_NVME_BACKOFF_MIN_S": low, "KVTIER_NVME_BACKOFF_MAX_S": high}
    if ok:
        cfg = load_config(env=env)
        assert (cfg.nvme.backoff_min_s, cfg.nvme.backoff_max_s) == (float(low), float(high))
    else:
        with pytest.raises(ConfigError, match=r"^nvme\.backoff_min_s must be > 0"):
            load_config(env=env)


def test_a_zero_redis_lookup_budget_is_refused() -> None:
    """0 s would make every Redis lookup a counted miss: a tier that never serves."""
    with pytest.raises(ConfigError, match=r"^redis\.lookup_budget_s must be > 0"):
        load_config(env={"KVTIER_REDIS_LOOKUP_BUDGET_S": "0"})
    assert load_config(env={"KVTIER_REDIS_LOOKUP_BUDGET_S": "0.001"}).redis.lookup_budget_s


@pytest.mark.parametrize("host", ["   ", "\t"])
def test_a_blank_http_host_is_refused(host: str) -> None:
    """Whitespace only would reach the listener as "every interface" (or a bind error
    far from the setting): it is refused here, naming http.host."""
    with pytest.raises(ConfigError, match=r"^http\.host is empty"):
        load_config(env={"KVTIER_HTTP_HOST": host})


@pytest.mark.parametrize(("setting", "low", "zero_ok"), [
    ("KVTIER_DAEMON_LEASE_TTL_S", 0.1, False), ("KVTIER_DAEMON_READ_TIMEOUT_S", 0.1, False),
    ("KVTIER_DAEMON_IDLE_TIMEOUT_S", 0.1, True), ("KVTIER_DAEMON_GC_FULL_S", 1.0, True),
    ("KVTIER_REDIS_CONNECT_TIMEOUT_S", 0.01, False),
    ("KVTIER_REDIS_OP_TIMEOUT_S", 0.01, False),
])
def test_each_timing_floor_its_edge_and_its_zero(setting: str, low: float,
                                                 zero_ok: bool) -> None:
    """The floor itself is allowed, just below it is refused, and 0 means "never" only where
    the message says so (an idle timeout, a full collection), never for a lease or a
    read timeout (every put would fail with LeaseExpired)."""
    load_config(env={setting: repr(low)})
    with pytest.raises(ConfigError, match=rf"must be at least {low:g} seconds"):
        load_config(env={setting: repr(low * 0.99)})
    if zero_ok:
        load_config(env={setting: "0"})
    else:
        with pytest.raises(ConfigError, match=r"must be at least .* seconds, got 0:"):
            load_config(env={setting: "0"})


# -- TLS files ---------------------------------------------------------------------------------
def tls(enabled: bool = True, tls_ca: str = "", tls_cert: str = "", tls_key: str = ""
        ) -> Config:
    cfg = Config()
    cfg.redis = RedisConfig(enabled=enabled, url="rediss://h:1/0", tls_ca=tls_ca,
                            tls_cert=tls_cert, tls_key=tls_key)
    return cfg


def test_a_client_key_without_its_certificate_is_refused_even_with_a_ca(tmp_path: Path) -> None:
    """The CA bundle is not the client certificate: a key with only a CA must be refused."""
    with pytest.raises(ConfigError, match=r"^redis\.tls_key is set without redis\.tls_cert"):
        validate(tls(tls_ca=str(tmp_path / "ca.pem"), tls_key=str(tmp_path / "k.pem")))
    validate(tls(enabled=False, tls_key=str(tmp_path / "k.pem")))   # no tier: no check


def test_a_disabled_redis_tier_reads_no_tls_files() -> None:
    """A rediss:// URL kept in the file with the tier off must not refuse the start over
    files the daemon will never open."""
    check_redis_files(tls(enabled=False, tls_ca="/nonexistent/ca.pem"))


def test_an_unreadable_tls_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file the daemon's user cannot read is one line naming the setting and the uid
    (root reads anything, so the refusal is simulated)."""
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    monkeypatch.setattr(config_checks.os, "access", lambda *_a, **_k: False)
    with pytest.raises(ConfigError, match=rf"^redis\.tls_ca {ca}: is not readable by uid "
                                          r"\d+; give a PEM CA bundle"):
        check_redis_files(tls(tls_ca=str(ca)))


def test_a_fifo_as_tls_file_is_not_a_regular_file(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "key.pem"
    os.mkfifo(fifo)
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    with pytest.raises(ConfigError, match=r"^redis\.tls_key .*: is not a regular file"):
        check_redis_files(tls(tls_cert=str(cert), tls_key=str(fifo)))
