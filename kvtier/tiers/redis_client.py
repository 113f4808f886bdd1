"""Where the Redis tier connects: the URL forms of ``redis.url``, validated once.

The tier talks RESP itself (kvtier.tiers.redis_wire) and routes keys itself
(kvtier.tiers.redis_route), so it decides what a failure means (count it, take a server
out of the routing, reconnect with backoff) with no retry loop hidden in a client library.

URL forms:

- ``redis://[user:pass@]host:port/db`` and ``rediss://...`` (TLS) for one server;
- ``unix:///path/to/redis.sock?db=0`` for a local socket;
- ``redis+cluster://host:port`` / ``rediss+cluster://host:port`` (or ``cluster = true``
  with a plain URL) for Redis Cluster: the URL names one startup node, the others are
  discovered from it. Keys carry no hash tag, so blocks spread over all slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from urllib.parse import urlsplit

from kvtier.config import RedisConfig
from kvtier.errors import ConfigError


class RedisMode(str, Enum):
    """One server or a Redis Cluster (also the tier's ``backend``)."""

    SINGLE = "redis"
    CLUSTER = "redis-cluster"


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where and how to connect, derived once from the config (URL without credentials)."""

    mode: RedisMode
    url: str            # the URL with the cluster scheme suffix removed
    tls: bool
    display: str        # for logs and stats: no password in it


def parse_target(cfg: RedisConfig) -> RedisTarget:
    """Validate ``cfg.url`` and decide single vs cluster; raises ConfigError when malformed."""
    try:
        parts = urlsplit(cfg.url)
        port = parts.port      # (parsed lazily: a port out of range raises here)
    except ValueError as exc:
        raise ConfigError(f"redis.url {cfg.url!r} is malformed ({exc}): give "
                          "redis://host:port/db, rediss://..., unix://path or "
                          "redis+cluster://host:port") from None
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
    netloc = f"{host}:{port}" if port else host
    display = f"{scheme}://{netloc}{parts.path}" + (" (cluster)" if cluster else "")
    return RedisTarget(RedisMode.CLUSTER if cluster else RedisMode.SINGLE, url,
                       scheme == "rediss", display)
