"""Mutation-review pins for ``kvtier doctor --env``'s probes (host, file system, Redis,
daemon) where its earlier tests let a check report healthy on a failed or unknown probe."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

import pytest

from kvtier.config import NvmeBackend
from kvtier.doctor import env_host
from kvtier.doctor.env import Verdict
from tests.unit.test_doctor_env import config, host

ONE_NODE_MAPS = "7f00 bind:0 file=/dev/shm/kvtier-0-9-x.arena dirty=10 N0=300\n"


def test_huge_pages_not_visible_is_skipped_not_ok() -> None:
    """No /sys/kernel/mm/transparent_hugepage (a container): nothing was checked, so the
    check must not say OK."""
    c = env_host.check_thp(host(read_text=lambda p: None))
    assert c.verdict is Verdict.SKIP


def test_numa_with_a_bool_pid_is_unknown() -> None:
    """A daemon pid of true is no pid (bool is an int in Python): reading /proc/True's maps
    must not report the arena as placed."""
    h = host(listdir=lambda p: ["node0", "node1"], read_text=lambda p: ONE_NODE_MAPS)
    assert env_host.check_numa(h, {"daemon": {"pid": 42}}).verdict is Verdict.OK
    c = env_host.check_numa(h, {"daemon": {"pid": True}})
    assert c.verdict is Verdict.WARN and "unknown" in c.detail


def test_a_working_gpu_without_the_driver_version_file_still_checks_gds(
        tmp_path: Path) -> None:
    """A container with CUDA working but no /proc/driver/nvidia/version is a GPU host: the
    GDS check still runs, and fails when nvme.backend = kvikio cannot import kvikio (a SKIP
    hid that failure)."""
    cfg = config(tmp_path)
    cfg = dataclasses.replace(cfg, nvme=dataclasses.replace(cfg.nvme,
                                                            backend=NvmeBackend.KVIKIO))
    h = host(read_text=lambda p: None, gpu=lambda: (True, "1 CUDA device(s) visible"))
    gpu, gds = env_host.check_gpu(cfg, h)
    assert gpu.verdict is Verdict.OK and "driver version unknown" in gpu.detail
    assert gds.verdict is Verdict.FAIL and "kvtier[gpu]" in gds.fix



def test_a_truncated_mountinfo_line_is_skipped() -> None:
    """A line cut after its fs type (no source) is skipped, not an IndexError that takes
    the whole --env run down."""
    from kvtier.doctor import env_fs

    text = "22 1 0:21 / / rw - ext4\n30 22 0:26 / /dev/shm rw - tmpfs shm rw\n"
    assert [m.point for m in env_fs.parse_mountinfo(text)] == ["/dev/shm"]


class _FakeConn:
    """Stands in for kvtier.tiers.redis_wire.Conn: one scripted PING reply, and a record
    of each close."""

    closed: ClassVar[list[bool]] = []
    reply_to_ping: ClassVar[object] = "PONG"

    def __init__(self, addr: object, opts: object) -> None:
        self.reply = _FakeConn.reply_to_ping

    def simple_many(self, cmds: list[bytes]) -> list[object]:
        return [self.reply]

    def close(self) -> None:
        _FakeConn.closed.append(True)


def test_ping_closes_its_connection_on_every_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """doctor's PING closes the connection whether the server answers PONG or refuses
    (an unclosed socket per startup node per run leaks until exit)."""
    from kvtier.doctor import env_redis
    from kvtier.tiers import redis_wire
    from kvtier.tiers.redis_resp import ConnOptions, ErrorReply, NodeAddr

    monkeypatch.setattr(redis_wire, "Conn", _FakeConn)
    monkeypatch.setattr(_FakeConn, "closed", [])
    addr, opts = NodeAddr("127.0.0.1", 6379), ConnOptions(connect_timeout_s=1.0, op_timeout_s=1.0)
    env_redis.ping(addr, opts)
    monkeypatch.setattr(_FakeConn, "reply_to_ping", ErrorReply("NOPERM no"))
    with pytest.raises(env_redis.KVTierError, match="refused PING"):
        env_redis.ping(addr, opts)
    assert _FakeConn.closed == [True, True]


def test_a_unix_socket_this_user_may_not_open_is_not_called_a_password_problem() -> None:
    """EACCES on the socket file (a PermissionError with an errno) is the file's mode: the
    fix says to run doctor as the daemon's user, not to check the password."""
    import errno

    from kvtier.doctor import env_redis
    from kvtier.tiers.redis_resp import NodeAddr

    addr = NodeAddr("/run/redis/redis.sock", 0, unix=True)
    fix = env_redis._fix(PermissionError(errno.EACCES, "Permission denied"), addr, "x")
    assert "daemon's user" in fix and "password" not in fix
    auth = env_redis._fix(PermissionError("AUTH refused"), addr, "x")
    assert "password" in auth


def test_a_redis_setting_the_start_refuses_fails(tmp_path: Path) -> None:
    """A TLS CA file that does not exist is refused by the tier's own connection code:
    doctor fails it (a WARN let a preflight pass a node whose Redis tier never connects)."""
    from kvtier.doctor import env_redis
    from tests.unit.test_doctor_env_redis import cfg as redis_cfg

    c = env_redis.check_redis_server(
        redis_cfg(tmp_path, "rediss://127.0.0.1:6380/0",
                  **{"redis.tls_ca": str(tmp_path / "missing-ca.pem")}),
        host(redis_ping=lambda addr, opts: None))
    assert c.verdict is Verdict.FAIL


def test_a_failure_s_words_lose_terminal_escapes_and_a_bad_name_says_so(
        tmp_path: Path) -> None:
    """Whatever a failed connection's error echoes reaches the report without terminal
    escapes; a name that does not resolve is named as such in the fix."""
    import socket

    from kvtier.doctor import env_redis
    from tests.unit.test_doctor_env_redis import cfg as redis_cfg

    def refuse(addr: object, opts: object) -> None:
        raise OSError("bad reply \x1b[2J\x1b[31mowned")

    c = env_redis.check_redis_server(redis_cfg(tmp_path, "redis://127.0.0.1:6379/0"),
                                     host(redis_ping=refuse))
    assert c.verdict is Verdict.FAIL and "\x1b" not in c.detail and "owned" in c.detail

    def unknown(addr: object, opts: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    c = env_redis.check_redis_server(redis_cfg(tmp_path, "redis://no-such-host:6379/0"),
                                     host(redis_ping=unknown))
    assert c.verdict is Verdict.FAIL and "does not resolve" in c.fix


def test_saved_engine_scrapes_do_not_ask_a_live_daemon() -> None:
    """Saved engine files are diagnosed alone (a live daemon's stats would not match
    them); a live engine endpoint pairs with the daemon at the configured address."""
    import argparse

    from kvtier.doctor.cli import stats_source

    saved = argparse.Namespace(stats=None, url=None, engine_metrics=["e.prom"], config=None)
    assert stats_source(saved) == ((), False, "")
    live = argparse.Namespace(stats=None, url=None, engine_metrics=["http://h:8000/metrics"],
                              config=None)
    refs, explicit, _why = stats_source(live)
    assert len(refs) == 1 and refs[0].endswith("/v1/stats") and not explicit


def _env_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, verdict: Verdict,
             *argv: str) -> tuple[int, list[str | None]]:
    """``doctor --env`` with run_checks replaced by one check of ``verdict``; returns the
    exit status and the daemon URLs run_checks was given."""
    from kvtier.doctor import env
    from kvtier.doctor.cli import main
    from kvtier.doctor.env import Check

    urls: list[str | None] = []

    def fake(cfg: object, host: object = None, *, daemon_url: str | None = None
             ) -> list[Check]:
        urls.append(daemon_url)
        return [Check("x", verdict, "detail")]

    monkeypatch.setattr(env, "run_checks", fake)
    config(tmp_path)
    return main(["--env", "--json", "--config", str(tmp_path / "k.toml"), *argv]), urls


def test_env_no_daemon_and_strict_reach_the_checks(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    """--no-daemon asks no daemon; --strict makes a warning exit 1 (without it, 0)."""
    code, urls = _env_run(monkeypatch, tmp_path, Verdict.WARN, "--no-daemon")
    assert (code, urls) == (0, [None])
    code, urls = _env_run(monkeypatch, tmp_path, Verdict.WARN, "--strict")
    assert code == 1 and urls[0] is not None


def test_env_with_an_unreadable_config_is_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A config file the OS will not open (EACCES) is "could not read", exit 2, not a
    traceback."""
    import kvtier.config
    from kvtier.doctor.cli import main

    def denied(path: object = None, **kw: object) -> object:
        raise PermissionError(13, "Permission denied", "k.toml")

    monkeypatch.setattr(kvtier.config, "load_config", denied)
    assert main(["--env", "--no-daemon", "--config", "k.toml"]) == 2
    assert "could not read the configuration" in capsys.readouterr().err


def test_stats_named_on_the_command_line_are_explicit() -> None:
    """--stats and --url name the daemon on purpose: unreadable, they are an error, not a
    note that no daemon answered at the default address."""
    import argparse

    from kvtier.doctor.cli import stats_source

    by_url = argparse.Namespace(stats=None, url="http://h:8470", engine_metrics=None,
                                config=None)
    assert stats_source(by_url)[:2] == (("http://h:8470/v1/stats",), True)
    by_stats = argparse.Namespace(stats=["s.json"], url=None, engine_metrics=None,
                                  config=None)
    assert stats_source(by_stats)[:2] == (("s.json",), True)


def test_the_progress_sleeper_still_waits_for_a_short_interval() -> None:
    """A 50 ms interval is under one progress tick: the sleeper waits it anyway (else the
    two samples of a rate are taken back to back)."""
    import time

    from kvtier.doctor.cli import _sleeper

    start = time.monotonic()
    _sleeper(True)(0.05)
    assert time.monotonic() - start >= 0.05
