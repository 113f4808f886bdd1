"""Where the Redis tier connects: the URL forms of ``redis.url``, validated once.

The tier talks RESP itself (kvtier.tiers.redis_wire) and routes keys itself
(kvtier.tiers.redis_route), so it decides what a failure means (count it, take a server
out of the routing, reconnect with backoff) with no retry loop hidden in a client library.

URL forms:

- ``redis://[user:pass@]host:port/db`` and ``rediss://...`` (TLS) for one server;
- ``unix:///path/to/redis.sock?db=0`` for a local socket;
- ``redis+cluster://host:port`` / ``rediss+cluster://host:port`` (or ``cluster = true``
  with a plain URL) for Redis Cluster: the URL names a startup node, the others are
  discovered from it; ``redis+cluster://h1:7000,h2:7000,h3:7000`` names several, any of
  which may answer first (with one, a tier started while that node was down stayed down
  though the rest of the cluster served). Keys carry no hash tag, so blocks spread over
  all slots.
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
    seeds: tuple[tuple[str, int], ...] = ()   # a cluster's other startup nodes


def parse_target(cfg: RedisConfig) -> RedisTarget:
    """Validate ``cfg.url`` and decide single vs cluster; raises ConfigError when malformed."""
    url_in, seeds = _split_seeds(cfg.url)
    try:
        parts = urlsplit(url_in)
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
    if seeds and not cluster:
        raise ConfigError(f"redis.url {cfg.url!r} names several servers: only a cluster "
                          "(redis+cluster://h1:p1,h2:p2) takes several startup nodes")
    url = parts._replace(scheme=scheme).geturl()
    host = parts.hostname or ""
    netloc = f"{host}:{port}" if port else host
    netloc = ",".join([netloc, *(f"{h}:{p}" for h, p in seeds)])
    display = f"{scheme}://{netloc}{parts.path}" + (" (cluster)" if cluster else "")
    return RedisTarget(RedisMode.CLUSTER if cluster else RedisMode.SINGLE, url,
                       scheme == "rediss", display, seeds)


def _split_seeds(url: str) -> tuple[str, tuple[tuple[str, int], ...]]:
    """``url`` with only its first host, and the other ``host:port`` of a comma list."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    if not sep or "," not in hosts:
        return url, ()
    first, *others = hosts.split(",")
    seeds: list[tuple[str, int]] = []
    for other in others:
        try:
            parts = urlsplit(f"//{other}")
            port = parts.port or 6379
        except ValueError as exc:
            raise ConfigError(f"redis.url {url!r}: startup node {other!r} is malformed "
                              f"({exc}): give host:port") from None
        if not parts.hostname:
            raise ConfigError(f"redis.url {url!r}: startup node {other!r} has no host: "
                              "give host:port, separated by commas")
        seeds.append((parts.hostname, port))
    return f"{scheme}://{userinfo}{at}{first}{slash}{path}", tuple(seeds)
