"""Redis settings a start must refuse in one line (exit 2, no traceback), or report as
they are: a db in redis.url that is not one integer >= 0 (a ValueError traceback, or db 0
silently), a TLS file missing or not PEM (a line naming neither setting nor path), a
client key without its certificate (ignored), and a db the server does not have (reported
as an authentication failure). Real ``kvtier serve`` processes and a real redis-server."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import RedisServer
from tests.support.serve import one_line_error, run_serve, small_args


def _serve(root: Path, *extra: str) -> str:
    args = [*small_args(root), "--socket", str(root / "kvtier.sock"), *extra]
    return one_line_error(run_serve(args))


@pytest.mark.parametrize(("url", "shown"), [
    ("unix:///tmp/kvtier-no-such/redis.sock?db=abc", "'?db=abc'"),
    ("redis://127.0.0.1:1/-1", "'/-1'"),
    ("redis://127.0.0.1:1/7abc", "'/7abc'"),
    ("redis://127.0.0.1:1/1/2", "'/1/2'"),
])
def test_a_db_that_is_not_a_number_is_refused(tmp_path: Path, url: str, shown: str) -> None:
    line = _serve(tmp_path, "--redis-url", url)
    assert line.startswith(f"kvtier: redis.url '{url}': {shown} is not a database number")
    assert "integer >= 0" in line


def test_a_missing_tls_ca_names_the_setting_and_path(tmp_path: Path) -> None:
    line = _serve(tmp_path, "--redis-url", "rediss://127.0.0.1:1/0",
                  "--redis-tls-ca", "/nonexistent/ca.pem")
    assert line == ("kvtier: redis.tls_ca /nonexistent/ca.pem: No such file or directory; "
                    "give a PEM CA bundle")


def test_a_tls_ca_that_is_not_pem_names_the_setting_and_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("garbage\n")
    line = _serve(tmp_path, "--redis-url", "rediss://127.0.0.1:1/0", "--redis-tls-ca", str(bad))
    assert line.startswith(f"kvtier: redis.tls_ca {bad}: ") and "PEM CA bundle" in line
    assert "::" not in line


def test_a_tls_key_without_a_certificate_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "client.key"
    key.write_text("x")
    line = _serve(tmp_path, "--redis-url", "rediss://127.0.0.1:1/0", "--redis-tls-key", str(key))
    assert "redis.tls_key is set without redis.tls_cert" in line


def test_a_db_out_of_range_is_not_called_an_auth_failure(redis_server: RedisServer,
                                                          tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{redis_server.port}/99"
    d = DaemonProcess(tmp_path / "kvd", cpu_bytes="16MiB", nvme_bytes="0",
                      extra_args=["--redis-url", url]).start()
    try:
        deadline = time.monotonic() + 10
        while "db 99" not in d.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        d.terminate()
    log = d.log_path.read_text()
    assert "refused SELECT: db 99 out of range" in log, log
    assert "refused authentication" not in log
