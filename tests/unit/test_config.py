"""Config: defaults < TOML < env < overrides, sizes, and errors that name the setting."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvtier.config import Config, load_config, parse_size
from kvtier.errors import ConfigError

GiB = 2**30
MiB = 2**20


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    return path


# -- sizes ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ("4GiB", 4 * GiB), ("4gib", 4 * GiB), ("4 GiB", 4 * GiB), ("4Gi", 4 * GiB),
    ("512MB", 512 * 10**6), ("512MiB", 512 * MiB), ("512M", 512 * 10**6),
    ("1e9", 10**9), ("1E9", 10**9), ("1.5GiB", 3 * GiB // 2), ("0.5KiB", 512),
    ("64KiB", 65536), ("2TB", 2 * 10**12), ("1TiB", 2**40), ("4096", 4096),
    ("4096B", 4096), ("  8kb ", 8000), ("0", 0),
    (4096, 4096), (0, 0), (1e9, 10**9), (2.5e3, 2500),
])
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", [
    "", "GiB", "-1", "-1GiB", "4 GiBs", "4XB", "1PB", "four", "1e999", "1e9999GiB",
    -1, -0.5, True, False, None, float("inf"), float("nan"), [1],
])
def test_parse_size_rejects_garbage(text: object) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)


# -- precedence ------------------------------------------------------------------------------
def test_defaults_without_file_or_env() -> None:
    cfg = load_config(env={})
    assert cfg.cpu.bytes == Config().cpu.bytes == 2 * GiB
    assert cfg.redis.enabled is False
    assert cfg.http.port == 8470


def test_precedence_file_then_env_then_overrides(tmp_path: Path) -> None:
    path = write_toml(tmp_path, """
[cpu]
bytes = "1GiB"
prefault = false
[http]
port = 9000
host = "0.0.0.0"
[redis]
url = "redis://file:6379/0"
""")
    env = {"KVTIER_CPU_BYTES": "2GiB", "KVTIER_HTTP_PORT": "9001"}
    cfg = load_config(path, env=env, overrides={"cpu.bytes": "3GiB", "http.port": None})
    assert cfg.cpu.bytes == 3 * GiB          # override beats env and file
    assert cfg.http.port == 9001             # env beats file; a None override is unset
    assert cfg.http.host == "0.0.0.0"        # file beats default
    assert cfg.cpu.prefault is False
    assert cfg.redis.url == "redis://file:6379/0"
    assert cfg.nvme.io_threads == 4          # default


def test_env_uses_section_and_field_names(tmp_path: Path) -> None:
    env = {"KVTIER_DAEMON_LOG_LEVEL": "debug", "KVTIER_REDIS_ENABLED": "yes",
           "KVTIER_NVME_WRITE_BUDGET_BYTES_PER_S": "100MB",
           "KVTIER_POLICY_PREFETCH_TIMEOUT_MS_PER_BLOCK": "3.5",
           "KVTIER_DATA_DIR": str(tmp_path / "data"), "KVTIER_SOCKET": str(tmp_path / "s"),
           "KVTIER_TEST_SOMETHING": "ignored", "OTHER_CPU_BYTES": "x", "KVTIER_": "x"}
    cfg = load_config(env=env)
    assert cfg.daemon.log_level == "debug"
    assert cfg.redis.enabled is True
    assert cfg.nvme.write_budget_bytes_per_s == 100 * 10**6
    assert cfg.policy.prefetch_timeout_ms_per_block == 3.5
    assert cfg.daemon.data_dir == tmp_path / "data"
    assert cfg.daemon.socket == tmp_path / "s"
    assert cfg.nvme_path == tmp_path / "data" / "nvme"


def test_env_none_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_CPU_BYTES", "3GiB")
    assert load_config().cpu.bytes == 3 * GiB


def test_paths_expand_user_and_nvme_path_may_be_unset(tmp_path: Path) -> None:
    cfg = load_config(env={"KVTIER_NVME_PATH": "~/kv"})
    assert cfg.nvme.path == Path("~/kv").expanduser()
    assert cfg.nvme_path == cfg.nvme.path
    assert load_config(env={"KVTIER_NVME_PATH": ""}).nvme.path is None


@pytest.mark.parametrize(("text", "expected"), [
    ("1", True), ("true", True), ("Yes", True), ("ON", True),
    ("0", False), ("false", False), ("no", False), ("off", False),
])
def test_booleans_from_env(text: str, expected: bool) -> None:
    assert load_config(env={"KVTIER_CPU_PREFAULT": text}).cpu.prefault is expected


def test_to_dict_masks_the_password_and_stringifies_paths() -> None:
    cfg = load_config(env={"KVTIER_REDIS_PASSWORD": "hunter2"})
    data = cfg.to_dict()
    assert data["redis"]["password"] == "***"
    assert cfg.redis.password == "hunter2"
    assert isinstance(data["daemon"]["socket"], str)


def test_small_cpu_tier_shrinks_the_slab() -> None:
    cfg = load_config(env={"KVTIER_CPU_BYTES": "16MiB"})
    assert cfg.cpu.slab_bytes == 16 * MiB


# -- errors name the setting ------------------------------------------------------------------
@pytest.mark.parametrize(("env", "setting"), [
    ({"KVTIER_CPU_BYTES": "lots"}, "cpu.bytes"),
    ({"KVTIER_CPU_BYTES": "1e999"}, "cpu.bytes"),
    ({"KVTIER_NVME_BYTES": "-1GiB"}, "nvme.bytes"),
    ({"KVTIER_DAEMON_MAX_FRAME_BYTES": "big"}, "daemon.max_frame_bytes"),
    ({"KVTIER_HTTP_PORT": "eighty"}, "http.port"),
    ({"KVTIER_HTTP_PORT": "1e3"}, "http.port"),
    ({"KVTIER_HTTP_PORT": "-1"}, "http.port"),
    ({"KVTIER_HTTP_PORT": "70000"}, "http.port"),
    ({"KVTIER_NVME_IO_THREADS": "-4"}, "nvme.io_threads"),
    ({"KVTIER_CPU_PREFAULT": "maybe"}, "cpu.prefault"),
    ({"KVTIER_DAEMON_LEASE_TTL_S": "soon"}, "daemon.lease_ttl_s"),
    ({"KVTIER_DAEMON_LEASE_TTL_S": "nan"}, "daemon.lease_ttl_s"),
    ({"KVTIER_DAEMON_LEASE_TTL_S": "inf"}, "daemon.lease_ttl_s"),
    ({"KVTIER_DAEMON_LEASE_TTL_S": "-5"}, "daemon.lease_ttl_s"),
    ({"KVTIER_CPU_BOGUS": "1"}, "cpu.bogus"),
    ({"KVTIER_NVME_DIRECT": "sometimes"}, "nvme.direct"),
    ({"KVTIER_NVME_BACKEND": "spdk"}, "nvme.backend"),
    ({"KVTIER_REDIS_CODEC": "gzip"}, "redis.codec"),
    ({"KVTIER_POLICY_EVICTION": "random"}, "policy.eviction"),
    ({"KVTIER_POLICY_PREFETCH_WAIT": "never"}, "policy.prefetch_wait"),
    ({"KVTIER_CPU_BYTES": "0"}, "cpu.bytes"),
], ids=lambda v: next(iter(v.items()))[0] + "=" + next(iter(v.values()))
    if isinstance(v, dict) else None)
def test_bad_env_values_raise_config_error_naming_the_setting(env: dict[str, str],
                                                              setting: str) -> None:
    with pytest.raises(ConfigError, match=setting.replace(".", r"\.")):
        load_config(env=env)


@pytest.mark.parametrize(("toml", "what"), [
    ("[cpu]\nbytes = \"many\"\n", "cpu.bytes"),
    ("[cpu]\nbytes = inf\n", "cpu.bytes"),
    ("[cpu]\nbytes = nan\n", "cpu.bytes"),
    ("[http]\nport = true\n", "http.port"),
    ("[daemon]\nlease_ttl_s = true\n", "daemon.lease_ttl_s"),
    ("[daemon]\nlease_ttl_s = nan\n", "daemon.lease_ttl_s"),
    ("[cpu]\nunknown = 1\n", "cpu.unknown"),
    ("[gpu]\nbytes = 1\n", "gpu"),
    ("bytes = 1\n", "bytes"),
    ("[cpu\nbytes = 1\n", "kvtier.toml"),
])
def test_bad_file_values_raise_config_error(tmp_path: Path, toml: str, what: str) -> None:
    with pytest.raises(ConfigError, match=what):
        load_config(write_toml(tmp_path, toml), env={})


def test_unknown_setting_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"known: .*bytes.*prefault"):
        load_config(env={}, overrides={"cpu.byte": "1GiB"})


def test_bad_override_names_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"flag cpu\.bogus"):
        load_config(env={}, overrides={"cpu.bogus": 1})
    with pytest.raises(ConfigError, match=r"cpu\.bytes"):
        load_config(env={}, overrides={"cpu.bytes": "x"})


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml", env={})


def test_unreadable_files_are_config_errors(tmp_path: Path) -> None:
    binary = tmp_path / "kvtier.toml"
    binary.write_bytes(b"\x1f\x8b\x08\x00\xff\xfe")   # e.g. a gzip file given by mistake
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(binary, env={})
    with pytest.raises(ConfigError, match="is not a regular file"):
        load_config(tmp_path, env={})   # a directory
    utf8 = tmp_path / "utf8.toml"
    utf8.write_text('[daemon]\nlog_level = "debug"  # é\n', encoding="utf-8")
    assert load_config(utf8, env={}).daemon.log_level == "debug"


# -- the typed tree ----------------------------------------------------------------------------
def test_enum_settings_are_enums_equal_to_their_text() -> None:
    from kvtier.config import Eviction, LogLevel

    cfg = load_config(env={"KVTIER_POLICY_EVICTION": "lfu", "KVTIER_DAEMON_LOG_LEVEL": "DEBUG",
                           "KVTIER_REDIS_CODEC": "shuffle-lz4"})
    assert cfg.policy.eviction is Eviction.LFU and cfg.policy.eviction == "lfu"
    assert f"{cfg.policy.eviction}" == "lfu" and str(cfg.redis.codec) == "shuffle-lz4"
    assert cfg.daemon.log_level is LogLevel.DEBUG
    assert cfg.to_dict()["policy"]["eviction"] == "lfu"
    assert type(cfg.to_dict()["cpu"]["bytes"]) is int


def test_enum_errors_list_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"redis\.codec: .*one of none, lz4, shuffle-lz4, "
                                          r"shuffle-zstd, auto.*env KVTIER_REDIS_CODEC"):
        load_config(env={"KVTIER_REDIS_CODEC": "gzip"})


def test_size_parsing_is_chosen_by_type_not_by_name() -> None:
    from kvtier.config_convert import iter_settings
    from kvtier.units import ByteSize

    sizes = {s.dotted for s in iter_settings(Config) if s.base is ByteSize}
    assert {"cpu.bytes", "nvme.bytes", "daemon.max_frame_bytes",
            "nvme.write_budget_bytes_per_s"} <= sizes
    for s in iter_settings(Config):
        if s.dotted in sizes:
            continue
        assert not s.name.endswith("bytes"), s.dotted   # every *bytes field is a ByteSize


def test_toml_values_are_typed_and_text_values_read_as_people_write_them(
        tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[redis]\nttl_s = 60\nenabled = true\n[cpu]\nbytes = 33554432\n")
    cfg = load_config(path, env={"KVTIER_NVME_DIRECT": "OFF"})
    assert cfg.redis.ttl_s == 60 and cfg.redis.enabled is True
    assert cfg.cpu.bytes == 32 * MiB and cfg.nvme.direct == "off"


@pytest.mark.parametrize("env", [
    {"KVTIER_DAEMON_LISTEN_BACKLOG": "2147483648"},   # once an OverflowError at listen()
    {"KVTIER_DAEMON_MAX_CONNECTIONS": str(2**63)},
    {"KVTIER_DAEMON_MAX_FRAME_BYTES": "1e18"},
    {"KVTIER_DAEMON_LEASE_SWEEP_S": "1e-300"},        # once an idle daemon spinning
    {"KVTIER_NVME_IO_THREADS": "100000000"},
])
def test_absurd_limits_are_one_config_error(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=next(iter(env)).split("_", 2)[2].lower()):
        load_config(env=env)


def test_to_dict_masks_the_admin_token_and_the_credentials_in_the_redis_url() -> None:
    out = load_config(env={"KVTIER_REDIS_URL": "redis://default:hunter2@10.0.0.5:6379/0",
                           "KVTIER_HTTP_ADMIN_TOKEN": "tok"}).to_dict()
    assert out["redis"]["url"] == "redis://***@10.0.0.5:6379/0"
    assert out["http"]["admin_token"] == "***"
    plain = load_config(env={"KVTIER_REDIS_URL": "redis://10.0.0.5:6379/0"}).to_dict()
    assert plain["redis"]["url"] == "redis://10.0.0.5:6379/0" and plain["http"]["admin_token"] == ""


def test_the_default_data_dir_takes_an_absolute_xdg_data_home_only(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvtier.config import default_data_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_DATA_HOME", "/srv/data")
    assert default_data_dir() == Path("/srv/data/kvtier")
    monkeypatch.setenv("XDG_DATA_HOME", "rel/data")     # relative: ignored (XDG spec)
    assert default_data_dir() == tmp_path / ".local" / "share" / "kvtier"


def test_no_home_and_no_data_dir_is_one_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's arbitrary uid with HOME unset: a traceback (Path.home's RuntimeError)
    ended ``kvtier serve`` before."""
    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with pytest.raises(ConfigError, match="set KVTIER_DATA_DIR=PATH"):
        load_config(env={})
    assert load_config(env={"KVTIER_DATA_DIR": "/srv/kvtier"}).daemon.data_dir == Path(
        "/srv/kvtier")


@pytest.mark.parametrize(("env", "needle"), [
    ({"KVTIER_DAEMON_LEASE_TTL_S": "0"}, "daemon.lease_ttl_s must be at least 0.1 seconds"),
    ({"KVTIER_DAEMON_LEASE_TTL_S": "0.01"}, "LeaseExpired"),
    ({"KVTIER_DAEMON_MAX_FRAME_BYTES": "1"}, "daemon.max_frame_bytes must be at least 65536"),
    ({"KVTIER_DAEMON_MAX_FRAME_BYTES": "4KiB"}, "ProtocolError"),
    ({"KVTIER_DAEMON_READ_TIMEOUT_S": "0.000001"},
     "daemon.read_timeout_s must be at least 0.1 seconds"),
    ({"KVTIER_DAEMON_IDLE_TIMEOUT_S": "0.001"}, "daemon.idle_timeout_s must be at least 0.1 "
                                                "seconds or 0 (never)"),
    ({"KVTIER_DAEMON_GC_FULL_S": "0.001"}, "daemon.gc_full_s must be at least 1 seconds or 0"),
    ({"KVTIER_REDIS_CONNECT_TIMEOUT_S": "0"}, "redis.connect_timeout_s must be at least"),
    ({"KVTIER_REDIS_OP_TIMEOUT_S": "0"}, "redis.op_timeout_s must be at least"),
    ({"KVTIER_CPU_BYTES": "4095"}, "cpu.bytes must be at least 4096"),
    ({"KVTIER_NVME_IO_THREADS": "0"}, "nvme.io_threads: invalid value '0'"),
])
def test_settings_that_would_serve_nothing_are_refused(env: dict[str, str],
                                                       needle: str) -> None:
    """A daemon started with them served nothing: every lease expired, every client got a
    ProtocolError or was dropped in its hello, a 4095-byte cpu tier was 'smaller than one
    slab' without naming cpu.bytes, io_threads 0 blamed nvme.bytes too."""
    with pytest.raises(ConfigError, match=re.escape(needle)) as info:
        load_config(env=env)
    assert "nvme.bytes" not in str(info.value)


def test_the_floors_leave_working_values_alone() -> None:
    cfg = load_config(env={"KVTIER_DAEMON_LEASE_TTL_S": "0.2", "KVTIER_DAEMON_IDLE_TIMEOUT_S": "0",
                           "KVTIER_DAEMON_GC_FULL_S": "0", "KVTIER_DAEMON_MAX_FRAME_BYTES": "64KiB",
                           "KVTIER_CPU_BYTES": "4096"})
    assert cfg.daemon.max_frame_bytes == 65536 and cfg.cpu.slab_bytes == 4096


@pytest.mark.parametrize("value", ["1.5", " 0.5 ", "1.5B", 1.5, "2.7e0"])
def test_a_fraction_of_a_byte_is_not_a_size(tmp_path: Path, value: object) -> None:
    """'1.5' parsed as 1 byte (max_frame_bytes = "1.5" started a daemon that refused every
    frame); with a unit a fraction is fine (1.5GiB)."""
    with pytest.raises(ConfigError, match="fraction of a byte"):
        parse_size(value)
    toml = write_toml(tmp_path, f"[daemon]\nmax_frame_bytes = {json.dumps(value)}\n")
    with pytest.raises(ConfigError, match=r"daemon\.max_frame_bytes: invalid value"):
        load_config(toml, env={})
    assert parse_size("1.5GiB") == 3 * 2**29 and parse_size("1.5e3") == 1500


@pytest.mark.parametrize(("host", "url"), [
    ("127.0.0.1", "http://127.0.0.1:8470"), ("::1", "http://[::1]:8470"),
    ("fe80::1%eth0", "http://[fe80::1%eth0]:8470"), ("[::1]", "http://[::1]:8470"),
    ("localhost", "http://localhost:8470"),
])
def test_http_urls_bracket_ipv6_literals(host: str, url: str) -> None:
    """http.host = "::1" gave http://::1:8470, which stats, explain and doctor --env could
    not parse ("Port could not be cast")."""
    from kvtier.config import http_base_url

    assert http_base_url(host, 8470) == url


# -- hostile values (found by review) -------------------------------------------------------
def test_a_config_nested_too_deeply_is_one_config_error(tmp_path: Path) -> None:
    """2000 nested arrays in 4 KB ended every command in a RecursionError traceback."""
    path = write_toml(tmp_path, "[daemon]\na = " + "[" * 2000 + "]" * 2000 + "\n")
    with pytest.raises(ConfigError, match="nests arrays or tables too deeply"):
        load_config(path, env={})


def test_a_long_bad_value_is_named_briefly(tmp_path: Path) -> None:
    """A 900 KB bad string made a 1.8 MB "one-line" error."""
    big = "x" * 900_000
    for load in (lambda: load_config(write_toml(tmp_path, f'[cpu]\nbytes = "{big}"\n'), env={}),
                 lambda: load_config(env={"KVTIER_DAEMON_LEASE_TTL_S": big})):
        with pytest.raises(ConfigError) as err:
            load()
        assert len(str(err.value)) < 600 and "..." in str(err.value)


@pytest.mark.parametrize(("env", "setting"), [
    ({"KVTIER_REDIS_TTL_S": str(10**16)}, "redis.ttl_s"),
    ({"KVTIER_REDIS_MAX_CONNECTIONS": str(2**64)}, "redis.max_connections"),
    ({"KVTIER_DAEMON_MAX_CONTEXT_TOKENS": str(2**40)}, "daemon.max_context_tokens"),
])
def test_counts_are_bounded(env: dict[str, str], setting: str) -> None:
    """A redis.ttl_s of 1e16 started, then Redis refused every write (invalid expire)."""
    with pytest.raises(ConfigError, match=re.escape(setting)):
        load_config(env=env)


@pytest.mark.parametrize("token", [" s3cret", "s3cret ", "s3cret\n"])
def test_an_admin_token_with_surrounding_whitespace_is_refused(token: str) -> None:
    """It could never match: a request's token is read stripped."""
    with pytest.raises(ConfigError, match=r"http\.admin_token starts or ends with whitespace"):
        load_config(env={"KVTIER_HTTP_ADMIN_TOKEN": token})
    assert load_config(env={"KVTIER_HTTP_ADMIN_TOKEN": "s3cret"}).http.admin_token == "s3cret"
