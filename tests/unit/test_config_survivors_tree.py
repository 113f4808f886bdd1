"""Mutation-review pins for the typed config tree (kvtier.config, kvtier.config_convert,
kvtier.config_checks): each field's own range, what the sources imply, the env layer's
order and typos, and which key an error names."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli import _serve_overrides, build_parser
from kvtier.config import default_runtime_dir, default_socket_path, load_config
from kvtier.errors import ConfigError


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    return path


def flags(*argv: str) -> dict[str, object]:
    return _serve_overrides(build_parser("serve").parse_args(["serve", *argv]))


# -- one field's own range (its annotation) ---------------------------------------------------
@pytest.mark.parametrize(("env", "dotted"), [
    ({"KVTIER_HTTP_PORT": "65536"}, "http.port"),
    ({"KVTIER_DAEMON_LEASE_TTL_S": "1e10"}, "daemon.lease_ttl_s"),
    ({"KVTIER_REDIS_OP_TIMEOUT_S": "2e9"}, "redis.op_timeout_s"),
    ({"KVTIER_DAEMON_CLIENT_PUT_SHARE": "1.5"}, "daemon.client_put_share"),
    ({"KVTIER_POLICY_SHADOW_SAMPLE_RATE": "2"}, "policy.shadow_sample_rate"),
    ({"KVTIER_POLICY_MODEL_PARAMS": "-1"}, "policy.model_params"),
    ({"KVTIER_POLICY_PREFETCH_TIMEOUT_MS_PER_BLOCK": "-0.5"},
     "policy.prefetch_timeout_ms_per_block"),
    ({"KVTIER_POLICY_MODEL_PARAMS": "inf"}, "policy.model_params"),
    ({"KVTIER_REDIS_TTL_S": str(2**31)}, "redis.ttl_s"),
    ({"KVTIER_NVME_IO_THREADS": "0"}, "nvme.io_threads"),
])
def test_out_of_range_values_are_refused_naming_the_setting(env: dict[str, str],
                                                            dotted: str) -> None:
    """A port past 65535, a share above 1, a negative or infinite count of parameters, a
    30-year timeout: each is one ConfigError naming the setting, not a daemon that starts
    and then fails (a port) or computes nonsense (a negative cost model)."""
    with pytest.raises(ConfigError, match=dotted.replace(".", r"\.")):
        load_config(env=env)


def test_range_edges_are_accepted() -> None:
    """The largest port, a share of exactly 1 and a timeout of 1e9 s are valid settings."""
    cfg = load_config(env={"KVTIER_HTTP_PORT": "65535", "KVTIER_DAEMON_CLIENT_PUT_SHARE": "1",
                           "KVTIER_DAEMON_LEASE_TTL_S": "1e9", "KVTIER_REDIS_TTL_S":
                           str(2**31 - 1), "KVTIER_POLICY_MODEL_PARAMS": "0"})
    assert cfg.http.port == 65535 and cfg.daemon.client_put_share == 1
    assert cfg.daemon.lease_ttl_s == 1e9 and cfg.redis.ttl_s == 2**31 - 1


def test_a_conversion_error_names_the_full_key_and_its_source(tmp_path: Path) -> None:
    """``bytes`` alone is in four sections: the message must say ``nvme.bytes`` and where
    the value came from (the file, the env variable or the flag)."""
    path = toml(tmp_path, '[nvme]\nbytes = "lots"\n')
    with pytest.raises(ConfigError, match=r"^nvme\.bytes: .*from .*kvtier\.toml"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match=r"^cpu\.bytes: .*from env KVTIER_CPU_BYTES"):
        load_config(env={"KVTIER_CPU_BYTES": "-1GiB"})
    with pytest.raises(ConfigError, match=r"^nvme\.bytes: .*from flag nvme\.bytes"):
        load_config(env={}, overrides=flags("--nvme-bytes", "1PiB"))


# -- the env layer ----------------------------------------------------------------------------
def test_a_misspelt_env_setting_of_a_known_section_is_refused() -> None:
    """``KVTIER_CPU_BYTEZ=64GiB`` silently ignored leaves the 2 GiB default in place; it
    must be a ConfigError naming the variable and listing the real settings."""
    with pytest.raises(ConfigError, match=r"env KVTIER_CPU_BYTEZ.*cpu\.bytez.*known: .*bytes"):
        load_config(env={"KVTIER_CPU_BYTEZ": "64GiB"})


def test_the_daemon_and_its_clients_pick_the_same_socket_from_both_names() -> None:
    """With both ``KVTIER_SOCKET`` and ``KVTIER_DAEMON_SOCKET`` set, the daemon must listen
    where the clients (``default_socket_path``) look: the short name wins in both."""
    env = {"KVTIER_SOCKET": "/tmp/short.sock", "KVTIER_DAEMON_SOCKET": "/tmp/long.sock"}
    assert load_config(env=env).daemon.socket == default_socket_path(env) == \
        Path("/tmp/short.sock")


@pytest.mark.parametrize(("text", "value"), [("on", True), ("YES", True), ("off", False),
                                             ("No", False), (" 1 ", True), ("0", False)])
def test_boolean_words_from_env(text: str, value: bool) -> None:
    """``on``/``off`` and ``yes``/``no`` are booleans, in any case and spacing."""
    assert load_config(env={"KVTIER_CPU_PREFAULT": text}).cpu.prefault is value


@pytest.mark.parametrize("text", ["ture", "enabled", "2", "-1"])
def test_an_unknown_boolean_word_is_refused_not_read_as_false(text: str) -> None:
    """A typo for ``true`` read as false turns a tier off without a word."""
    with pytest.raises(ConfigError, match=r"cpu\.prefault"):
        load_config(env={"KVTIER_CPU_PREFAULT": text})


@pytest.mark.parametrize("text", ["1.5", "64.9", "1e3"])
def test_a_fractional_count_is_refused_not_truncated(text: str) -> None:
    """``io_threads = 1.5`` read as 1 would be a silent change of what was written."""
    with pytest.raises(ConfigError, match=r"nvme\.io_threads"):
        load_config(env={"KVTIER_NVME_IO_THREADS": text})


def test_signed_integers_from_env() -> None:
    """``+8`` is eight; ``-3`` is refused by the range, naming the setting."""
    assert load_config(env={"KVTIER_NVME_IO_THREADS": "+8"}).nvme.io_threads == 8
    with pytest.raises(ConfigError, match=r"nvme\.io_threads: invalid value '-3'"):
        load_config(env={"KVTIER_NVME_IO_THREADS": "-3"})


def test_empty_env_for_an_optional_path_means_unset(tmp_path: Path) -> None:
    """``KVTIER_NVME_PATH=`` (exported empty by a unit file) falls back to the default,
    <data_dir>/nvme; an empty required path is refused as the current directory."""
    cfg = load_config(env={"KVTIER_NVME_PATH": "  ", "KVTIER_DATA_DIR": str(tmp_path)})
    assert cfg.nvme.path is None and cfg.nvme_path == tmp_path / "nvme"
    with pytest.raises(ConfigError, match=r"daemon\.data_dir.*must not be empty"):
        load_config(env={"KVTIER_DATA_DIR": " "})


def test_a_nul_in_a_path_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"daemon\.socket.*NUL"):
        load_config(env={"KVTIER_SOCKET": "/tmp/a\0b"})


def test_an_explicit_nvme_path_is_used(tmp_path: Path) -> None:
    """``nvme.path`` set puts the tier there, not under the data dir."""
    cfg = load_config(env={"KVTIER_NVME_PATH": str(tmp_path / "fast"),
                           "KVTIER_DATA_DIR": str(tmp_path / "data")})
    assert cfg.nvme_path == tmp_path / "fast"


# -- what the sources imply, by rank -----------------------------------------------------------
def test_an_empty_redis_url_does_not_enable_redis() -> None:
    """``KVTIER_REDIS_URL=`` (empty) names no server: it must not turn the tier on."""
    assert load_config(env={"KVTIER_REDIS_URL": ""}).redis.enabled is False


def test_a_file_url_enables_redis_when_nothing_says_enabled(tmp_path: Path) -> None:
    path = toml(tmp_path, '[redis]\nurl = "redis://10.0.0.5:6379/0"\n')
    assert load_config(path, env={}).redis.enabled is True


def test_enabled_set_as_high_as_the_url_wins(tmp_path: Path) -> None:
    """The same source saying ``enabled = false`` next to a URL keeps the tier off (a URL
    kept for later); a higher one's URL turns it back on."""
    path = toml(tmp_path, '[redis]\nenabled = false\nurl = "redis://h:6379/0"\n')
    assert load_config(path, env={}).redis.enabled is False
    env = {"KVTIER_REDIS_ENABLED": "0", "KVTIER_REDIS_URL": "redis://h:6379/0"}
    assert load_config(env=env).redis.enabled is False
    assert load_config(path, env={"KVTIER_REDIS_URL": "redis://h:6379/0"}).redis.enabled
    assert load_config(env=env, overrides=flags("--redis-url", "redis://h:6379/1")
                       ).redis.enabled is True
    assert load_config(env={"KVTIER_REDIS_URL": "redis://h:6379/0"},
                       overrides=flags("--no-redis-enabled")).redis.enabled is False


def test_zero_nvme_bytes_turns_the_tier_off_from_every_source(tmp_path: Path) -> None:
    path = toml(tmp_path, "[nvme]\nbytes = 0\n")
    assert load_config(path, env={}).nvme.enabled is False
    assert load_config(env={"KVTIER_NVME_BYTES": "0"}).nvme.enabled is False
    assert load_config(env={}, overrides=flags("--nvme-bytes", "0")).nvme.enabled is False
    # a higher source that sets a size again brings the tier back
    assert load_config(path, env={"KVTIER_NVME_BYTES": "1GiB"}).nvme.enabled is True
    # ... and ``enabled`` said by a higher source than the zero wins over the implication
    assert load_config(path, env={"KVTIER_NVME_ENABLED": "1"}).nvme.enabled is True


def test_a_false_flag_is_passed_on_not_dropped(tmp_path: Path) -> None:
    """``--no-cpu-prefault`` must beat ``prefault = true`` in the file and the env: a
    falsy flag value is a value, only None means "not given"."""
    path = toml(tmp_path, "[cpu]\nprefault = true\n[nvme]\nenabled = true\n")
    cfg = load_config(path, env={"KVTIER_CPU_PREFAULT": "yes"},
                      overrides=flags("--no-cpu-prefault", "--no-nvme-enabled"))
    assert cfg.cpu.prefault is False and cfg.nvme.enabled is False


def test_flag_beats_env_beats_file_for_one_setting(tmp_path: Path) -> None:
    path = toml(tmp_path, '[daemon]\nlease_ttl_s = 11\n[cpu]\nbytes = "1GiB"\n')
    env = {"KVTIER_DAEMON_LEASE_TTL_S": "22", "KVTIER_CPU_BYTES": "3GiB"}
    assert load_config(path, env=env).daemon.lease_ttl_s == 22
    cfg = load_config(path, env=env, overrides=flags("--daemon-lease-ttl-s", "33"))
    assert cfg.daemon.lease_ttl_s == 33 and cfg.cpu.bytes == 3 * 2**30


def test_the_defaults_the_floor_messages_quote_are_the_real_defaults() -> None:
    """Each timing floor's message says "(default N)": a changed default (a 3 s lease TTL
    that expires under load) must either be caught here or change the message with it."""
    import re

    from kvtier.config import Config
    from kvtier.config_checks import _check_timings

    cfg = Config()
    _check_timings(cfg)                     # the defaults pass their own floors
    assert cfg.daemon.lease_sweep_s == 1.0  # docs/client-api.md: "default 1 s"
    for dotted in ("daemon.lease_ttl_s", "daemon.read_timeout_s", "daemon.idle_timeout_s",
                   "daemon.gc_full_s", "redis.connect_timeout_s", "redis.op_timeout_s"):
        section, name = dotted.split(".")
        low = Config()
        setattr(getattr(low, section), name, 0.001)
        with pytest.raises(ConfigError) as info:
            _check_timings(low)
        said = re.search(r"\(default ([0-9.]+)\)", str(info.value))
        assert said is not None and str(info.value).startswith(dotted)
        assert float(said.group(1)) == getattr(getattr(cfg, section), name), dotted


def test_a_password_with_an_at_sign_is_masked_whole() -> None:
    """``redis://u:p@ss@host`` : the authority ends at the last ``@``; splitting at the
    first would print ``ss@host`` (half the password) in ``kvtier doctor`` and the logs."""
    cfg = load_config(env={"KVTIER_REDIS_URL": "redis://u:p@ss@h.example:6379/0"})
    assert cfg.to_dict()["redis"]["url"] == "redis://***@h.example:6379/0"


# -- cross-field checks ------------------------------------------------------------------------
def test_a_disabled_nvme_tier_does_not_judge_its_size() -> None:
    """``nvme.enabled = false`` with a leftover small ``nvme.bytes`` is no tier at all: the
    floor applies only to a tier that will be built, so the start must not be refused."""
    cfg = load_config(env={"KVTIER_NVME_ENABLED": "0", "KVTIER_NVME_BYTES": "1000"})
    assert cfg.nvme.enabled is False
    with pytest.raises(ConfigError, match=r"^nvme\.bytes must be 0 .* got 1000"):
        load_config(env={"KVTIER_NVME_BYTES": "1000"})


@pytest.mark.parametrize(("value", "ok"), [("0.009", False), ("0.001", False), ("0", False),
                                           ("0.01", True), ("5", True)])
def test_the_lease_sweep_floor(value: str, ok: bool) -> None:
    """Below 10 ms between sweeps an idle daemon spins a core; 10 ms itself is allowed."""
    env = {"KVTIER_DAEMON_LEASE_SWEEP_S": value}
    if ok:
        assert load_config(env=env).daemon.lease_sweep_s == float(value)
    else:
        with pytest.raises(ConfigError, match=r"^daemon\.lease_sweep_s must be >= 0\.01"):
            load_config(env=env)


# -- TOML values --------------------------------------------------------------------------------
def test_toml_zero_and_one_are_booleans(tmp_path: Path) -> None:
    """``prefault = 0`` is how many people write false; it must not be a type error."""
    path = toml(tmp_path, "[cpu]\nprefault = 0\nwarm_restart = 1\n")
    cfg = load_config(path, env={})
    assert cfg.cpu.prefault is False and cfg.cpu.warm_restart is True


def test_toml_numbers_for_text_settings_are_their_text(tmp_path: Path) -> None:
    """An unquoted numeric password or token is the text it spells, not a type error."""
    path = toml(tmp_path, "[redis]\npassword = 12345\n[http]\nadmin_token = 987\n")
    cfg = load_config(path, env={})
    assert cfg.redis.password == "12345" and cfg.http.admin_token == "987"


def test_a_config_file_over_the_limit_is_refused(tmp_path: Path) -> None:
    """A log or a device given as --config must be refused without reading it whole."""
    from kvtier.config_convert import MAX_CONFIG_BYTES

    big = tmp_path / "big.toml"
    big.write_text("#" * (MAX_CONFIG_BYTES - 1) + "\n")
    load_config(big, env={})
    big.write_text("#" * MAX_CONFIG_BYTES + "\n")
    with pytest.raises(ConfigError, match=rf"larger than {MAX_CONFIG_BYTES} bytes"):
        load_config(big, env={})
    assert MAX_CONFIG_BYTES == 1 << 20


def test_a_zero_size_flag_outranks_enabled_in_the_env() -> None:
    """``--nvme-bytes 0`` on the command line turns the tier off even where the unit's
    environment says ``KVTIER_NVME_ENABLED=1``: the flag is the higher source."""
    cfg = load_config(env={"KVTIER_NVME_ENABLED": "1"}, overrides=flags("--nvme-bytes", "0"))
    assert cfg.nvme.enabled is False


def test_dev_null_as_config_means_defaults() -> None:
    """``--config /dev/null`` is the usual way to say "no file": not "not a regular file"."""
    assert load_config("/dev/null", env={}).cpu.bytes == 2 * 2**30


def test_empty_env_text_for_a_text_setting_is_the_empty_text() -> None:
    """``KVTIER_REDIS_PASSWORD=`` means no password: only an optional (path) setting reads
    empty text as unset; a text setting keeps it."""
    cfg = load_config(env={"KVTIER_REDIS_PASSWORD": "", "KVTIER_HTTP_ADMIN_TOKEN": "",
                           "KVTIER_REDIS_KEY_PREFIX": ""})
    assert (cfg.redis.password, cfg.http.admin_token, cfg.redis.key_prefix) == ("", "", "")


@pytest.mark.parametrize("name", ["KVTIER_SOCKET", "KVTIER_DAEMON_SOCKET"])
def test_a_socket_under_home_is_where_the_clients_look(name: str) -> None:
    """``KVTIER_SOCKET=~/kv.sock`` (a unit file's Environment=, docker -e: no shell to expand
    it): the daemon listens on /home/u/kv.sock, so the clients must look there too, not at a
    literal ``~`` directory relative to their working directory."""
    env = {name: "~/kv.sock"}
    assert default_socket_path(env) == load_config(env=env).daemon.socket
    assert default_socket_path(env).is_absolute()


def test_a_relative_xdg_runtime_dir_is_never_used(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative XDG_RUNTIME_DIR names a different directory in each working directory: a
    daemon and its clients started from different places would disagree on the socket, even
    when the one here is private and ours."""
    import os

    monkeypatch.chdir(tmp_path)
    (tmp_path / "xdg").mkdir(mode=0o700)
    uid = os.getuid()
    fallback = Path("/run/kvtier") if uid == 0 else Path(f"/tmp/kvtier-{uid}")
    assert default_runtime_dir({"XDG_RUNTIME_DIR": "xdg"}, uid) == fallback
    assert default_runtime_dir({"XDG_RUNTIME_DIR": str(tmp_path / "xdg")}, uid) == \
        tmp_path / "xdg" / "kvtier"
