"""The client commands (``stats``, ``explain``, ``doctor``) against an endpoint or a file
that misbehaves: one line on stderr and the command's error status, never a traceback, a
hang or an unbounded read (a tiny raw-socket server on 127.0.0.1, FIFOs in tmp_path)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier import cli, explain_cli, httpget, jsonin
from kvtier.cli import main
from kvtier.doctor import sources

Reply = Callable[[socket.socket], None]


def ok(body: bytes) -> Reply:
    """A well-formed 200 reply carrying ``body``."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    return lambda c: c.sendall(head + body)


def raw(data: bytes) -> Reply:
    return lambda c: c.sendall(data)


def drip(c: socket.socket) -> None:
    """Headers, then one byte of a long body every 0.2 s: no single read ever times out."""
    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    for _ in range(200):
        c.sendall(b" ")
        time.sleep(0.2)


def flood(c: socket.socket) -> None:
    """A body far over the cap, without a Content-Length to refuse it by."""
    c.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
    chunk = b" " * 65536
    for _ in range(4096):   # 256 MiB if nobody stops reading
        c.sendall(chunk)


@pytest.fixture
def serve() -> Iterator[Callable[[Reply], str]]:
    """``serve(reply)``: the base URL of a server answering every request with ``reply``."""
    servers: list[socket.socket] = []

    def start(reply: Reply) -> str:
        srv = socket.create_server(("127.0.0.1", 0))
        servers.append(srv)

        def handle(c: socket.socket) -> None:
            try:
                c.recv(65536)
                reply(c)
            except OSError:
                pass
            finally:
                c.close()

        def loop() -> None:
            while True:
                try:
                    c, _ = srv.accept()
                except OSError:
                    return
                threading.Thread(target=handle, args=(c,), daemon=True).start()

        threading.Thread(target=loop, daemon=True).start()
        return f"http://127.0.0.1:{srv.getsockname()[1]}"

    yield start
    for srv in servers:
        srv.close()


def kvtier(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``kvtier ARGV`` run in-process."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


BAD_HTTP = [
    pytest.param(raw(b"GARBAGE\r\n\r\n"), "bad status line", id="bad-status-line"),
    pytest.param(raw(b'HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{"a":'),
                 "ended early", id="short-body"),
    pytest.param(raw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
                 "ended early", id="bad-chunk"),
    pytest.param(ok(b'{"a": "\xff\xfe"}'), "not UTF-8", id="not-utf8"),
]


@pytest.mark.parametrize(("command", "code"), [("stats", 1), ("explain", 2)])
@pytest.mark.parametrize(("reply", "needle"), BAD_HTTP)
def test_a_client_command_says_in_one_line_what_is_wrong_with_the_reply(
        capsys: pytest.CaptureFixture[str], serve: Callable[[Reply], str], reply: Reply,
        needle: str, command: str, code: int) -> None:
    url = serve(reply)
    got, out, err = kvtier(capsys, command, "--url", url)
    assert got == code and out == ""
    line = one_line(err)
    assert url in line and needle in line, line


@pytest.mark.parametrize(("doc", "field"), [
    (b'{"daemon": {"uptime_s": "x"}}', "daemon.uptime_s"),
    (b'{"daemon": []}', "daemon is a list"),
    (b'{"tiers": {"cpu": 5}}', "tiers.cpu"),
    (b'{"tiers": {"cpu": {"capacity_bytes": "big"}}}', "tiers.cpu.capacity_bytes"),
    (b'{"tiers": {"cpu": {"evictions": [1]}}}', "tiers.cpu.evictions"),
    (b'{"daemon": {"uptime_s": 1' + b"0" * 400 + b"}}", "daemon.uptime_s"),
    (b'{"connector": {"engines": 1, "running": "two"}}', "connector.running"),
    (b'{"policy": {"tiers": {"cpu": {"mrc": [{"scale": 1}]}}}}', "hit_rate"),
])
def test_stats_refuses_a_reply_with_fields_of_the_wrong_type(
        capsys: pytest.CaptureFixture[str], serve: Callable[[Reply], str], doc: bytes,
        field: str) -> None:
    code, out, err = kvtier(capsys, "stats", "--url", serve(ok(doc)))
    assert code == 1 and out == ""
    line = one_line(err)
    assert "not kvtier stats" in line and field in line, line


def test_stats_json_prints_any_object_it_is_given(
        capsys: pytest.CaptureFixture[str], serve: Callable[[Reply], str]) -> None:
    code, out, _ = kvtier(capsys, "stats", "--json", "--url",
                          serve(ok(b'{"daemon": {"uptime_s": "x"}}')))
    assert code == 0 and '"uptime_s": "x"' in out


@pytest.mark.parametrize(("row", "needle"), [
    (b'{"at": 1.0}', "has no namespace"),
    (b'{"at": "x", "namespace": "ab", "reason": "none", "blocks": 1, "hits": {}}', "at is"),
    (b'{"at": 1.0, "namespace": "ab", "reason": "none", "blocks": 1, "hits": []}',
     "hits is"),
    (b'{"at": 1.0, "namespace": "ab", "reason": "evicted", "blocks": 1, '
     b'"hits": {"cpu": 0, "nvme": 0, "redis": 0}, "first_miss": 0, "removed": {"tier": '
     b'"cpu"}}', "removed has no age_s"),
])
def test_explain_refuses_a_lookup_row_it_cannot_show(
        capsys: pytest.CaptureFixture[str], serve: Callable[[Reply], str], row: bytes,
        needle: str) -> None:
    code, out, err = kvtier(capsys, "explain", "--url", serve(ok(b'{"lookups": [%s]}' % row)))
    assert code == 2 and out == ""
    line = one_line(err)
    assert "not kvtier's recent lookups" in line and needle in line, line


def test_explain_still_draws_a_well_formed_row(
        capsys: pytest.CaptureFixture[str], serve: Callable[[Reply], str]) -> None:
    row = (b'{"at": 1.0, "namespace": "abcdef0123", "model_id": "m", "reason": "evicted", '
           b'"blocks": 4, "hits": {"cpu": 1, "nvme": 0, "redis": 0}, "first_miss": 1, '
           b'"removed": {"tier": "cpu", "policy": "lru", "age_s": 2.5}, "hint": "grow it"}')
    code, out, err = kvtier(capsys, "explain", "--url", serve(ok(b'{"lookups": [%s]}' % row)))
    assert code == 0, err
    assert "block 1: evicted" in out and "left cpu (lru) 2.5s before; grow it" in out


def test_non_utf8_json_is_named_as_such() -> None:
    with pytest.raises(ValueError, match="not UTF-8 text"):
        jsonin.loads(b'{"a": "\xff\xfe"}')


def test_a_slow_drip_ends_at_the_deadline(serve: Callable[[Reply], str],
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    url = serve(drip)
    for module, name in ((cli, "STATS_DEADLINE_S"), (explain_cli, "FETCH_DEADLINE_S"),
                         (sources, "FETCH_TIMEOUT_S")):
        monkeypatch.setattr(module, name, 0.6)
    for argv, status in ((["stats", "--url", url], 1), (["explain", "--url", url], 2),
                         (["doctor", "--stats", url + "/v1/stats", "--samples", "1"], 2)):
        start = time.monotonic()
        code, _, err = kvtier(capsys, *argv)
        assert time.monotonic() - start < 5, argv
        assert code == status and "within 0.6 s" in one_line(err), err


def test_a_stalled_header_ends_at_the_deadline(serve: Callable[[Reply], str]) -> None:
    def headers_drip(c: socket.socket) -> None:
        for b in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100:
            c.sendall(bytes([b]))
            time.sleep(0.1)

    start = time.monotonic()
    with pytest.raises(httpget.FetchError, match=r"within 0\.5 s"):
        httpget.get(serve(headers_drip) + "/v1/stats", deadline_s=0.5)
    assert time.monotonic() - start < 3


def test_a_body_over_the_cap_is_refused_not_read_whole(
        serve: Callable[[Reply], str], capsys: pytest.CaptureFixture[str]) -> None:
    url = serve(raw(b"HTTP/1.1 200 OK\r\nContent-Length: 4000000000\r\n\r\n"))
    code, _, err = kvtier(capsys, "stats", "--url", url)
    assert code == 1 and "over the 67,108,864-byte cap" in one_line(err)
    with pytest.raises(httpget.FetchError, match="over the 1,048,576-byte cap"):
        httpget.get(serve(flood), max_bytes=1 << 20)


@pytest.mark.parametrize("flag", ["--stats", "--engine-metrics", "--gpu-metrics"])
def test_doctor_refuses_a_fifo_instead_of_waiting_on_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str) -> None:
    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    argv = [flag, str(fifo)]
    if flag == "--gpu-metrics":   # GPU metrics are read alongside the engine's
        argv += ["--engine-metrics", str(fifo)]
    code, out, err = kvtier(capsys, "doctor", *argv)
    assert code == 2 and out == ""
    line = one_line(err)
    assert str(fifo) in line and "not a regular file" in line, line


def test_doctor_refuses_an_endless_device(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = kvtier(capsys, "doctor", "--stats", "/dev/zero")
    assert code == 2 and "/dev/zero" in one_line(err) and "not a regular file" in err


def test_doctor_file_over_the_cap_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 2048)
    with pytest.raises(httpget.FetchError, match="larger than"):
        httpget.read_file(str(big), max_bytes=1024)


def test_doctor_env_refuses_a_fifo_config(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    fifo = tmp_path / "kvtier.toml"
    os.mkfifo(fifo)
    code, _, err = kvtier(capsys, "doctor", "--env", "--config", str(fifo), "--no-daemon")
    assert code == 2 and str(fifo) in one_line(err)


def test_doctor_env_treats_a_malformed_daemon_answer_as_no_answer(
        serve: Callable[[Reply], str]) -> None:
    from kvtier.config import load_config
    from kvtier.doctor.env import Verdict, run_checks

    url = serve(ok(b'{"daemon": []}'))
    checks = {c.name: c for c in run_checks(load_config(None), daemon_url=url)}
    key = checks["key scheme"]
    assert key.verdict is Verdict.SKIP and "no daemon answered" in key.detail
