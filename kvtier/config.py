"""One typed config tree: embedded defaults < TOML file < env ``KVTIER_*`` < CLI flags.

Sections mirror the daemon's parts (``[daemon]``, ``[http]``, ``[cpu]``, ``[nvme]``,
``[redis]``, ``[hbm]``, ``[policy]``). Env names are ``KVTIER_<SECTION>_<FIELD>`` (for example
``KVTIER_CPU_BYTES=8GiB``, ``KVTIER_REDIS_URL=redis://...``); a few short aliases exist for
the most used settings (``KVTIER_SOCKET``, ``KVTIER_DATA_DIR``). Every value is converted by
its field's type with msgspec (kvtier.config_convert): ``ByteSize`` fields accept ``4GiB``,
``512MiB``, ``1e9``; enum fields accept their values only. Every value is checked once here,
so the rest of the code trusts it; ``kvtier serve`` makes one flag per field from this tree.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

from msgspec import Meta

from kvtier.errors import ConfigError
from kvtier.units import ByteSize, parse_size

__all__ = ["ByteSize", "Config", "ConfigError", "load_config", "parse_size"]

# counts and TTLs: never negative, and below 2**31 (found by review: a redis.ttl_s of 1e16
# started, then Redis refused every write with "invalid expire time")
Count = Annotated[int, Meta(ge=0, le=2**31 - 1)]
AtLeastOne = Annotated[int, Meta(ge=1, le=2**31 - 1)]
Port = Annotated[int, Meta(ge=0, le=65535)]   # 0 picks a free port
Seconds = Annotated[float, Meta(ge=0, le=10**9)]  # finite too (nan would make deadlines
#                                                   never fire); beyond 30 years is a typo
Number = Annotated[float, Meta(ge=0)]
Fraction = Annotated[float, Meta(ge=0, le=1)]


class Choice(str, Enum):
    """An enum-like setting: equal to its value as a string, and printed as it."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class LogLevel(Choice):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


class NvmeDirect(Choice):
    """O_DIRECT use for slot files: ``auto`` where an aligned probe works."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class NvmeBackend(Choice):
    AUTO = "auto"
    POSIX = "posix"
    KVIKIO = "kvikio"


class RedisCodec(Choice):
    NONE = "none"
    LZ4 = "lz4"
    SHUFFLE_LZ4 = "shuffle-lz4"
    SHUFFLE_ZSTD = "shuffle-zstd"
    AUTO = "auto"


class Eviction(Choice):
    ADAPTIVE = "adaptive"
    LRU = "lru"
    LFU = "lfu"
    COST = "cost"
    HINDSIGHT = "hindsight"


class PrefetchWait(Choice):
    BEST_EFFORT = "best_effort"
    WAIT = "wait"
    TIMEOUT = "timeout"


def _is_private_dir_of(path: str, uid: int) -> bool:
    """Whether ``path`` is a directory owned by ``uid`` that nobody else can write or list."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and st.st_mode & 0o077 == 0


def default_runtime_dir(env: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    """The socket's directory when none is configured: one that no other user can create.

    ``$XDG_RUNTIME_DIR/kvtier`` when XDG_RUNTIME_DIR is a directory of ours with mode 0700
    (what login managers create), else ``/run/kvtier`` for root, else ``/tmp/kvtier-UID``.
    The daemon creates the last one with mode 0700 and refuses to start when it already
    exists with another owner or mode (kvtier.trust). The daemon and its clients call this
    same function, so they agree without any file being read.
    """
    environ = os.environ if env is None else env
    uid = os.getuid() if uid is None else uid
    xdg = environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg) and _is_private_dir_of(xdg, uid):
        return Path(xdg) / "kvtier"
    if uid == 0:
        return Path("/run/kvtier")
    return Path(f"/tmp/kvtier-{uid}")


def default_socket_path(env: Mapping[str, str] | None = None) -> Path:
    """Where clients look for the daemon when nothing else is configured: where the daemon's
    config puts it (``~`` expanded: ``Environment=`` or ``docker -e`` has no shell)."""
    environ = os.environ if env is None else env
    explicit = environ.get("KVTIER_SOCKET") or environ.get("KVTIER_DAEMON_SOCKET")
    if not explicit:
        return default_runtime_dir(environ) / "kvtier.sock"
    with contextlib.suppress(RuntimeError):   # no home: the daemon refuses it (ConfigError)
        return Path(explicit).expanduser()
    return Path(explicit)


TRUSTED_UIDS_ENV = "KVTIER_TRUSTED_UIDS"


def trusted_daemon_uids(env: Mapping[str, str] | None = None) -> frozenset[int]:
    """Uids besides the client's own whose daemon a client may talk to.

    From ``KVTIER_TRUSTED_UIDS``: uids or user names separated by commas or spaces. Empty:
    only our own uid. (Trusting a uid lets the hello go out; the daemon itself serves only
    processes of its own user and answers any other with a TrustError.)
    """
    environ = os.environ if env is None else env
    out: set[int] = set()
    for item in re.split(r"[\s,]+", environ.get(TRUSTED_UIDS_ENV, "").strip()):
        if not item:
            continue
        if item.isdigit():
            out.add(int(item))
            continue
        try:
            out.add(pwd.getpwnam(item).pw_uid)
        except KeyError:
            raise ConfigError(f"{TRUSTED_UIDS_ENV}: no user named {item!r}; list uids or "
                              "existing user names, separated by commas") from None
    return frozenset(out)


def default_data_dir() -> Path:
    """Per-user data directory for the nvme tier: ``$XDG_DATA_HOME/kvtier`` (an absolute
    XDG_DATA_HOME only, as the XDG spec says), else ``~/.local/share/kvtier``. ConfigError
    when there is no home either (a container's arbitrary uid with HOME unset)."""
    xdg = os.environ.get("XDG_DATA_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "kvtier"
    try:
        home = Path.home()
    except (RuntimeError, KeyError):
        # (found by review) every command loads this default: `kvtier stats` has no
        # --data-dir, so the fix named must work for all of them
        raise ConfigError(f"no home directory for uid {os.getuid()} (HOME is unset and the "
                          "uid has no passwd entry) to keep the data dir in: set "
                          "KVTIER_DATA_DIR=PATH (daemon.data_dir; `kvtier serve --data-dir "
                          "PATH`) or XDG_DATA_HOME") from None
    return home / ".local" / "share" / "kvtier"


@dataclass(slots=True)
class DaemonConfig:
    data_dir: Path = field(default_factory=default_data_dir)
    socket: Path = field(default_factory=default_socket_path)
    max_frame_bytes: ByteSize = ByteSize(16 * 2**20)  # control frames only: KV bytes never here
    max_inflight_per_conn: AtLeastOne = 64    # bounded per-connection request queue
    lease_ttl_s: Seconds = 30.0           # a lease not released/committed by then expires
    lease_sweep_s: Seconds = 1.0          # how often expired leases are taken back
    drain_timeout_s: Seconds = 10.0       # one deadline for the whole stop (every teardown step)
    log_level: LogLevel = LogLevel.INFO
    # Bounded work (docs/operations.md, "Limits"): keys per request <= ceil(max_context_tokens
    # / tokens_per_block) of the request's namespace; pending bytes 0 = derived from the frame.
    max_context_tokens: AtLeastOne = 2**17    # 128k tokens; raise it for longer contexts
    max_conn_pending_bytes: ByteSize = ByteSize(0)   # request bytes in flight per connection
    #                                                  (0: one frame)
    max_total_pending_bytes: ByteSize = ByteSize(0)  # ... across connections (0: 4 frames)
    idle_timeout_s: Seconds = 600.0       # no request for this long: connection dropped (0: never)
    read_timeout_s: Seconds = 10.0        # a started frame (or the hello) must arrive within
    max_connections: AtLeastOne = 1024    # beyond: a typed refusal ("overloaded"), then close
    max_connections_per_client: AtLeastOne = 64   # open by one client process (by pid); an
    #                                       engine uses a few: a leak or a hoarder meets
    #                                       the same refusal before it takes them all
    max_namespaces: AtLeastOne = 4096     # registrations beyond evict the least recently used
    client_put_share: Fraction = 0.5      # of the arena, one client process may hold in open
    #                                       puts and quarantine (0 or 1: no bound); beyond
    #                                       it a put is granted fewer slots
    client_get_share: Fraction = 0.5      # of the arena, one client process may pin in open
    #                                       get leases (0 or 1: no bound); beyond it a get
    #                                       is granted its leading blocks only
    max_leases_per_client: AtLeastOne = 4096   # leases one client process holds open at
    #                                       once (each costs the daemon memory and sweep
    #                                       work, bytes or none); beyond: LimitExceeded
    dropped_writer_hold_s: Seconds = 3600.0   # a dropped client's leased slots, when its pid
    #                                       is unknown, stay quarantined this long
    listen_backlog: AtLeastOne = 4096     # connect bursts queue here (capped by somaxconn)
    gc_freeze: bool = True                # freeze long-lived objects, so Python's collector
    #                                       does not walk every block (kvtier.daemon.gc_guard)
    gc_full_s: Seconds = 3600.0           # then one collection over everything this often
    #                                       (0: never; docs/operations.md)
    gc_quiet_s: Seconds = 1.0             # ... once no request came for this long (waiting at
    #                                       most another gc_full_s; 0: do not wait)


@dataclass(slots=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: Port = 8470                     # 0 picks a free port (printed at start)
    admin_token: str = ""
    max_connections: AtLeastOne = 256     # beyond: a 503 and close (each request head and
    #                                       body must arrive within daemon.read_timeout_s)


@dataclass(slots=True)
class CpuConfig:
    bytes: ByteSize = ByteSize(2 * 2**30)
    shm_dir: Path = Path("/dev/shm")
    slab_bytes: ByteSize = ByteSize(64 * 2**20)
    prefault: bool = True
    warm_restart: bool = True             # keep the arena + a journal under a stable name
    #                                       per data dir: a restart after a crash adopts them


@dataclass(slots=True)
class NvmeConfig:
    enabled: bool = True
    bytes: ByteSize = ByteSize(16 * 2**30)
    path: Path | None = None              # default: <data_dir>/nvme
    direct: NvmeDirect = NvmeDirect.AUTO
    io_threads: AtLeastOne = 4            # threads doing the tier's disk I/O
    backend: NvmeBackend = NvmeBackend.AUTO
    write_budget_bytes_per_s: ByteSize = ByteSize(0)  # 0: unlimited (admission protects
    #                                                   endurance)
    backoff_min_s: Seconds = 0.5          # full or failing disk: first wait before a space
    backoff_max_s: Seconds = 30.0         # probe, doubling (with jitter) up to this


@dataclass(slots=True)
class RedisConfig:
    enabled: bool = False
    url: str = "redis://127.0.0.1:6379/0"  # redis://, rediss:// (TLS), unix://,
    #                                          redis+cluster:// (same as cluster = true)
    cluster: bool = False
    username: str = ""
    password: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_verify: bool = True
    key_prefix: str = "kvtier:"
    ttl_s: Count = 0                      # 0: no expiry
    max_connections: Count = 16
    codec: RedisCodec = RedisCodec.NONE
    write_through: bool = False           # also write puts through (not only demotions)
    write_queue_blocks: Count = 256       # bounded write-behind queue; full: drop oldest
    write_queue_copy_bytes: ByteSize = ByteSize(256 * 2**20)  # of the queue's own copies
    #                                       (demotions, writes while down); over: drop oldest
    max_inflight: Count = 8               # GET pipelines in flight per read ...
    inflight_bytes_per_server: ByteSize = ByteSize(8 * 2**20)  # GETs in flight per live
    #                                       server: about this many bytes, >= 2 pipelines
    write_inflight: Count = 1             # SET pipelines in flight (each spread over the
    #                                       servers): Redis ingests fastest from one
    connect_timeout_s: Seconds = 1.0
    op_timeout_s: Seconds = 2.0
    lookup_budget_s: Seconds = 0.1        # Redis part of a lookup/get on the request path:
    #                                       past it, a (counted) miss, never an op timeout
    bytes: ByteSize = ByteSize(0)         # 0: bounded by Redis maxmemory / TTL


@dataclass(slots=True)
class HbmConfig:
    enabled: bool = False                 # needs a CUDA device and the [gpu] extra
    bytes: ByteSize = ByteSize(0)         # device memory pool handed to engines by CUDA IPC
    device: Count = 0


@dataclass(slots=True)
class PolicyConfig:
    eviction: Eviction = Eviction.ADAPTIVE
    prefetch_wait: PrefetchWait = PrefetchWait.TIMEOUT
    prefetch_timeout_ms_per_block: Number = 2.0
    model_params: Number = 7e9            # for the recompute-cost model
    shadow_sample_rate: Fraction = 0.0    # adaptive: shadows' key sampling rate (0: auto)


@dataclass(slots=True)
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)
    nvme: NvmeConfig = field(default_factory=NvmeConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    hbm: HbmConfig = field(default_factory=HbmConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    @property
    def nvme_path(self) -> Path:
        return self.nvme.path or self.daemon.data_dir / "nvme"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (paths as text, enums as their values); secrets masked:
        the Redis password (also inside ``redis.url``) and the admin token."""
        from kvtier.config_convert import to_builtins

        out: dict[str, Any] = to_builtins(self)
        if out["redis"]["password"]:
            out["redis"]["password"] = "***"
        out["redis"]["url"] = _masked_url(out["redis"]["url"])
        if out["http"]["admin_token"]:
            out["http"]["admin_token"] = "***"
        return out


def http_base_url(host: str, port: int) -> str:
    """``http://HOST:PORT`` for the daemon's HTTP listener, an IPv6 literal in brackets
    (``http://[::1]:8470``): without them the port cannot be told from the address."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def daemon_url(url: str | None = None, config: str | Path | Config | None = None) -> str:
    """The daemon's HTTP base URL as every command that asks the daemon finds it (``stats``,
    ``explain``, ``doctor``): ``url`` (their ``--url``) when given, else ``http://HOST:PORT``
    of ``config``: a loaded Config, or the TOML file (``--config``) read with the
    environment (``KVTIER_HTTP_HOST``, ``KVTIER_HTTP_PORT``) over the defaults
    (127.0.0.1:8470). A KVTierError when the configuration cannot be read."""
    if url:
        return url
    cfg = config if isinstance(config, Config) else load_config(config)
    return http_base_url(cfg.http.host, cfg.http.port)


def _masked_url(url: str) -> str:
    """``url`` with the user info of its authority masked (``redis://***@host:port/0``)."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    if not sep or "@" not in authority:
        return url
    return f"{scheme}://***@{authority.rsplit('@', 1)[1]}{slash}{path}"


ENV_ALIASES = {
    "KVTIER_SOCKET": ("daemon", "socket"),
    "KVTIER_DATA_DIR": ("daemon", "data_dir"),
    "KVTIER_HTTP_HOST": ("http", "host"),
    "KVTIER_HTTP_PORT": ("http", "port"),
    "KVTIER_CPU_BYTES": ("cpu", "bytes"),
    "KVTIER_NVME_BYTES": ("nvme", "bytes"),
    "KVTIER_REDIS_URL": ("redis", "url"),
}


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> Config:
    """Build the config: defaults, then the TOML file, then env, then ``overrides``.

    ``overrides`` maps ``"section.field"`` to a value (what CLI flags set; None = unset).
    """
    from kvtier.config_checks import validate
    from kvtier.config_convert import build

    return build(Config, path, os.environ if env is None else env, overrides or {},
                 ENV_ALIASES, validate, implied)


def implied(values: dict[str, dict[str, Any]], source: dict[tuple[str, str], int]) -> None:
    """What the settings imply: a ``redis.url`` turns the Redis tier on, an ``nvme.bytes``
    of 0 turns the nvme tier off, unless ``enabled`` was set by a source as high (file <
    env < flags). A URL in the TOML file or ``KVTIER_REDIS_URL`` alone used to leave the
    tier off without a word (only ``--redis-url`` turned it on); and what a lower source
    implied must not outlive a higher one that changed the value it came from (a file's
    ``nvme.bytes = 0`` under ``--nvme-bytes 100GiB``)."""
    def above(section: str, name: str) -> bool:
        return source[(section, name)] > source.get((section, "enabled"), -1)

    redis, nvme = values["redis"], values["nvme"]
    if redis.get("url") and above("redis", "url"):
        redis["enabled"] = True
    if "bytes" in nvme and nvme["bytes"] == 0 and above("nvme", "bytes"):
        nvme["enabled"] = False
