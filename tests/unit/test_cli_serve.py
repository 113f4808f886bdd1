"""`kvtier serve` flags are generated from the config tree: one per field, today's short names
as aliases, and the flags land in the config with the highest precedence."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvtier.cli import SERVE_ALIASES, _serve_overrides, build_parser
from kvtier.config import Config, load_config
from kvtier.config_convert import iter_settings


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def overrides(*argv: str) -> dict[str, object]:
    return _serve_overrides(build_parser().parse_args(["serve", *argv]))


def test_every_setting_has_a_flag() -> None:
    flags = {opt for a in serve_parser()._actions for opt in a.option_strings}
    for s in iter_settings(Config):
        assert "--" + f"{s.section}-{s.name}".replace("_", "-") in flags, s.dotted
    for aliases in SERVE_ALIASES.values():
        assert set(aliases) <= flags


@pytest.mark.parametrize(("argv", "dotted", "value"), [
    (["--cpu-bytes", "4GiB"], "cpu.bytes", "4GiB"),
    (["--nvme-bytes", "8GiB"], "nvme.bytes", "8GiB"),
    (["--socket", "/tmp/s"], "daemon.socket", "/tmp/s"),
    (["--daemon-socket", "/tmp/s"], "daemon.socket", "/tmp/s"),
    (["--data-dir", "/d"], "daemon.data_dir", "/d"),
    (["--http-port", "0"], "http.port", "0"),
    (["--http-host", "0.0.0.0"], "http.host", "0.0.0.0"),
    (["--eviction", "lru"], "policy.eviction", "lru"),
    (["--policy-eviction", "lfu"], "policy.eviction", "lfu"),
    (["--nvme-direct", "off"], "nvme.direct", "off"),
    (["--nvme-path", "/n"], "nvme.path", "/n"),
    (["--redis-ttl", "60"], "redis.ttl_s", "60"),
    (["--redis-codec", "lz4"], "redis.codec", "lz4"),
    (["--redis-cluster"], "redis.cluster", True),
    (["--redis-write-through"], "redis.write_through", True),
    (["--no-cpu-prefault"], "cpu.prefault", False),
    (["--log-level", "DEBUG"], "daemon.log_level", "debug"),
])
def test_flags_and_their_aliases(argv: list[str], dotted: str, value: object) -> None:
    assert overrides(*argv)[dotted] == value


def test_unset_flags_leave_the_lower_layers_alone() -> None:
    o = overrides()
    assert set(o.values()) == {None}
    assert load_config(env={"KVTIER_HTTP_PORT": "9001"}, overrides=o).http.port == 9001


def test_redis_url_enables_redis_and_zero_nvme_bytes_disables_nvme() -> None:
    cfg = load_config(env={}, overrides=overrides("--redis-url", "redis://h:1/0",
                                                  "--nvme-bytes", "0"))
    assert cfg.redis.enabled is True and cfg.nvme.enabled is False
    cfg = load_config(env={}, overrides=overrides("--redis-url", "redis://h:1/0",
                                                  "--no-redis-enabled"))
    assert cfg.redis.enabled is False


def test_a_redis_url_in_the_file_or_the_environment_enables_redis_too(
        tmp_path: Path) -> None:
    """Only --redis-url used to: a URL in kvtier.toml or KVTIER_REDIS_URL left the tier off
    without a word (docs/pd-disaggregation.md gives the TOML form as the same thing)."""
    url = "redis+cluster://h1:7000"
    assert load_config(env={"KVTIER_REDIS_URL": url}).redis.enabled is True
    toml = tmp_path / "kvtier.toml"
    toml.write_text(f'[redis]\nurl = "{url}"\n[nvme]\nbytes = 0\n')
    cfg = load_config(toml, env={})
    assert cfg.redis.enabled is True and not cfg.nvme.enabled
    toml.write_text(f'[redis]\nurl = "{url}"\nenabled = false\n')
    assert load_config(toml, env={}).redis.enabled is False       # the same source says no
    # a later source's URL turns it on again, as the flag always did
    assert load_config(toml, env={"KVTIER_REDIS_URL": url}).redis.enabled is True
    assert load_config(toml, env={"KVTIER_REDIS_URL": url},
                       overrides={"redis.enabled": False}).redis.enabled is False


def test_what_a_lower_source_implied_does_not_outlive_a_higher_one(tmp_path: Path) -> None:
    """A file's ``nvme.bytes = 0`` turned nvme off; ``--nvme-bytes 100GiB`` (or the env)
    over it left it off, the bytes set and the tier disabled (found by review)."""
    toml = tmp_path / "kvtier.toml"
    toml.write_text("[nvme]\nbytes = 0\n")
    assert not load_config(toml, env={}).nvme.enabled
    for cfg in (load_config(toml, env={}, overrides=overrides("--nvme-bytes", "100GiB")),
                load_config(toml, env={"KVTIER_NVME_BYTES": "100GiB"})):
        assert cfg.nvme.enabled and cfg.nvme.bytes == 100 * 2**30
    toml.write_text("[nvme]\nbytes = 0\nenabled = true\n")   # said in the same source
    assert load_config(toml, env={}).nvme.enabled


def test_flag_values_go_through_the_same_conversion(tmp_path: Path) -> None:
    cfg = load_config(env={}, overrides=overrides("--cpu-bytes", "64MiB", "--http-port", "0",
                                                  "--eviction", "lru", "--data-dir",
                                                  str(tmp_path)))
    assert cfg.cpu.bytes == 64 * 2**20 and cfg.http.port == 0 and cfg.policy.eviction == "lru"
    assert cfg.daemon.data_dir == tmp_path


def test_enum_flags_refuse_other_values(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--eviction", "random"])
    assert "invalid choice" in capsys.readouterr().err


def test_a_command_builds_only_its_own_parser() -> None:
    """``kvtier serve`` (every daemon start) does not import plan, doctor, replay and
    explain; a pluggable command gets its own parser only, help and typos all of them."""
    def commands(command: str | None) -> list[str]:
        sub = next(a for a in build_parser(command)._actions
                   if isinstance(a, argparse._SubParsersAction))
        return list(sub.choices)

    every = ["serve", "stats", "plan", "doctor", "replay", "explain"]
    assert commands(None) == every and commands("bogus") == every
    assert commands("serve") == ["serve", "stats"]
    assert commands("doctor") == ["serve", "stats", "doctor"]
    args = build_parser("plan").parse_args(["plan", "--model", "llama-3-8b"])
    assert args.command == "plan" and callable(args.func)
