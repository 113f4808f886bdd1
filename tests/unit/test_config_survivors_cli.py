"""Mutation-review pins for ``kvtier serve``'s start (kvtier.cli, in-process): what reaches
the daemon from each source, what is checked before it runs, and how a refused start is
reported (one line, exit 2, the traceback only with --debug). ``run_daemon`` is replaced,
so no daemon runs and nothing binds."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from kvtier import cli
from kvtier.config import Config
from kvtier.daemon import service
from kvtier.errors import ConfigError


def fake_daemon(monkeypatch: pytest.MonkeyPatch, seen: list[Config],
                fail: BaseException | None = None) -> None:
    """``run_daemon`` recording the config it was given (and raising ``fail``)."""
    async def run_daemon(cfg: Config, parts: object = None) -> None:
        seen.append(cfg)
        if fail is not None:
            raise fail

    monkeypatch.setattr(service, "run_daemon", run_daemon)


def kvtier(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No KVTIER_* from the outer environment; a data dir and socket under ``tmp_path``."""
    for key in list(os.environ):
        if key.startswith("KVTIER_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("KVTIER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KVTIER_SOCKET", str(tmp_path / "s.sock"))
    return tmp_path


def test_serve_passes_flag_env_and_file_by_precedence(
        clean_env: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The daemon gets flag > env > file > default, the false flag included."""
    path = clean_env / "k.toml"
    path.write_text('[cpu]\nbytes = "1GiB"\nprefault = true\n[http]\nport = 9001\n'
                    "[daemon]\nlease_ttl_s = 11\n")
    monkeypatch.setenv("KVTIER_CPU_BYTES", "3GiB")
    monkeypatch.setenv("KVTIER_HTTP_PORT", "9002")
    seen: list[Config] = []
    fake_daemon(monkeypatch, seen)
    code, err = kvtier(capsys, "serve", "--config", str(path), "--http-port", "9003",
                       "--no-cpu-prefault")
    assert code == 0, err
    (cfg,) = seen
    assert (cfg.http.port, cfg.cpu.bytes, cfg.cpu.prefault) == (9003, 3 * 2**30, False)
    assert cfg.daemon.lease_ttl_s == 11 and cfg.nvme.bytes == Config().nvme.bytes


def test_serve_checks_the_tls_files_before_the_daemon_runs(
        clean_env: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A missing CA bundle is one line naming redis.tls_ca, and the daemon never runs (the
    SSL library would say only "No such file or directory", mid-start)."""
    seen: list[Config] = []
    fake_daemon(monkeypatch, seen)
    code, err = kvtier(capsys, "serve", "--redis-url", "rediss://h:1/0",
                       "--redis-tls-ca", str(clean_env / "no-ca.pem"))
    assert code == 2 and not seen
    assert err.strip().startswith(f"kvtier: redis.tls_ca {clean_env / 'no-ca.pem'}: ")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_serve_sets_the_configured_log_level(
        clean_env: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--log-level debug`` must reach logging (a fixed INFO hides what was asked for)."""
    levels: list[object] = []
    monkeypatch.setattr(cli.logging, "basicConfig",
                        lambda **kw: levels.append(kw.get("level")))
    fake_daemon(monkeypatch, [])
    assert kvtier(capsys, "serve", "--log-level", "DEBUG")[0] == 0
    monkeypatch.setenv("KVTIER_DAEMON_LOG_LEVEL", "error")
    assert kvtier(capsys, "serve")[0] == 0
    assert levels == [logging.DEBUG, logging.ERROR]


def test_an_os_error_at_start_is_one_line_naming_the_path(
        clean_env: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An OSError no check foresaw is still one ``kvtier: cannot start: PATH: ...`` line,
    exit 2, with the traceback only under --debug."""
    gone = OSError(errno.ENOENT, os.strerror(errno.ENOENT), "/var/lib/kvtier/x")
    fake_daemon(monkeypatch, [], fail=gone)
    code, err = kvtier(capsys, "serve")
    assert code == 2 and "Traceback" not in err
    assert err.strip() == ("kvtier: cannot start: /var/lib/kvtier/x: No such file or "
                           "directory; check that path (owner, permissions, free space, file "
                           "system) (run with --debug for a traceback)")
    code, err = kvtier(capsys, "serve", "--debug")
    assert code == 2 and "Traceback" in err and err.rstrip().endswith("for a traceback)")


def test_a_config_error_is_exit_2_without_a_traceback(
        clean_env: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[Config] = []
    fake_daemon(monkeypatch, seen)
    code, err = kvtier(capsys, "serve", "--cpu-bytes", "2PiB")
    assert code == 2 and not seen
    assert err.startswith("kvtier: cpu.bytes: invalid value '2PiB'") and "Traceback" not in err
    fake_daemon(monkeypatch, seen, fail=ConfigError("hbm.enabled needs hbm.bytes > 0"))
    code, err = kvtier(capsys, "serve")
    assert (code, err) == (2, "kvtier: hbm.enabled needs hbm.bytes > 0\n")


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvtier`` alone is a usage mistake: the help on stdout, and a failing status for
    scripts."""
    assert cli.main([]) == 2
    assert "serve" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "86401"])
def test_stats_watch_refuses_a_busy_or_endless_interval(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--watch 0`` would scrape the daemon in a busy loop: a usage error naming --watch."""
    code, err = kvtier(capsys, "stats", "--url", "http://127.0.0.1:9", "--watch", value)
    assert code == 2 and "--watch" in err and "Traceback" not in err
