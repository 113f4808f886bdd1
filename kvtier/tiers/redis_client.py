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

import ssl
from dataclasses import dataclass
from enum import Enum
from urllib.parse import parse_qs, urlsplit

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
    db: int = 0         # the database number (path, or unix ``?db=``); a cluster uses 0


def parse_target(cfg: RedisConfig) -> RedisTarget:
    """Validate ``cfg.url`` and decide single vs cluster; raises ConfigError when malformed."""
    url_in, seeds = _split_seeds(cfg.url)
    try:
        parts = urlsplit(url_in)
        port = parts.port      # (parsed lazily: a port out of range raises here)
    except ValueError as exc:
        raise ConfigError(f"redis.url {_masked(cfg.url)!r} is malformed ({exc}): give "
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
        raise ConfigError(f"redis.url {_masked(cfg.url)!r} names several servers: only a "
                          "cluster "
                          "(redis+cluster://h1:p1,h2:p2) takes several startup nodes")
    url = parts._replace(scheme=scheme).geturl()
    host = parts.hostname or ""
    netloc = f"{host}:{port}" if port else host
    netloc = ",".join([netloc, *(f"{h}:{p}" for h, p in seeds)])
    display = f"{scheme}://{netloc}{parts.path}" + (" (cluster)" if cluster else "")
    db = _db_number(cfg.url, scheme, parts.path, parts.query)
    if cluster and db:
        raise ConfigError(f"redis.url {_masked(cfg.url)!r} names db {db}, but a Redis Cluster "
                          f"has only db 0: drop the /{db} (or give /0)")
    return RedisTarget(RedisMode.CLUSTER if cluster else RedisMode.SINGLE, url,
                       scheme == "rediss", display, seeds, 0 if cluster else db)


MAX_DB = 1 << 30
"""Largest db number taken from a URL (Redis's own limit is the server's ``databases``)."""


def _db_number(url: str, scheme: str, path: str, query: str) -> int:
    """The db of a URL: the path of redis:// (``/3``) or ``?db=3`` of unix://; none is 0.
    Anything else (``/-1``, ``/7abc``, ``/1/2``, ``?db=abc``) is a ConfigError: taken as
    db 0 it would silently read and write another database than the one named."""
    if scheme == "unix":
        given = parse_qs(query, keep_blank_values=True).get("db", [])
        text, shown = "&".join(given), "?db=" + "&db=".join(given)
    else:
        text = path[1:].removesuffix("/") if path.startswith("/") else path
        shown = path
    if text == "":
        return 0
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_DB:
        raise ConfigError(f"redis.url {_masked(url)!r}: {shown!r} is not a database number: "
                          "give one integer >= 0 (redis://host:port/0, "
                          "unix:///path/redis.sock?db=0)")
    return int(text)


def _masked(url: str) -> str:
    """``url`` without its password (error messages end up in logs)."""
    from kvtier.config import _masked_url

    return _masked_url(url)


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
            raise ConfigError(f"redis.url {_masked(url)!r}: startup node {other!r} is malformed "
                              f"({exc}): give host:port") from None
        if not parts.hostname:
            raise ConfigError(f"redis.url {_masked(url)!r}: startup node {other!r} has no "
                              "host: "
                              "give host:port, separated by commas")
        seeds.append((parts.hostname, port))
    return f"{scheme}://{userinfo}{at}{first}{slash}{path}", tuple(seeds)


def tls_context(cfg: RedisConfig) -> ssl.SSLContext:
    """The client TLS context of ``cfg``; a CA, certificate or key that cannot be loaded
    is a ConfigError naming the setting, its path and what to give (not an OSError or
    SSLError without either)."""
    setting, path = "redis.tls_ca", cfg.tls_ca
    try:
        ctx = ssl.create_default_context(cafile=cfg.tls_ca or None)
        if cfg.tls_cert:
            setting, path = "redis.tls_cert", cfg.tls_cert
            if cfg.tls_key:
                setting, path = "redis.tls_cert/redis.tls_key", f"{cfg.tls_cert} {cfg.tls_key}"
            ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key or None)
    except (ssl.SSLError, OSError) as exc:
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
        what = ("a PEM CA bundle" if setting == "redis.tls_ca" else
                "a PEM client certificate and its private key (unencrypted)")
        raise ConfigError(f"{setting} {path or '(system default)'}: {reason}; give "
                          f"{what}") from None
    if not cfg.tls_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx
