"""Building a redis-py asyncio client (single server or Redis Cluster) from RedisConfig.

Kept apart from the tier so the tier only sees "a client that pipelines". The client is
built with redis-py's own retries switched off: the tier decides what a failure means
(count it, mark the tier down, reconnect with backoff), and a hidden retry loop inside
redis-py would only stretch the time a caller waits on a dead server.

URL forms:

- ``redis://[user:pass@]host:port/db`` and ``rediss://...`` (TLS) for one server;
- ``unix:///path/to/redis.sock?db=0`` for a local socket;
- ``redis+cluster://host:port`` / ``rediss+cluster://host:port`` (or ``cluster = true``
  with a plain URL) for Redis Cluster: the URL names one startup node, the others are
  discovered from it. Keys carry no hash tag, so blocks spread over all slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass
from enum import Enum
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvtier.config import RedisConfig
from kvtier.errors import ConfigError

RedisClient = Redis | RedisCluster


class RedisMode(str, Enum):
    """Which redis-py client the tier talks through (also the tier's ``backend``)."""

    SINGLE = "redis"
    CLUSTER = "redis-cluster"


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where and how to connect, derived once from the config (URL without credentials)."""

    mode: RedisMode
    url: str            # URL handed to redis-py (cluster scheme suffix removed)
    tls: bool
    display: str        # for logs and stats: no password in it


def parse_target(cfg: RedisConfig) -> RedisTarget:
    """Validate ``cfg.url`` and decide single vs cluster; raises ConfigError when malformed."""
    parts = urlsplit(cfg.url)
    scheme = parts.scheme.lower()
    cluster = cfg.cluster
    if scheme.endswith("+cluster"):
        cluster = True
        scheme = scheme.removesuffix("+cluster")
    if scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"redis.url scheme {parts.scheme!r} is not supported: use redis://, "
                          "rediss://, unix:// or redis+cluster://")
    if cluster and scheme == "unix":
        raise ConfigError("Redis Cluster cannot be reached over a unix:// socket")
    url = parts._replace(scheme=scheme).geturl()
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    display = f"{scheme}://{netloc}{parts.path}" + (" (cluster)" if cluster else "")
    return RedisTarget(RedisMode.CLUSTER if cluster else RedisMode.SINGLE, url,
                       scheme == "rediss", display)


def _common_kwargs(cfg: RedisConfig, target: RedisTarget) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "socket_timeout": cfg.op_timeout_s,
        "socket_connect_timeout": cfg.connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": False,
    }
    if cfg.username:
        kw["username"] = cfg.username
    if cfg.password:
        kw["password"] = cfg.password
    if target.tls:
        kw["ssl_cert_reqs"] = ssl.CERT_REQUIRED if cfg.tls_verify else ssl.CERT_NONE
        kw["ssl_check_hostname"] = cfg.tls_verify
        if cfg.tls_ca:
            kw["ssl_ca_certs"] = cfg.tls_ca
        if cfg.tls_cert:
            kw["ssl_certfile"] = cfg.tls_cert
        if cfg.tls_key:
            kw["ssl_keyfile"] = cfg.tls_key
    return kw


def build_client(cfg: RedisConfig, target: RedisTarget) -> RedisClient:
    """A new, not yet connected client. Connection pool size = ``cfg.max_connections``.

    A single server uses a BlockingConnectionPool so a burst beyond the pool waits (up to
    the op timeout) instead of failing; cluster pools are per node and the tier bounds its
    own concurrency below ``max_connections``.
    """
    kw = _common_kwargs(cfg, target)
    if target.mode is RedisMode.CLUSTER:
        parts = urlsplit(target.url)
        if target.tls:
            kw["ssl"] = True
        if not cfg.username and parts.username:
            kw["username"] = unquote(parts.username)
        if not cfg.password and parts.password:
            kw["password"] = unquote(parts.password)
        return RedisCluster(host=parts.hostname or "127.0.0.1", port=parts.port or 6379,
                            max_connections=cfg.max_connections, **kw)
    pool = BlockingConnectionPool.from_url(target.url, max_connections=cfg.max_connections,
                                           timeout=cfg.op_timeout_s, **kw)
    return Redis.from_pool(pool)


async def connect(cfg: RedisConfig, target: RedisTarget) -> RedisClient:
    """Build a client and prove it works (cluster topology loaded, PING answered).

    Raises whatever redis-py raises (ConnectionError, AuthenticationError, TimeoutError,
    ...) or asyncio.TimeoutError; the half-built client is closed first.
    """
    client = build_client(cfg, target)

    async def probe() -> None:
        if isinstance(client, RedisCluster):
            await client.initialize()
        await client.ping()

    try:
        await asyncio.wait_for(probe(), cfg.connect_timeout_s + cfg.op_timeout_s)
    except BaseException:
        await close_quietly(client)
        raise
    return client


async def close_quietly(client: RedisClient | None) -> None:
    """Close a client and its pool(s), ignoring errors from already-dead connections."""
    if client is None:
        return
    with contextlib.suppress(Exception):  # a dying client may fail to close: nothing to do
        await client.aclose()
