"""``kvtier stats --watch``: a failed scrape is one line with the time and the watch goes on
(a daemon restart ended it: exit 1 at the first failure). In-process, no subprocess: the
CLI's main runs in this thread and a SIGALRM raises KeyboardInterrupt in it, as Ctrl-C
does; the daemon is a port nobody listens on, then an http.server started on that port
serving a saved ``/v1/stats`` document."""

from __future__ import annotations

import http.server
import re
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvtier.cli import main

STATS = (Path(__file__).resolve().parents[1] / "fixtures" / "doctor" / "healthy"
         / "stats-0.json").read_bytes()
TABLE_HEAD = "kvtier 0.1.0 pid 41872"   # the first line render_stats makes of STATS


class _Daemon(http.server.BaseHTTPRequestHandler):
    """Answers ``GET /v1/stats`` with STATS, as the daemon's HTTP port does."""

    def do_GET(self) -> None:
        if self.path != "/v1/stats":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(STATS)))
        self.end_headers()
        self.wfile.write(STATS)

    def log_message(self, format: str, *args: object) -> None:
        pass


def _unused_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


@contextmanager
def _ctrl_c_after(seconds: float) -> Iterator[None]:
    old = signal.signal(signal.SIGALRM, signal.default_int_handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_watch_goes_on_after_a_failed_scrape_and_shows_the_daemon_back(
        capsys: pytest.CaptureFixture[str]) -> None:
    port = _unused_port()
    servers: list[http.server.ThreadingHTTPServer] = []

    def daemon_back() -> None:
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Daemon)
        servers.append(srv)
        threading.Thread(target=srv.serve_forever, daemon=True).start()

    starter = threading.Timer(0.5, daemon_back)
    starter.start()
    try:
        with _ctrl_c_after(3.0):
            code = main(["stats", "--url", f"http://127.0.0.1:{port}", "--watch", "0.2"])
    finally:
        starter.cancel()
        starter.join()
        for srv in servers:
            srv.shutdown()
            srv.server_close()
    out, err = capsys.readouterr()
    assert code == 130   # only Ctrl-C ended it
    failed = [line for line in err.splitlines() if line.strip()]
    assert len(failed) >= 2, err   # the scrapes before the daemon was back, each a line
    line = re.compile(rf"kvtier: \d\d:\d\d:\d\d no daemon answered at "
                      rf"http://127\.0\.0\.1:{port} \(.+\); next try in 0\.2s")
    assert all(line.fullmatch(f) for f in failed), failed
    assert servers and out.count(TABLE_HEAD) >= 2, out   # back, and refreshed


def test_without_watch_a_failed_scrape_still_ends_with_exit_1(
        capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{_unused_port()}"
    assert main(["stats", "--url", url]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"kvtier: no daemon answered at {url} (")
    assert len(err.strip().splitlines()) == 1
