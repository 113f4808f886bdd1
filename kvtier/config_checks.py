"""Cross-field checks of a loaded config, and the floors below which a daemon would start
and serve nothing (``validate``, called by ``kvtier.config.load_config`` once the sources
are merged). Each failure is one ``ConfigError`` line naming the setting and the fix.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError
from kvtier.units import ByteSize

if TYPE_CHECKING:
    from kvtier.config import Config


def validate(cfg: Config) -> None:
    """Cross-field checks with messages that say what to change (one field's own range is
    its type's: kvtier.config_convert)."""
    if cfg.cpu.bytes < MIN_CPU_BYTES:
        raise ConfigError(f"cpu.bytes must be at least {MIN_CPU_BYTES} (one page), got "
                          f"{cfg.cpu.bytes}: the cpu tier is the staging tier every block "
                          "passes through (e.g. --cpu-bytes 2GiB)")
    if cfg.nvme.enabled and 0 < cfg.nvme.bytes < MIN_NVME_BYTES:
        raise ConfigError(f"nvme.bytes must be 0 (no nvme tier) or at least {MIN_NVME_BYTES} "
                          f"(one page, the smallest slot), got {cfg.nvme.bytes}: such a tier "
                          "could hold no block (e.g. --nvme-bytes 100GiB)")
    if cfg.cpu.bytes < cfg.cpu.slab_bytes:
        cfg.cpu.slab_bytes = ByteSize(cfg.cpu.bytes)
    if cfg.daemon.lease_sweep_s < 0.01:   # (smaller: an idle daemon spins)
        raise ConfigError("daemon.lease_sweep_s must be >= 0.01 (seconds between lease "
                          "sweeps)")
    for name, value, top in (("listen_backlog", cfg.daemon.listen_backlog, 65535),
                             ("max_connections", cfg.daemon.max_connections, 1 << 20),
                             ("max_connections_per_client",
                              cfg.daemon.max_connections_per_client, 1 << 20),
                             ("max_namespaces", cfg.daemon.max_namespaces, 1 << 24),
                             ("max_inflight_per_conn", cfg.daemon.max_inflight_per_conn,
                              1 << 16),
                             ("max_frame_bytes", cfg.daemon.max_frame_bytes, 1 << 30)):
        if value > top:
            raise ConfigError(f"daemon.{name} must be at most {top}, got {value}")
    if cfg.nvme.io_threads > 1024:
        raise ConfigError(f"nvme.io_threads must be at most 1024, got {cfg.nvme.io_threads}")
    if not 0 < cfg.nvme.backoff_min_s <= cfg.nvme.backoff_max_s:
        raise ConfigError("nvme.backoff_min_s must be > 0 and <= nvme.backoff_max_s")
    if cfg.redis.lookup_budget_s <= 0:
        raise ConfigError("redis.lookup_budget_s must be > 0 (e.g. 0.1: well under the "
                          "connector's step timeout)")
    if cfg.daemon.max_frame_bytes < MIN_FRAME_BYTES:
        raise ConfigError(
            f"daemon.max_frame_bytes must be at least {MIN_FRAME_BYTES} (64KiB), got "
            f"{cfg.daemon.max_frame_bytes}: every request is one frame, and a lookup, put or "
            "get of a long context carries thousands of keys (a frame too small for them "
            "breaks every client with ProtocolError; the default is 16MiB)")
    if not cfg.http.host.strip():
        raise ConfigError("http.host is empty, which would listen on every interface: give "
                          "an address (127.0.0.1, the default; 0.0.0.0 for every interface)")
    token = cfg.http.admin_token
    if token and token != token.strip():   # (found by review: it could never match, since
        raise ConfigError(                 # a request's token is read stripped)
            "http.admin_token starts or ends with whitespace, so no request could present "
            "it: remove the spaces (KVTIER_HTTP_ADMIN_TOKEN, --http-admin-token)")
    if cfg.redis.enabled and cfg.redis.tls_key and not cfg.redis.tls_cert:
        raise ConfigError("redis.tls_key is set without redis.tls_cert: a client key is "
                          "used only with its certificate; set both (--redis-tls-cert) or "
                          "neither")
    _check_timings(cfg)


def check_redis_files(cfg: Config) -> None:
    """What a serving daemon reads at start (``kvtier serve``, not the clients that load the
    same config): ``redis.url`` well formed, and the TLS files of a ``rediss://`` URL
    readable regular files. One ConfigError naming the setting and path, before the tiers
    are built (the SSL library would say only "No such file or directory")."""
    from kvtier.tiers.redis_client import parse_target

    if not cfg.redis.enabled or not parse_target(cfg.redis).tls:
        return
    r = cfg.redis
    for setting, path, what in (("redis.tls_ca", r.tls_ca, "a PEM CA bundle"),
                                ("redis.tls_cert", r.tls_cert, "a PEM client certificate"),
                                ("redis.tls_key", r.tls_key, "the PEM key of redis.tls_cert")):
        if path:
            problem = _file_problem(path)
            if problem:
                raise ConfigError(f"{setting} {path}: {problem}; give {what}")


def _file_problem(path: str) -> str:
    """Why ``path`` cannot be read as a regular file ("" when it can)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return exc.strerror or str(exc)
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if not os.access(path, os.R_OK):
        return f"is not readable by uid {os.getuid()}"
    return ""


MIN_CPU_BYTES = 4096
"""Smallest ``cpu.bytes``: one page, the arena's smallest slot."""
MIN_NVME_BYTES = 4096
"""Smallest ``nvme.bytes`` other than 0: one page, an nvme slot's least (a frame's header
and payload, rounded up to pages)."""
MIN_FRAME_BYTES = 64 * 2**10
"""Smallest ``daemon.max_frame_bytes``: a hello is about 100 bytes, but a request of a long
context's keys (16 bytes each, thousands of them) needs tens of KiB."""
MIN_TIMEOUT_S = 0.1
"""Smallest lease TTL and read timeout of the daemon: a client on a busy node needs that
long between two steps of one exchange (the hello and its answer, a put and its commit)."""


def _check_timings(cfg: Config) -> None:
    """Times so short that a daemon would start and then serve nothing: every lease expired
    before its commit, every client dropped in its hello, a full collection without pause,
    a Redis tier that can never answer in time. One line each, naming the setting."""
    d, r = cfg.daemon, cfg.redis
    floors = (
        ("daemon.lease_ttl_s", d.lease_ttl_s, MIN_TIMEOUT_S, False,
         "a lease shorter than that expires before a client has filled or read its slots, "
         "so every put and get fails with LeaseExpired (default 30)"),
        ("daemon.read_timeout_s", d.read_timeout_s, MIN_TIMEOUT_S, False,
         "a client has that long to send its hello and each frame; shorter, every client "
         "is dropped before it is served (default 10)"),
        ("daemon.idle_timeout_s", d.idle_timeout_s, MIN_TIMEOUT_S, True,
         "shorter, connections are closed between an engine's steps (default 600)"),
        ("daemon.gc_full_s", d.gc_full_s, 1.0, True,
         "a full collection walks every block: more often, the daemon does little else "
         "(default 3600)"),
        ("redis.connect_timeout_s", r.connect_timeout_s, 0.01, False,
         "no connection can be made in less (default 1)"),
        ("redis.op_timeout_s", r.op_timeout_s, 0.01, False,
         "no Redis answer comes in less (default 2)"),
    )
    for name, value, floor, zero_ok, why in floors:
        if value < floor and not (zero_ok and value == 0):
            never = " or 0 (never)" if zero_ok else ""
            raise ConfigError(f"{name} must be at least {floor:g} seconds{never}, got "
                              f"{value:g}: {why}")
