"""What a running daemon says about itself: its start banner, its stats document
(``stats`` on the control socket, /v1/stats, the source of /metrics) and its recent lookups
(/v1/lookups/recent).

Read-only views over the parts ``kvtier.daemon.service.Daemon`` holds, passed in; kept
apart from the lifecycle, which makes and tears down those parts. Imports nothing of it.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from kvtier import __version__
from kvtier.config import http_base_url
from kvtier.daemon.metrics import admission_stats
from kvtier.explain import salt_id

if TYPE_CHECKING:
    from kvtier.config import Config
    from kvtier.daemon.control import ControlServer
    from kvtier.daemon.gc_guard import GcGuard
    from kvtier.daemon.http import HttpServer
    from kvtier.daemon.loop_lag import LoopLag
    from kvtier.explain import MissLog
    from kvtier.store import TieredStore
    from kvtier.tiers.arena import Arena


def banner(cfg: Config, arena: Arena, http_port: int, *, hbm: Any, nvme: Any, redis: Any,
           rebuilt: int, adopted: int) -> str:
    """The lines printed once the daemon serves: socket, HTTP address, tiers, policy, and
    the blocks ``rebuilt`` from nvme and ``adopted`` from a crashed daemon's arena."""
    tiers = f"cpu {arena.size / 2**30:.2f} GiB (shm {arena.path})"
    if hbm is not None:
        tiers = (f"hbm {hbm.capacity_bytes / 2**30:.2f} GiB (cuda device "
                 f"{cfg.hbm.device}), " + tiers)
    if nvme is not None:
        tiers += (f", nvme {cfg.nvme.bytes / 2**30:.2f} GiB at {cfg.nvme_path} "
                  f"({nvme.backend})")
    if redis is not None:
        tiers += f", redis {cfg.redis.url.split('@')[-1]}"
    return (f"kvtier {__version__} serving (pid {os.getpid()})\n"
            f"  socket: {cfg.daemon.socket}\n"
            f"  http:   {http_base_url(cfg.http.host, http_port)}  "
            f"(/metrics /v1/stats /healthz)\n"
            f"  tiers:  {tiers}\n"
            f"  policy: {cfg.policy.eviction}; rebuilt {rebuilt} blocks "
            f"from nvme, adopted {adopted} from the arena")


def stats_document(cfg: Config, store: TieredStore, started: float, *,
                   control: ControlServer | None, gc: GcGuard | None,
                   loop_lag: LoopLag | None, explain: MissLog | None,
                   http: HttpServer | None) -> dict[str, Any]:
    """The daemon's stats: its own counters, the store's tiers and policies, the engines'
    reports, admission, explain and HTTP; ``started`` is its start (``time.time()``)."""
    out: dict[str, Any] = {"version": 1}
    out["daemon"] = {
        "pid": os.getpid(), "version": __version__,
        "uptime_s": round(time.time() - started, 3),
        "socket": str(cfg.daemon.socket),
        "clients": len(control.connections) if control else 0,
        "rejected_peers": control.rejected_peers if control else 0,
        "protocol_errors": control.protocol_errors if control else 0,
    }
    if control is not None:
        out["daemon"].update(control.limit_stats())
    if gc is not None:
        out["daemon"]["gc"] = gc.as_dict()
    if loop_lag is not None:
        out["daemon"]["loop"] = loop_lag.stats()
    out.update(store.stats())   # tiers.hbm first when the daemon has a pool
    shadows = getattr(store.observer, "snapshot", None)
    if callable(shadows):  # adaptive policy: mode and miss-ratio curve per tier
        out.setdefault("policy", {})["tiers"] = shadows()
        out["policy"]["lookups_dropped"] = getattr(store.observer, "dropped_lookups", 0)
    out["connector"] = control.engine_summary() if control else {}
    if control is not None:
        schemes: dict[str, int] = {}
        for conn in control.connections.values():
            scheme = getattr(conn, "key_scheme", "") or "unknown"
            schemes[scheme] = schemes.get(scheme, 0) + 1
        out["daemon"]["key_schemes"] = schemes
    out["admission"] = admission_stats(store.admission, cfg.nvme.write_budget_bytes_per_s,
                                       store.clock())
    if explain is not None:
        out["explain"] = explain.stats()
    if http is not None:
        out["http"] = http.guard.stats()
    return out


def recent_lookups(explain: MissLog | None, store: TieredStore | None, limit: int,
                   misses_only: bool) -> list[dict[str, Any]]:
    """Recent lookups with their first-miss reason, newest first (/v1/lookups/recent)."""
    if explain is None or store is None:
        return []
    names = {d: {"model_id": e.namespace.model_id,
                 "salt_id": salt_id(e.namespace.cache_salt), "tp_rank": e.namespace.tp_rank}
             for d, e in store.namespaces.items()}
    return explain.recent(limit, misses_only=misses_only, namespaces=names)
