"""``kvtier doctor --env``: checks of the node that offload users trip on, each with a
verdict and a fix.

What peers' users lost days to: a /dev/shm smaller than the cpu tier, a data dir on
overlayfs or tmpfs or without O_DIRECT, a memlock limit that breaks pinned registration,
huge pages off, an arena spread over NUMA nodes, GDS silently in compat mode, a socket
directory others can write, engines hashing keys differently, a Redis server this host
cannot reach, and a Redis anyone can write to. The checks live in
:mod:`kvtier.doctor.env_fs`, :mod:`kvtier.doctor.env_host`, :mod:`kvtier.doctor.env_daemon`
and :mod:`kvtier.doctor.env_redis`; they read the system only through :class:`Host`, so a
test can hand them a crafted environment.

Exit status as the rest of doctor: 0 nothing failed, 1 a check failed (``--strict``: or
warned), 2 the configuration could not be read.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.config import Config

if TYPE_CHECKING:
    from kvtier.tiers.redis_resp import ConnOptions, NodeAddr


class Verdict(str, Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"      # does not apply here (no GPU, no daemon to ask)


@dataclass(frozen=True, slots=True)
class Check:
    """One check's outcome: what was found and, unless it is fine, what to do."""

    name: str
    verdict: Verdict
    detail: str
    fix: str = ""


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _statvfs(path: str) -> tuple[int, int]:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _memlock() -> tuple[int, int]:
    return resource.getrlimit(resource.RLIMIT_MEMLOCK)


def _gpu() -> tuple[bool, str]:
    from kvtier.tiers.nvme.backends import cuda_driver_status

    s = cuda_driver_status()
    return s.ok, s.reason


def _kvikio_mode() -> str | None:
    """"gds", "compat", "unknown", or None when kvikio cannot be imported."""
    import importlib

    from kvtier.tiers.nvme.kvikio_io import kvikio_mode

    try:
        return kvikio_mode(importlib.import_module("kvikio"))
    except Exception:
        return None


def _fetch_stats(url: str) -> dict[str, Any]:
    """The daemon's /v1/stats, bounded in time and size (httpget); httpget.FetchError or
    ValueError when there is none or it is not a JSON object whose ``daemon`` is one."""
    from kvtier import httpget, jsonin

    doc = jsonin.loads(httpget.get(url.rstrip("/") + "/v1/stats", deadline_s=3.0))
    if not isinstance(doc, dict) or not isinstance(doc.get("daemon", {}), dict):
        raise ValueError("the answer is not kvtier stats")
    return doc


@dataclass(slots=True)
class Host:
    """Every way the checks read the machine; tests replace single readers."""

    statvfs: Callable[[str], tuple[int, int]] = _statvfs          # (total, available) bytes
    mountinfo: Callable[[], str] = field(
        default=lambda: _read_text("/proc/self/mountinfo") or "")
    read_text: Callable[[str], str | None] = _read_text
    listdir: Callable[[str], list[str]] = _listdir
    exists: Callable[[str], bool] = os.path.exists
    stat: Callable[[str], os.stat_result] = os.stat
    uid: Callable[[], int] = os.getuid
    memlock: Callable[[], tuple[int, int]] = _memlock
    gpu: Callable[[], tuple[bool, str]] = _gpu
    kvikio_mode: Callable[[], str | None] = _kvikio_mode
    fetch_stats: Callable[[str], dict[str, Any]] = _fetch_stats
    o_direct: Callable[[str], str | None] | None = None   # None: the real probe (env_fs)
    # connect, authenticate and PING a Redis server; None: the tier's code (env_redis.ping)
    redis_ping: Callable[[NodeAddr, ConnOptions], None] | None = None


def run_checks(cfg: Config, host: Host | None = None, *,
               daemon_url: str | None = None) -> list[Check]:
    """All checks in a fixed order; ``daemon_url`` None skips the ones that ask the daemon."""
    from kvtier.doctor import env_daemon, env_fs, env_host, env_redis

    h = host or Host()
    stats: dict[str, Any] | None = None
    stats_error = "not asked (--no-daemon)"
    if daemon_url is not None:
        from kvtier.httpget import FetchError

        try:
            stats = h.fetch_stats(daemon_url)
        except (OSError, ValueError, FetchError) as exc:
            stats_error = f"no daemon answered at {daemon_url} ({getattr(exc, 'reason', exc)})"
    checks = [
        env_fs.check_shm(cfg, h),
        *env_fs.check_data_dir(cfg, h),
        env_fs.check_socket_dir(cfg, h),
        env_host.check_memlock(cfg, h),
        env_host.check_thp(h),
        env_host.check_numa(h, stats),
        *env_host.check_gpu(cfg, h),
        env_daemon.check_key_scheme(stats, stats_error),
        env_redis.check_redis_server(cfg, h, before_start=daemon_url is None),
        env_redis.check_redis_auth(cfg, h),
    ]
    return checks


def exit_status(checks: list[Check], *, strict: bool = False) -> int:
    bad = {Verdict.FAIL, Verdict.WARN} if strict else {Verdict.FAIL}
    return 1 if any(c.verdict in bad for c in checks) else 0


def to_json(checks: list[Check], status: int) -> dict[str, Any]:
    return {"status": "ok" if status == 0 else "findings",
            "checks": [{**asdict(c), "verdict": c.verdict.value} for c in checks]}


_STYLE = {Verdict.OK: "green", Verdict.WARN: "yellow", Verdict.FAIL: "bold red",
          Verdict.SKIP: "dim"}


def render(checks: list[Check], console: Any = None) -> None:
    """The human table (rich): one row per check, the fix under the detail."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=120)
    table = Table(title="kvtier doctor --env", title_justify="left", show_lines=True)
    table.add_column("check", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    table.add_column("found / fix")
    for c in checks:
        style = _STYLE[c.verdict]
        text = escape(c.detail) + (f"\n[cyan]fix:[/cyan] {escape(c.fix)}" if c.fix else "")
        table.add_row(c.name, f"[{style}]{c.verdict.value.upper()}[/{style}]", text)
    console.print(table)
    counts = {v: sum(1 for c in checks if c.verdict is v) for v in Verdict}
    console.print(" ".join(f"{v.value} {n}" for v, n in counts.items()))
