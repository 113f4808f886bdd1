"""The daemon's open-file budget: the connections it is configured for must fit its limit.

Every control connection, HTTP connection and Redis connection is a descriptor. A daemon
started from a shell inherits a soft ``RLIMIT_NOFILE`` of 1024, below the default
``daemon.max_connections`` alone: idle connections then ran it out of descriptors before
the limit refused anything (found by review). New engines got an untyped "connection
dropped during the hello", ``/v1/stats`` and ``/metrics`` were reset, and the arena
journal, unable to open its compacted file, switched warm restart off for good.

At start the soft limit is raised towards the hard one as far as the configured
connections need (what servers such as Redis and nginx do); when the hard limit is lower,
the daemon serves fewer control connections than configured, says so once with the fix,
and beyond them refuses with the typed ``Overloaded``.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable

from kvtier.config import Config
from kvtier.errors import StartupError

log = logging.getLogger("kvtier.daemon")

RESERVED_FDS = 256
"""Descriptors kept for everything but connections: nvme slot files (at most
``kvtier.tiers.nvme.files.MAX_OPEN_FILES`` open, more only while their I/O is in flight),
the arena, its journal and its compaction, the presence filter, the event loop, threads'
pipes, a hello's arena descriptor, logs."""
CLUSTER_NODES = 8
"""Redis Cluster masters a daemon is budgeted to hold connections to (each up to
``redis.max_connections``)."""
MIN_CONNECTIONS = 8
"""Fewer control connections than this is no daemon worth starting."""

Limits = tuple[int, int]   # (soft, hard), resource.RLIM_INFINITY for none


def connections_that_fit(cfg: Config) -> int:
    """``fit_connections`` for a daemon's config: its HTTP and Redis connections counted."""
    redis_fds = (cfg.redis.max_connections * (CLUSTER_NODES if cfg.redis.cluster else 1)
                 if cfg.redis.enabled else 0)
    return fit_connections(cfg.daemon.max_connections, cfg.http.max_connections + redis_fds)


def fit_connections(max_connections: int, other_fds: int, *,
                    get: Callable[[], Limits] | None = None,
                    set_: Callable[[Limits], None] | None = None) -> int:
    """The control connections this process can hold: ``max_connections`` once the soft
    open-file limit is raised to fit them plus ``other_fds`` (HTTP and Redis connections)
    and ``RESERVED_FDS``, else as many as the hard limit leaves (logged with the fix).
    StartupError when it leaves fewer than ``MIN_CONNECTIONS``. ``get``/``set_``: the
    limit's accessors (tests inject them)."""
    get = get or (lambda: resource.getrlimit(resource.RLIMIT_NOFILE))
    set_ = set_ or (lambda lim: resource.setrlimit(resource.RLIMIT_NOFILE, lim))
    need = max_connections + other_fds + RESERVED_FDS
    soft, hard = get()
    if _fits(soft, need):
        return max_connections
    target = need if _fits(hard, need) else hard
    try:
        set_((target, hard))
        soft = target
    except (ValueError, OSError) as exc:
        log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    if _fits(soft, need):
        return max_connections
    fit = soft - other_fds - RESERVED_FDS
    if fit < MIN_CONNECTIONS:
        raise StartupError(
            f"the open-file limit ({soft}, hard {_shown(hard)}) leaves room for {max(fit, 0)} "
            f"control connections after {other_fds} HTTP and Redis connections and "
            f"{RESERVED_FDS} other files: raise it (`ulimit -n {need}`, systemd "
            "LimitNOFILE=) or lower http.max_connections")
    log.warning("the open-file limit (%d, hard %s) fits %d of daemon.max_connections=%d "
                "control connections; beyond them clients are refused (overloaded): raise "
                "it (`ulimit -n %d`, systemd LimitNOFILE=) or lower daemon.max_connections",
                soft, _shown(hard), fit, max_connections, need)
    return fit


def _fits(limit: int, need: int) -> bool:
    return limit == resource.RLIM_INFINITY or limit >= need


def _shown(limit: int) -> str:
    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)
