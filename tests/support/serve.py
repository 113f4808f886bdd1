"""Run ``kvtier serve`` as a subprocess with full control of args, env and user.

``tests.support.daemon.DaemonProcess`` always passes ``--socket``; the trust and startup
tests also need the default socket path, another uid and failing starts.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

_CLEARED = ("KVTIER_SOCKET", "KVTIER_DAEMON_SOCKET", "XDG_RUNTIME_DIR", "KVTIER_TRUSTED_UIDS")


def serve_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without socket settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def small_args(root: Path) -> list[str]:
    """Flags for a small daemon under ``root`` (no nvme tier, free HTTP port, no socket)."""
    return ["--data-dir", str(root / "data"), "--http-port", "0", "--cpu-bytes", "16MiB",
            "--nvme-bytes", "0"]


def run_serve(args: Sequence[str], *, env: dict[str, str] | None = None,
              user: str | None = None, python: str = sys.executable,
              prefix: Sequence[str] = (), timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """``kvtier serve ARGS`` expected to exit by itself (a refused start)."""
    return subprocess.run([*prefix, python, "-m", "kvtier.cli", "serve", *args],
                          env=serve_env() if env is None else env, user=user, cwd="/",
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(p: subprocess.CompletedProcess[str]) -> str:
    """The refusal: exit 2, no traceback, one ``kvtier: ...`` line besides log records."""
    assert p.returncode == 2, f"exit {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("ts=")]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("kvtier: "), p.stderr
    assert "policy:" not in p.stdout, p.stdout   # it never started serving
    return lines[0]


@contextlib.contextmanager
def serving(args: Sequence[str], *, env: dict[str, str] | None = None,
            user: str | None = None, python: str = sys.executable,
            timeout: float = 60) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A daemon started with ``args``; yields it with the socket path of its banner, and
    stops it (SIGTERM, then SIGKILL) afterwards."""
    log = tempfile.TemporaryFile(mode="w+")   # noqa: SIM115 - closed below
    proc = subprocess.Popen([python, "-m", "kvtier.cli", "serve", *args],
                            env=serve_env() if env is None else env, user=user, cwd="/",
                            stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()
        deadline = time.monotonic() + timeout
        banner: list[str] = []
        socket_path = ""
        while not banner or not banner[-1].strip().startswith("policy:"):
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if not line:
                log.seek(0)
                raise AssertionError(f"daemon did not start: {''.join(banner)}\n{log.read()}")
            banner.append(line)
            m = re.search(r"socket:\s+(\S+)", line)
            if m:
                socket_path = m.group(1)
        yield proc, socket_path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()


def _pump(proc: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    """Every stdout line into ``lines``, then "" at the end (the pipe never fills)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line)
    lines.put("")
