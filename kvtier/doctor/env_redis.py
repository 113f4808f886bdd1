"""The Redis checks of ``doctor --env``: whether the server answers from this host, and who
else can write the blocks kvtier reads.

``check_redis_server`` connects as the tier does (its own connection code: the URL forms of
kvtier.tiers.redis_client, AUTH and SELECT in kvtier.tiers.redis_wire's handshake, TLS from
the redis.tls_* settings) and sends a PING, within the config's timeouts and at most
``MAX_WAIT_S`` each. A cluster's startup nodes are asked in order until one answers: the
tier discovers the rest from it.

Frames carry checksums, not signatures (docs/redis.md, "Who can write what kvtier reads"):
whoever can write kvtier's keys can plant KV that every node serves. A server reached
without a password is open to every process that can reach it, which on a shared node
means every other user.
"""

from __future__ import annotations

import errno
import socket
import ssl
import stat as stat_mod
from dataclasses import replace
from urllib.parse import unquote, urlsplit

from kvtier.config import Config, RedisConfig
from kvtier.doctor.env import Check, Host, Verdict
from kvtier.errors import KVTierError
from kvtier.statsdoc import clean
from kvtier.tiers.redis_resp import ConnOptions, ErrorReply, NodeAddr, ProtocolError, command

MAX_WAIT_S = 3.0
"""Longest wait for a connection, and for the handshake and PING, whatever the config says."""

ACL_PING = "ACL SETUSER <user> +ping (docs/redis.md lists every command the tier sends)"


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
    return Check("redis auth", Verdict.WARN, f"no password for {_servers(r)}: "
                 "any process that reaches it (every user of this node, for a local "
                 "server) can plant KV blocks that every node serves", ACL_FIX)


def _servers(r: RedisConfig) -> str:
    """The servers redis.url names, as the tier reads it (a cluster URL may name several
    startup nodes: ``urlsplit`` cannot read its port; found by review)."""
    from kvtier.tiers.redis_client import parse_target

    try:
        target = parse_target(r)
    except KVTierError:   # the "redis server" check says what is wrong with the URL
        return "the server of redis.url"
    return target.display


def ping(addr: NodeAddr, opts: ConnOptions) -> None:
    """Connect to ``addr`` as the tier does (TLS, AUTH, SELECT), PING and close. OSError
    (PermissionError for a refused AUTH or SELECT, ssl.SSLError for TLS, ProtocolError for
    a reply that is not RESP) or KVTierError for an error reply to the PING."""
    from kvtier.tiers.redis_wire import Conn

    conn = Conn(addr, opts)
    try:
        (reply,) = conn.simple_many([command(b"PING")])
    finally:
        conn.close()
    if isinstance(reply, ErrorReply):
        raise KVTierError(f"redis {addr} refused PING: {clean(str(reply), 200)}")
    if reply != "PONG":
        raise ProtocolError(f"redis {addr} answered PING with {reply!r}, not PONG")


def _fix(exc: BaseException, addr: NodeAddr, display: str) -> str:
    """What to do about the failure ``exc`` of reaching ``addr``."""
    url = f"check redis.url ({display})"
    if isinstance(exc, KVTierError):   # an error reply to the PING
        text = str(exc)
        if "NOPERM" in text:
            return f"the tier's Redis user may not run PING: {ACL_PING}"
        if "NOAUTH" in text:
            return ("the server wants a password: put the user and password in redis.url "
                    "(redis://USER:PASSWORD@host:port/0) or redis.username/redis.password")
        return f"read the server's log; {url}"
    if isinstance(exc, PermissionError) and exc.errno is None:   # the handshake's refusal
        if "SELECT" in str(exc):
            return "give a db the server has in the path of redis.url (/0 on a cluster)"
        return ("check the user and password in redis.url or redis.username/redis.password, "
                "and that the server's ACL enables that user (ACL LIST)")
    if isinstance(exc, PermissionError):   # a unix socket this user may not open
        return (f"run doctor as the daemon's user; the socket {addr} must be open to it "
                "(redis-server's unixsocketperm)")
    if isinstance(exc, ssl.SSLError):
        return ("check TLS: rediss:// for a TLS port and redis:// for a plain one, the CA "
                "(redis.tls_ca; redis.tls_verify) and the client certificate "
                "(redis.tls_cert, redis.tls_key) the server asks for")
    if isinstance(exc, socket.gaierror):
        return f"the host name does not resolve here: {url}"
    if isinstance(exc, TimeoutError):
        return (f"is the host right and is {addr} open to this host (firewall, security "
                "group)? A TLS port reached with redis:// or a plain one with rediss:// "
                f"waits like this too: {url}")
    if isinstance(exc, ConnectionRefusedError | FileNotFoundError) or getattr(
            exc, "errno", None) in (errno.ECONNREFUSED, errno.ENOENT):
        return f"is redis-server running on {addr}? Start it, or {url}"
    if isinstance(exc, ConnectionError):   # closed or reset mid-handshake, or not RESP
        return (f"is {addr} a Redis server, and does it expect TLS (rediss://)? {url}; the "
                "server's log says why it closed the connection")
    return url


def check_redis_server(cfg: Config, host: Host, *, before_start: bool = False) -> Check:
    """FAIL unless the Redis server of redis.url answers a PING from this host (the first
    of a cluster's startup nodes that does); WARN when an earlier startup node did not.
    ``before_start`` (``--no-daemon``, a preflight before the daemon starts): no answer is
    a WARN, not a FAIL. The daemon starts with its Redis tier down and connects once the
    server answers, so a Redis that comes up after kvtier must not hold kvtier back (an
    init container running this check would, on a FAIL)."""
    from kvtier.tiers.redis_client import RedisMode, parse_target
    from kvtier.tiers.redis_route import conn_options

    r = cfg.redis
    if not r.enabled:
        return Check("redis server", Verdict.SKIP, "no Redis tier configured")
    try:
        target = parse_target(r)
        seed, opts = conn_options(r, target)
    except KVTierError as exc:   # a URL or TLS file a start refuses too (password masked)
        return Check("redis server", Verdict.FAIL, str(exc), "fix the setting it names")
    opts = replace(opts, connect_timeout_s=min(opts.connect_timeout_s, MAX_WAIT_S),
                   op_timeout_s=min(opts.op_timeout_s, MAX_WAIT_S))
    probe = host.redis_ping or ping
    failed: list[tuple[NodeAddr, BaseException]] = []
    for addr in [seed, *(NodeAddr(h, p) for h, p in target.seeds)]:
        try:
            probe(addr, opts)
        except (OSError, KVTierError) as exc:
            failed.append((addr, exc))
            continue
        found = f"{addr} answered PING"
        if target.mode is RedisMode.CLUSTER:
            found += " (a startup node of the cluster; the tier finds the others from it)"
        if not failed:
            return Check("redis server", Verdict.OK, f"{found}: redis.url {target.display}")
        return Check("redis server", Verdict.WARN,
                     f"{found}, but {_failures(failed, opts)}",
                     f"start those nodes or drop them from redis.url ({target.display})")
    why = f"redis.url {target.display}: cannot PING it from this host: {_failures(failed, opts)}"
    if before_start and all(_not_up_yet(exc) for _addr, exc in failed):
        return Check("redis server", Verdict.WARN, why + " (the daemon starts with its Redis "
                     "tier down and connects once the server answers)",
                     _fix(failed[-1][1], failed[-1][0], target.display))
    return Check("redis server", Verdict.FAIL, why,
                 _fix(failed[-1][1], failed[-1][0], target.display))


def _not_up_yet(exc: BaseException) -> bool:
    """Whether ``exc`` says only that no server listens yet (refused, no socket file, no
    route, a name not resolved yet), not that the settings are wrong (credentials, TLS, db,
    ACL) or that something listens and does not answer (a timeout: a TLS port, a black
    hole)."""
    return isinstance(exc, (ConnectionRefusedError, socket.gaierror)) or (
        isinstance(exc, OSError) and not isinstance(exc, TimeoutError)
        and exc.errno in _NOT_UP)


_NOT_UP = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENOENT}


def _failures(failed: list[tuple[NodeAddr, BaseException]], opts: ConnOptions) -> str:
    return "; ".join(f"{addr}: {_reason(exc, opts)}" for addr, exc in failed)


def _reason(exc: BaseException, opts: ConnOptions) -> str:
    """The failure as one line, the password never in it (whatever the error echoes)."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror and type(exc) in (ConnectionRefusedError,
                                                                   FileNotFoundError):
        text = exc.strerror                      # (the path or address is said already)
    elif isinstance(exc, TimeoutError) and text == "timed out":   # the connect's own
        text = f"no connection within {opts.connect_timeout_s:g} s"
    text = text.replace(opts.password, "***") if opts.password else text
    return clean(text, 300)   # a server's words: no terminal escapes (found by review)
