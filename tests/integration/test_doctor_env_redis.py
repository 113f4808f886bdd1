"""``kvtier doctor --env`` against a real redis-server, up and then down, and ``kvtier
doctor`` finding a real daemon where ``kvtier stats`` does (--url, --config,
KVTIER_HTTP_PORT). Found by review: doctor's pattern 10 sent operators to ``doctor --env``
to check the Redis server, which had no such check; and doctor read
http://127.0.0.1:8470/v1/stats whatever --url, --config or KVTIER_HTTP_PORT said."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import RedisServer, running_server

PASSWORD = "doctor-s3cret"


def kvtier(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True,
                          text=True, timeout=60, env={**clean, **(env or {})})


def env_check(config: Path) -> tuple[int, dict[str, Any], str]:
    out = kvtier("doctor", "--env", "--no-daemon", "--json", "--config", str(config))
    doc = json.loads(out.stdout)
    return out.returncode, next(c for c in doc["checks"] if c["name"] == "redis server"), \
        out.stdout + out.stderr


def redis_config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "kvtier.toml"
    path.write_text(f'[daemon]\ndata_dir = "{tmp_path / "data"}"\n'
                    f'socket = "{tmp_path / "run" / "kvtier.sock"}"\n'
                    f'[cpu]\nbytes = "16MiB"\n[nvme]\nenabled = false\n'
                    f'[redis]\nenabled = true\nurl = "{url}"\n')
    return path


def test_redis_server_up_then_down(tmp_path: Path) -> None:
    with running_server(tmp_path / "redis", password=PASSWORD) as server:
        url = f"redis://default:{PASSWORD}@127.0.0.1:{server.port}/0"
        rc, check, text = env_check(redis_config(tmp_path, url))
        assert check["verdict"] == "ok", check
        assert f"127.0.0.1:{server.port} answered PING" in check["detail"]
        assert PASSWORD not in text

        wrong = f"redis://default:not-{PASSWORD}@127.0.0.1:{server.port}/0"
        rc, check, text = env_check(redis_config(tmp_path, wrong))
        assert rc == 1 and check["verdict"] == "fail"
        assert "refused authentication" in check["detail"] and "WRONGPASS" in check["detail"]
        assert PASSWORD not in text

        no_password = f"redis://127.0.0.1:{server.port}/0"
        rc, check, _ = env_check(redis_config(tmp_path, no_password))
        assert rc == 1 and "NOAUTH" in check["detail"] and "password" in check["fix"]

        tls = f"rediss://default:{PASSWORD}@127.0.0.1:{server.port}/0"   # a plain port
        rc, check, _ = env_check(redis_config(tmp_path, tls))
        assert rc == 1 and check["verdict"] == "fail" and "rediss://" in check["fix"]
        port = server.port
    # stopped: nothing listens on the port any more; before a start (--no-daemon) that is
    # a warning (the daemon would start with the tier down and connect later)
    rc, check, text = env_check(redis_config(tmp_path, url))
    assert rc == 0 and check["verdict"] == "warn"
    assert f"127.0.0.1:{port}: Connection refused" in check["detail"]
    assert f"is redis-server running on 127.0.0.1:{port}?" in check["fix"]
    assert PASSWORD not in text


def test_the_human_table_shows_the_check(tmp_path: Path, redis_server: RedisServer) -> None:
    out = kvtier("doctor", "--env", "--no-daemon", "--config",
                 str(redis_config(tmp_path, redis_server.url)))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "redis server" in out.stdout and "answered PING" in out.stdout


def test_pattern_mode_finds_the_daemon_as_kvtier_stats_does(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "kvd", cpu_bytes="16MiB", nvme_bytes="0") as d:
        port = d.http_url.rsplit(":", 1)[1]
        config = tmp_path / "http.toml"
        config.write_text(f'[http]\nport = {port}\n')
        for args, env in ((["--url", d.http_url], None), (["--config", str(config)], None),
                          ([], {"KVTIER_HTTP_PORT": port})):
            out = kvtier("doctor", *args, "--interval", "1", "--json", env=env)
            assert out.returncode == 0, (args, env, out.stderr)
            assert json.loads(out.stdout)["sources"]["stats"] == [
                f"{d.http_url}/v1/stats"] * 2
            shown = kvtier("stats", *args, env=env)   # the same daemon, the same way
            assert shown.returncode == 0, shown.stderr
    out = kvtier("doctor", "--url", d.http_url, "--samples", "1")   # stopped
    assert out.returncode == 2 and "its address was given with --url" in out.stderr
