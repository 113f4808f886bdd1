"""`kvtier doctor --env` as a command: a real 1 MiB tmpfs as /dev/shm, a real daemon with a
client that hashes keys with another scheme, and this machine as it is."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.keys import KEY_SCHEME
from kvtier.protocol import LENGTH, PROTOCOL_VERSION, pack, unpack_body
from tests.support.daemon import DaemonProcess


def doctor(*args: str) -> tuple[int, dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "doctor", "--env", "--json",
                          *args], capture_output=True, text=True, timeout=60)
    return out.returncode, json.loads(out.stdout)


def verdicts(doc: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["verdict"] for c in doc["checks"]}


@contextlib.contextmanager
def tiny_tmpfs(path: Path) -> Iterator[Path]:
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_a_1mib_shm_fails_the_shm_check(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "shm") as shm:
        cfg = tmp_path / "k.toml"
        cfg.write_text(f'[cpu]\nbytes = "64MiB"\nshm_dir = "{shm}"\n'
                       f'[daemon]\nsocket = "{tmp_path / "run" / "k.sock"}"\n'
                       f'[nvme]\nenabled = false\n')
        rc, doc = doctor("--config", str(cfg), "--no-daemon")
    assert rc == 1 and doc["status"] == "findings"
    shm_check = next(c for c in doc["checks"] if c["name"] == "shm size")
    assert shm_check["verdict"] == "fail" and "1.0 MiB total" in shm_check["detail"]
    assert verdicts(doc)["key scheme"] == "skip"


def hello(sock_path: Path, scheme: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(sock_path))
    s.sendall(pack({"op": "hello", "id": 1, "version": PROTOCOL_VERSION, "client": "test",
                    "key_scheme": scheme}))
    (n,) = LENGTH.unpack(s.recv(LENGTH.size, socket.MSG_WAITALL))
    reply = unpack_body(s.recv(n, socket.MSG_WAITALL), 1 << 20)
    assert reply["ok"] and reply["key_scheme"] == KEY_SCHEME   # the daemon's own, announced
    return s


def test_a_client_with_another_key_scheme_fails(daemon: DaemonProcess) -> None:
    good = hello(daemon.socket, KEY_SCHEME)
    try:
        rc, doc = doctor("--url", daemon.http_url, "--config", "/dev/null")
        assert verdicts(doc)["key scheme"] == "ok"
        bad = hello(daemon.socket, "sha256-chain/0")
        try:
            rc, doc = doctor("--url", daemon.http_url)
        finally:
            bad.close()
    finally:
        good.close()
    check = next(c for c in doc["checks"] if c["name"] == "key scheme")
    assert rc == 1 and check["verdict"] == "fail" and "sha256-chain/0" in check["detail"]


def test_this_machine() -> None:
    """Prints the verdicts (pytest -s) and checks the command's contract, not the host."""
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "doctor", "--env",
                          "--no-daemon"], capture_output=True, text=True, timeout=60)
    print(out.stdout)
    assert out.returncode in (0, 1), out.stderr
    assert "shm size" in out.stdout and "socket dir" in out.stdout
