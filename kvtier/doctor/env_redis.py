"""The Redis check of ``doctor --env``: who else can write the blocks kvtier reads.

Frames carry checksums, not signatures (docs/redis.md, "Who can write what kvtier reads"):
whoever can write kvtier's keys can plant KV that every node serves. A server reached
without a password is open to every process that can reach it, which on a shared node
means every other user.
"""

from __future__ import annotations

import stat as stat_mod
from urllib.parse import unquote, urlsplit

from kvtier.config import Config
from kvtier.doctor.env import Check, Host, Verdict

ACL_FIX = ("give kvtier its own Redis user with a password, limited to its keys "
           "(docs/redis.md: ACL SETUSER kvtier on >PASSWORD resetkeys ~kvtier:* ...), and "
           "put it in redis.url (redis://kvtier:PASSWORD@host:port/0) or redis.username/"
           "redis.password")


def check_redis_auth(cfg: Config, host: Host) -> Check:
    """WARN when the Redis tier connects without a password (over TCP, or over a unix
    socket that other users can open); OK with credentials or a socket closed to others."""
    r = cfg.redis
    if not r.enabled:
        return Check("redis auth", Verdict.SKIP, "no Redis tier configured")
    parts = urlsplit(r.url)
    if r.password or unquote(parts.password or ""):
        user = r.username or unquote(parts.username or "") or "default"
        tls = " over TLS" if parts.scheme.lower().startswith("rediss") else ""
        return Check("redis auth", Verdict.OK, f"Redis user {user!r} with a password{tls}")
    if parts.scheme.lower() == "unix":
        path = unquote(parts.path)
        if not host.exists(path):
            return Check("redis auth", Verdict.WARN, f"no password, and the socket {path} "
                         "does not exist (cannot tell who else can open it)", ACL_FIX)
        mode = stat_mod.S_IMODE(host.stat(path).st_mode)
        if not mode & 0o022:
            return Check("redis auth", Verdict.OK, f"no password, but the socket {path} "
                         f"(mode {mode:04o}) is closed to other users")
        return Check("redis auth", Verdict.WARN, f"no password and the socket {path} is "
                     f"mode {mode:04o}: other users can write frames every node serves",
                     ACL_FIX + ", or unixsocketperm 700 for a node-local Redis")
    where = parts.hostname or "?"
    return Check("redis auth", Verdict.WARN, f"no password for {where}:{parts.port or 6379}: "
                 "any process that reaches it (every user of this node, for a local "
                 "server) can plant KV blocks that every node serves", ACL_FIX)
