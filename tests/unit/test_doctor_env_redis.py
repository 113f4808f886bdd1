"""``kvtier doctor --env``'s "redis server" check: it connects as the tier does (AUTH,
SELECT, TLS) and PINGs, and says why not with the fix. Found by review: doctor's pattern 10
sent operators to ``doctor --env`` to check the Redis server, which had no such check.

Scripted RESP peers on loopback sockets (threads, no process); a real redis-server up and
down is tests/integration/test_doctor_env_redis.py.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import Config, load_config
from kvtier.doctor import env_redis
from kvtier.doctor.env import Host, Verdict, run_checks
from kvtier.tiers.redis_resp import ConnOptions, NodeAddr
from tests.support.resp_peer import answering, peer

PASSWORD = "s3cret-pw"


def cfg(tmp_path: Path, url: str, **more: Any) -> Config:
    return load_config(None, env={}, overrides={
        "redis.enabled": True, "redis.url": url, "daemon.data_dir": str(tmp_path / "d"),
        "daemon.socket": str(tmp_path / "run" / "s.sock"), **more})


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server(seen: list[list[bytes]], ping: bytes = b"+PONG\r\n",
           auth: bytes = b"+OK\r\n") -> Callable[[socket.socket], None]:
    """A script answering AUTH, SELECT and PING as told, recording each command."""
    def answer(args: list[bytes]) -> bytes:
        seen.append(args)
        return {b"AUTH": auth, b"SELECT": b"+OK\r\n"}.get(args[0].upper(), ping)
    return answering(answer)


def check(c: Config) -> env_redis.Check:
    return env_redis.check_redis_server(c, Host())


def test_no_redis_tier_is_skipped(tmp_path: Path) -> None:
    c = load_config(None, env={}, overrides={"daemon.data_dir": str(tmp_path)})
    assert check(c).verdict is Verdict.SKIP


def test_a_server_that_answers_is_ok_after_auth_and_select(tmp_path: Path) -> None:
    seen: list[list[bytes]] = []
    with peer(tmp_path, server(seen), tcp=True, read_first=False) as addr:
        got = check(cfg(tmp_path, f"redis://kvtier:{PASSWORD}@{addr}/3"))
    assert got.verdict is Verdict.OK and f"{addr} answered PING" in got.detail
    assert seen == [[b"AUTH", b"kvtier", PASSWORD.encode()], [b"SELECT", b"3"], [b"PING"]]
    assert PASSWORD not in got.detail


@pytest.mark.parametrize(("reply", "detail", "fix"), [
    (b"-NOPERM this user has no permissions to run the 'ping' command\r\n", "NOPERM",
     "+ping"),
    (b"-NOAUTH Authentication required.\r\n", "NOAUTH", "redis.password"),
    (b"-LOADING Redis is loading the dataset in memory\r\n", "LOADING", "server's log"),
    (b"+HELLO\r\n", "not PONG", "a Redis server"),
])
def test_a_ping_refused_fails_with_the_fix(tmp_path: Path, reply: bytes, detail: str,
                                           fix: str) -> None:
    with peer(tmp_path, server([], ping=reply), tcp=True, read_first=False) as addr:
        got = check(cfg(tmp_path, f"redis://{addr}/0"))
    assert got.verdict is Verdict.FAIL and detail in got.detail and fix in got.fix


def test_wrong_credentials_fail_and_the_password_is_never_shown(tmp_path: Path) -> None:
    echo = b"-WRONGPASS invalid password " + PASSWORD.encode() + b"\r\n"  # a hostile echo
    with peer(tmp_path, server([], auth=echo), tcp=True, read_first=False) as addr:
        in_url = check(cfg(tmp_path, f"redis://kvtier:{PASSWORD}@{addr}/0"))
        in_field = check(cfg(tmp_path, f"redis://{addr}/0", **{"redis.password": PASSWORD}))
    for got in (in_url, in_field):
        assert got.verdict is Verdict.FAIL and "refused authentication" in got.detail
        assert "redis.username/redis.password" in got.fix
        assert PASSWORD not in got.detail + got.fix and "***" in got.detail


def test_nothing_listening_fails_naming_redis_server(tmp_path: Path) -> None:
    port = closed_port()
    got = check(cfg(tmp_path, f"redis://127.0.0.1:{port}/0"))
    assert got.verdict is Verdict.FAIL and "Connection refused" in got.detail
    assert f"is redis-server running on 127.0.0.1:{port}?" in got.fix
    sock = tmp_path / "none.sock"
    got = check(cfg(tmp_path, f"unix://{sock}"))
    assert got.verdict is Verdict.FAIL and "No such file" in got.detail
    assert "redis-server running" in got.fix


def test_before_the_start_a_server_not_up_yet_only_warns(tmp_path: Path) -> None:
    """``--no-daemon`` (a preflight, as an init container runs it): the daemon starts with
    its Redis tier down and connects later, so a server that does not answer yet must not
    hold kvtier back; settings that are wrong still fail."""
    port = closed_port()
    got = env_redis.check_redis_server(cfg(tmp_path, f"redis://127.0.0.1:{port}/0"), Host(),
                                       before_start=True)
    assert got.verdict is Verdict.WARN and "Connection refused" in got.detail
    assert "connects once the server answers" in got.detail
    seen: list[list[bytes]] = []
    wrong = server(seen, auth=b"-WRONGPASS invalid username-password pair\r\n")
    with peer(tmp_path, wrong, tcp=True, read_first=False) as addr:
        got = env_redis.check_redis_server(
            cfg(tmp_path, f"redis://default:{PASSWORD}@{addr}/0"), Host(), before_start=True)
    assert got.verdict is Verdict.FAIL and "refused authentication" in got.detail


def test_a_silent_server_fails_within_the_configs_timeout(tmp_path: Path) -> None:
    def silent(conn: socket.socket) -> None:   # a TLS port, a firewall's black hole
        while conn.recv(4096):   # reads, never answers, until the client hangs up
            pass

    with peer(tmp_path, silent, tcp=True, read_first=False) as addr:
        t0 = time.monotonic()
        got = check(cfg(tmp_path, f"redis://{addr}/0", **{"redis.op_timeout_s": 0.3}))
        took = time.monotonic() - t0
    assert got.verdict is Verdict.FAIL and "did not answer within 0.3 s" in got.detail
    assert "rediss://" in got.fix and took < 2


def test_waits_are_capped_whatever_the_config_says(tmp_path: Path) -> None:
    asked: list[ConnOptions] = []
    host = Host(redis_ping=lambda addr, opts: asked.append(opts))
    slow = cfg(tmp_path, "redis://10.0.0.5:6379/0",
               **{"redis.connect_timeout_s": 60, "redis.op_timeout_s": 600})
    assert env_redis.check_redis_server(slow, host).verdict is Verdict.OK
    assert (asked[0].connect_timeout_s, asked[0].op_timeout_s) == (env_redis.MAX_WAIT_S,) * 2
    asked.clear()
    fast = cfg(tmp_path, "redis://10.0.0.5:6379/0", **{"redis.connect_timeout_s": 0.5})
    env_redis.check_redis_server(fast, host)
    assert asked[0].connect_timeout_s == 0.5


def test_a_cluster_needs_one_startup_node(tmp_path: Path) -> None:
    dead = f"127.0.0.1:{closed_port()}"
    with peer(tmp_path, server([]), tcp=True, read_first=False) as addr:
        first = check(cfg(tmp_path, f"redis+cluster://{addr},{dead}"))
        later = check(cfg(tmp_path, f"redis+cluster://{dead},{addr}"))
    assert first.verdict is Verdict.OK and "startup node of the cluster" in first.detail
    assert later.verdict is Verdict.WARN and dead in later.detail and "redis.url" in later.fix
    both_dead = check(cfg(tmp_path, f"redis+cluster://{dead},{dead}"))
    assert both_dead.verdict is Verdict.FAIL


def test_the_check_runs_before_redis_auth(tmp_path: Path) -> None:
    pinged: list[NodeAddr] = []
    host = Host(gpu=lambda: (False, "no driver"), kvikio_mode=lambda: None,
                o_direct=lambda d: None, redis_ping=lambda addr, opts: pinged.append(addr))
    names = [c.name for c in run_checks(cfg(tmp_path, "redis://10.0.0.5:6379/0"), host)]
    assert names[-2:] == ["redis server", "redis auth"]
    assert pinged == [NodeAddr("10.0.0.5", 6379)]


ESCAPES = b"\x1b]0;PWNED\x07\x1b[2J\x1b[31mRED\x1b[1A\x1b[2K"


@pytest.mark.parametrize("where", ["ping", "auth"])
def test_a_servers_words_reach_the_terminal_without_escapes(tmp_path: Path,
                                                            where: str) -> None:
    """An error reply is the server's text: printed raw, its escape sequences set the
    window title, cleared the screen and overwrote earlier lines of the report (found by
    review)."""
    reply = b"-ERR " + ESCAPES + b"\r\n"
    script = server([], ping=reply) if where == "ping" else server([], auth=reply)
    with peer(tmp_path, script, tcp=True, read_first=False) as addr:
        got = check(cfg(tmp_path, f"redis://kvtier:{PASSWORD}@{addr}/0"))
    assert got.verdict is Verdict.FAIL and "PWNED" in got.detail
    assert all(c.isprintable() for c in got.detail + got.fix), got.detail


def test_auth_check_reads_a_cluster_url_of_several_startup_nodes(tmp_path: Path) -> None:
    """``redis+cluster://h1:p1,h2:p2/0`` without a password: the auth check read the port
    with urlsplit, which cannot, and doctor --env ended in a traceback (found by review)."""
    url = "redis+cluster://127.0.0.1:7001,127.0.0.1:7002/0"
    got = env_redis.check_redis_auth(cfg(tmp_path, url), Host())
    assert got.verdict is Verdict.WARN and "no password for" in got.detail
    assert "127.0.0.1:7001" in got.detail
