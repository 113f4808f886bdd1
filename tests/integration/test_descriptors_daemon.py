"""A daemon started with a shell's open-file limit (soft 1024) serves its configured
connections: idle connections ran it out of descriptors before ``max_connections``
refused anything, new engines got an untyped "dropped during the hello" and HTTP was
reset (found by review). It raises its soft limit to fit them now."""

from __future__ import annotations

import resource
import socket
import urllib.request
from pathlib import Path

import pytest

from kvtier.client import connect
from kvtier.errors import Overloaded
from kvtier.protocol import LENGTH, pack, unpack_body
from tests.support.daemon import DaemonProcess

INF = resource.RLIM_INFINITY


def _soft_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open-file limit")


def _hello(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(path))
    s.sendall(pack({"id": 1, "op": "hello", "version": 1}))
    (n,) = LENGTH.unpack(s.recv(4, socket.MSG_WAITALL))
    assert unpack_body(s.recv(n, socket.MSG_WAITALL))["ok"]
    return s


def test_a_shell_s_open_file_limit_is_raised_to_fit_the_connections(daemon_factory) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != INF and hard < 4096:
        pytest.skip(f"the hard open-file limit {hard} leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))   # a shell's, inherited
    try:
        d: DaemonProcess = daemon_factory(
            extra_args=["--daemon-max-connections", "1100",
                        "--daemon-max-connections-per-client", "2000"]).start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert d.proc is not None and _soft_limit(d.proc.pid) >= 1100 + 256
    held = [_hello(d.socket) for _ in range(1100)]   # idle engines, at the limit
    try:
        with pytest.raises(Overloaded):   # the typed refusal, not a dropped hello
            connect(d.socket)
        with urllib.request.urlopen(d.http_url + "/healthz", timeout=10) as r:
            assert r.status == 200
    finally:
        for s in held:
            s.close()
    c = connect(d.socket)
    assert c.stats()["daemon"]["refused_connections"] >= 1
    c.close()
