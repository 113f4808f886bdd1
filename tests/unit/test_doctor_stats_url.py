"""Where ``kvtier doctor`` reads kvtier's stats: the daemon ``kvtier stats`` and ``kvtier
explain`` ask (kvtier.config.daemon_url): ``--url``, else the HTTP address of ``--config``
and the environment (``KVTIER_HTTP_PORT``), else 127.0.0.1:8470; ``--stats`` names the
endpoint or files itself. Found by review: doctor read http://127.0.0.1:8470/v1/stats
whatever ``--url``, ``--config`` or ``KVTIER_HTTP_PORT`` said, and its error named no flag.

A real HTTP server in a thread serves saved stats (no process is started).
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.config import daemon_url
from kvtier.doctor import add_parser
from tests.support.cli import run_subcommand

STATS = (Path(__file__).resolve().parents[1] / "fixtures" / "doctor" / "preemption"
         / "stats-1.json").read_bytes()


@pytest.fixture(autouse=True)
def _no_http_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVTIER_HTTP_HOST", "KVTIER_HTTP_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def daemon_http() -> Iterator[str]:
    """A base URL whose /v1/stats answers a daemon's saved stats."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/v1/stats":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(STATS)))
            self.end_headers()
            self.wfile.write(STATS)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def doctor(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_subcommand(capsys, add_parser, "doctor", "--samples", "1", *argv)


def read_from(out: str) -> list[str]:
    return list(json.loads(out)["sources"]["stats"])


def port_config(tmp_path: Path, port: int) -> str:
    path = tmp_path / "kvtier.toml"
    path.write_text(f'[http]\nhost = "127.0.0.1"\nport = {port}\n')
    return str(path)


def test_url_is_read(capsys: pytest.CaptureFixture[str], daemon_http: str) -> None:
    code, out, err = doctor(capsys, "--url", daemon_http, "--interval", "1", "--json")
    assert code in (0, 1), err
    assert read_from(out) == [f"{daemon_http}/v1/stats"]


def test_config_file_gives_the_address(capsys: pytest.CaptureFixture[str],
                                       daemon_http: str, tmp_path: Path) -> None:
    port = int(daemon_http.rsplit(":", 1)[1])
    code, out, err = doctor(capsys, "--config", port_config(tmp_path, port), "--json")
    assert code in (0, 1), err
    assert read_from(out) == [f"{daemon_http}/v1/stats"]


def test_environment_gives_the_port(capsys: pytest.CaptureFixture[str], daemon_http: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_HTTP_PORT", daemon_http.rsplit(":", 1)[1])
    code, out, err = doctor(capsys, "--json")
    assert code in (0, 1), err
    assert read_from(out) == [f"{daemon_http}/v1/stats"]


def test_url_wins_over_the_config_as_in_kvtier_stats(tmp_path: Path, daemon_http: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    config = port_config(tmp_path, closed_port())
    assert daemon_url(daemon_http, config) == daemon_http
    assert daemon_url(None, config).startswith("http://127.0.0.1:")
    monkeypatch.setenv("KVTIER_HTTP_PORT", "19470")
    assert daemon_url() == "http://127.0.0.1:19470"
    monkeypatch.setenv("KVTIER_HTTP_HOST", "::1")
    assert daemon_url() == "http://[::1]:19470"


@pytest.mark.parametrize(("how", "named"), [
    ("url", "given with --url"),
    ("stats", "given with --stats"),
    ("config", "give the daemon's with --url"),
    ("env", "KVTIER_HTTP_PORT"),
])
def test_no_daemon_there_names_the_flag_that_set_the_address(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, how: str, named: str) -> None:
    port = closed_port()
    argv = {"url": ["--url", f"http://127.0.0.1:{port}"],
            "stats": ["--stats", f"http://127.0.0.1:{port}/v1/stats"],
            "config": ["--config", port_config(tmp_path, port)], "env": []}[how]
    if how == "env":
        monkeypatch.setenv("KVTIER_HTTP_PORT", str(port))
    code, out, err = doctor(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("kvtier doctor: could not read metrics: cannot read kvtier stats "
                          f"from http://127.0.0.1:{port}/v1/stats")
    assert named in err and "\n" not in err.rstrip("\n")
    if how in ("config", "env"):
        assert "--config FILE" in err and "KVTIER_HTTP_PORT" in err


def test_stats_and_url_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = doctor(capsys, "--url", "http://127.0.0.1:9", "--stats", "x.json")
    assert code == 2 and "not both" in err


def test_an_unreadable_config_is_exit_2(capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    code, out, err = doctor(capsys, "--config", str(tmp_path / "none.toml"))
    assert code == 2 and out == ""
    assert err.startswith("kvtier doctor: could not read the configuration:")
    code, out, _ = doctor(capsys, "--config", str(tmp_path / "none.toml"), "--json")
    assert code == 2 and json.loads(out)["status"] == "unreadable"
