"""A real kvtier daemon as a subprocess, for integration tests.

Starts ``python -m kvtier.cli serve`` on a temp socket, data directory and a free HTTP
port, waits until it answers, and can SIGKILL, SIGTERM and restart it on the same data.
``crash()`` is a bare SIGKILL that leaves the arena and its journal in /dev/shm (what a
warm restart adopts); ``kill()`` also removes them (a crash followed by a cold start).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.tiers.arena import journal_path, stable_arena_name
from kvtier.tiers.journal_replay import read_journal
from tests.support.fake_hbm import POOL_PREFIX, pool_dir

SHM = Path("/dev/shm")


@dataclass
class DaemonProcess:
    root: Path
    cpu_bytes: str = "64MiB"
    nvme_bytes: str = "256MiB"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    program: tuple[str, ...] = ("-m", "kvtier.cli")   # what ``python`` runs (``serve`` follows)
    proc: subprocess.Popen[str] | None = None
    http_url: str = ""
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_path = self.root / "daemon.log"

    @property
    def socket(self) -> Path:
        return self.root / "kvtier.sock"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def start(self, timeout: float = 30.0) -> DaemonProcess:
        args = [sys.executable, *self.program, "serve", "--data-dir", str(self.data_dir),
                "--socket", str(self.socket), "--http-port", "0",
                "--cpu-bytes", self.cpu_bytes, "--nvme-bytes", self.nvme_bytes,
                *self.extra_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        log = open(self.log_path, "a")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True,
                                     env=env)
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        banner = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            banner.append(line)
            m = re.search(r"http:\s+(http://[0-9.]+:\d+)", line)
            if m:
                self.http_url = m.group(1)
            if line.strip().startswith("policy:"):
                return self
        self.kill()
        raise RuntimeError(f"daemon did not start: {''.join(banner)}\n{self.log()}")

    def __enter__(self) -> DaemonProcess:
        """Started; killed (its arena removed) when the block ends, however it ends."""
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.http_url + "/v1/stats", timeout=5) as r:
            return json.loads(r.read())

    @property
    def arena_path(self) -> Path:
        """The stable arena file of this data directory (see ``stable_arena_name``)."""
        return SHM / stable_arena_name(self.data_dir)

    def crash(self) -> None:
        """SIGKILL and nothing else: the arena and its journal stay for the next start."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL (as a crash would), then remove the arena (and journal) the dead daemon
        left in shm, so the next start is cold, any fake HBM pool it made, and the files
        it had half made (NAME.PID.HEX.tmp: a kill while the journal grew left 4 MiB in
        /dev/shm that no later start of that data directory would clear)."""
        self.crash()
        if self.proc is not None:
            for pool in pool_dir().glob(f"{POOL_PREFIX}{self.proc.pid}-*"):
                pool.unlink(missing_ok=True)
            for half in SHM.glob(f"kvtier-{os.getuid()}-*.{self.proc.pid}.*.tmp"):
                half.unlink(missing_ok=True)
            for arena in [*SHM.glob(f"kvtier-{os.getuid()}-{self.proc.pid}-*.arena"),
                          self.arena_path]:
                arena.unlink(missing_ok=True)
                Path(f"{arena}.presence").unlink(missing_ok=True)   # kvtier.presence
            journal_path(self.arena_path).unlink(missing_ok=True)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The daemon SIGSTOPped for the block and continued after it (also on failure):
        what a test sends meanwhile waits in the kernel, so the daemon's loop meets it all
        at once, however fast it would otherwise have answered each piece. The block
        starts once every thread of the daemon is stopped: SIGSTOP takes effect when the
        kernel next schedules each, and a daemon waiting for a CPU (a loaded machine)
        could otherwise still take the first of what is sent in a select of its own."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        try:
            self._wait_stopped()
            yield
        finally:
            self.proc.send_signal(signal.SIGCONT)

    def _wait_stopped(self, timeout: float = 5.0) -> None:
        """Until every thread of the daemon is in the stopped state (``T`` in its
        /proc stat)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for stat in Path(f"/proc/{self.proc.pid}/task").glob("*/stat"):
                try:
                    states.append(stat.read_text().rpartition(")")[2].split()[0])
                except (OSError, IndexError):   # a thread that just exited
                    continue
            if states and all(state == "T" for state in states):
                return
            assert time.monotonic() < deadline, f"the daemon did not stop: {states}"
            time.sleep(0.001)

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def wait_journal_commits(self, n: int, timeout: float = 10.0) -> None:
        """Until the arena's journal holds ``n`` commits (checksums are recorded off the
        event loop), so that a crash now leaves them for a warm restart to adopt."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = read_journal(journal_path(self.arena_path))
            if state is not None and len(state.committed) >= n:
                return
            time.sleep(0.02)
        raise AssertionError(f"the journal did not reach {n} commits")

    def restart(self) -> DaemonProcess:
        self.kill()
        return self.start()
