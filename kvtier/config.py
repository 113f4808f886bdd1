"""One typed config tree: embedded defaults < TOML file < env ``KVTIER_*`` < CLI flags.

Sections mirror the daemon's parts (``[daemon]``, ``[http]``, ``[cpu]``, ``[nvme]``,
``[redis]``, ``[policy]``). Env names are ``KVTIER_<SECTION>_<FIELD>`` (for example
``KVTIER_CPU_BYTES=8GiB``, ``KVTIER_REDIS_URL=redis://...``); a few short aliases exist for
the most used settings (``KVTIER_SOCKET``, ``KVTIER_DATA_DIR``). Sizes accept ``4GiB``,
``512MiB``, ``1e9``. Every value is checked once here, so the rest of the code trusts it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pwd
import re
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kmgtp]?i?b?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "ki": 2**10, "kib": 2**10,
          "m": 10**6, "mb": 10**6, "mi": 2**20, "mib": 2**20, "g": 10**9, "gb": 10**9,
          "gi": 2**30, "gib": 2**30, "t": 10**12, "tb": 10**12, "ti": 2**40, "tib": 2**40}


def parse_size(value: object) -> int:
    """Parse ``4GiB`` / ``512MB`` / ``1e9`` / an int into bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"size must be >= 0, got {value}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"not a size: {value!r}")
        return parse_size(int(value))
    m = _SIZE_RE.match(str(value))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ConfigError(f"not a size: {value!r} (examples: 4GiB, 512MiB, 1e9)")
    number = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if not math.isfinite(number):  # "1e999": int(inf) would raise OverflowError
        raise ConfigError(f"size out of range: {value!r}")
    return int(number)


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
    """Where clients look for the daemon when nothing else is configured."""
    environ = os.environ if env is None else env
    explicit = environ.get("KVTIER_SOCKET") or environ.get("KVTIER_DAEMON_SOCKET")
    return Path(explicit) if explicit else default_runtime_dir(environ) / "kvtier.sock"


TRUSTED_UIDS_ENV = "KVTIER_TRUSTED_UIDS"


def trusted_daemon_uids(env: Mapping[str, str] | None = None) -> frozenset[int]:
    """Uids besides the client's own whose daemon a client may talk to.

    From ``KVTIER_TRUSTED_UIDS``: uids or user names separated by commas or spaces (for
    example a ``kvtier`` system user that runs the node daemon). Empty: only our own uid.
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
    """Per-user data directory for the nvme tier ($XDG_DATA_HOME/kvtier)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "kvtier"


@dataclass(slots=True)
class DaemonConfig:
    data_dir: Path = field(default_factory=default_data_dir)
    socket: Path = field(default_factory=default_socket_path)
    max_frame_bytes: int = 16 * 2**20     # control frames only: KV bytes never cross here
    max_inflight_per_conn: int = 64       # bounded per-connection request queue
    lease_ttl_s: float = 30.0             # a lease not released/committed by then expires
    lease_sweep_s: float = 1.0            # how often expired leases are taken back
    drain_timeout_s: float = 10.0
    log_level: str = "info"
    # Bounded work (docs/operations.md, "Limits"): keys per request <= ceil(max_context_tokens
    # / tokens_per_block) of the request's namespace; pending bytes 0 = derived from the frame.
    max_context_tokens: int = 2**17      # 128k tokens; raise it for longer contexts
    max_conn_pending_bytes: int = 0       # request bytes in flight per connection (0: 1 frame)
    max_total_pending_bytes: int = 0      # ... across connections (0: 4 frames)
    idle_timeout_s: float = 600.0         # no request for this long: connection dropped (0: never)
    read_timeout_s: float = 10.0          # a started frame (or the hello) must arrive within
    max_connections: int = 1024           # beyond: a typed refusal ("overloaded"), then close
    max_namespaces: int = 4096            # registrations beyond evict the least recently used
    listen_backlog: int = 4096            # connect bursts queue here (capped by somaxconn)


@dataclass(slots=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8470                      # 0 picks a free port (printed at start)
    admin_token: str = ""


@dataclass(slots=True)
class CpuConfig:
    bytes: int = 2 * 2**30
    shm_dir: Path = Path("/dev/shm")
    slab_bytes: int = 64 * 2**20
    prefault: bool = True
    warm_restart: bool = True             # keep the arena + a journal under a stable name
    #                                       per data dir: a restart after a crash adopts them


@dataclass(slots=True)
class NvmeConfig:
    enabled: bool = True
    bytes: int = 16 * 2**30
    path: Path | None = None              # default: <data_dir>/nvme
    direct: str = "auto"                  # auto | on | off (O_DIRECT)
    io_threads: int = 4
    backend: str = "auto"                 # auto | posix | kvikio
    write_budget_bytes_per_s: int = 0     # 0: unlimited (admission protects endurance)
    backoff_min_s: float = 0.5            # full or failing disk: first wait before a space
    backoff_max_s: float = 30.0           # probe, doubling (with jitter) up to this


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
    ttl_s: int = 0                        # 0: no expiry
    max_connections: int = 16
    codec: str = "none"                   # none | lz4 | shuffle-lz4 | shuffle-zstd | auto
    write_through: bool = False           # also write puts through (not only demotions)
    write_queue_blocks: int = 256         # bounded write-behind queue; full: drop oldest
    max_inflight: int = 8                 # bounded concurrent pipelines
    connect_timeout_s: float = 1.0
    op_timeout_s: float = 2.0
    lookup_budget_s: float = 0.1          # Redis part of a lookup/get on the request path:
    #                                       past it, a (counted) miss, never an op timeout
    bytes: int = 0                        # 0: bounded by Redis maxmemory / TTL


@dataclass(slots=True)
class HbmConfig:
    enabled: bool = False                 # needs a CUDA device and the [gpu] extra
    bytes: int = 0                        # device memory pool handed to engines by CUDA IPC
    device: int = 0


@dataclass(slots=True)
class PolicyConfig:
    eviction: str = "adaptive"            # adaptive | lru | lfu | cost
    prefetch_wait: str = "timeout"        # best_effort | wait | timeout
    prefetch_timeout_ms_per_block: float = 2.0
    model_params: float = 7e9             # for the recompute-cost model
    shadow_sample_rate: float = 0.0       # adaptive: shadows' key sampling rate (0: auto)


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
        out: dict[str, Any] = {}
        for sec in fields(self):
            section = getattr(self, sec.name)
            out[sec.name] = {f.name: _plain(getattr(section, f.name)) for f in fields(section)}
        if out["redis"]["password"]:
            out["redis"]["password"] = "***"
        return out


ENV_ALIASES = {
    "KVTIER_SOCKET": ("daemon", "socket"),
    "KVTIER_DATA_DIR": ("daemon", "data_dir"),
    "KVTIER_HTTP_HOST": ("http", "host"),
    "KVTIER_HTTP_PORT": ("http", "port"),
    "KVTIER_CPU_BYTES": ("cpu", "bytes"),
    "KVTIER_NVME_BYTES": ("nvme", "bytes"),
    "KVTIER_REDIS_URL": ("redis", "url"),
}


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def _coerce(section: str, name: str, typ: Any, value: Any) -> Any:
    where = f"{section}.{name}"
    t = str(typ)
    try:
        if name == "bytes" or name.endswith("_bytes") or name.endswith("bytes_per_s"):
            try:
                return parse_size(value)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        if "bool" in t:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if "Path" in t:
            return None if value in (None, "") and "None" in t else Path(str(value)).expanduser()
        if t in ("int", "<class 'int'>"):
            if isinstance(value, bool):
                raise ValueError(value)
            number = int(value)
            if number < 0:  # every int setting is a count, a port or a TTL
                raise ValueError(value)
            return number
        if t in ("float", "<class 'float'>"):
            if isinstance(value, bool):
                raise ValueError(value)
            real = float(value)
            # nan would make every deadline comparison false (leases never expire)
            if not math.isfinite(real) or real < 0:
                raise ValueError(value)
            return real
        return str(value)
    except (ValueError, TypeError, OverflowError):
        raise ConfigError(f"{where}: invalid value {value!r} (expected {t})") from None


def _apply(cfg: Config, section: str, name: str, value: Any, source: str) -> None:
    sec = getattr(cfg, section, None)
    if sec is None or not dataclasses.is_dataclass(sec):
        raise ConfigError(f"{source}: unknown section [{section}]")
    types = {f.name: f.type for f in fields(sec)}
    if name not in types:
        raise ConfigError(f"{source}: unknown setting {section}.{name}; "
                          f"known: {', '.join(sorted(types))}")
    setattr(sec, name, _coerce(section, name, types[name], value))


def load_config(path: str | Path | None = None, env: dict[str, str] | None = None,
                overrides: dict[str, Any] | None = None) -> Config:
    """Build the config: defaults, then the TOML file, then env, then ``overrides``.

    ``overrides`` maps ``"section.field"`` to a value (what CLI flags set; None = unset).
    """
    cfg = Config()
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} not found") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p}: {exc}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{p}: top-level key {section!r} must be a [section]")
            for name, value in values.items():
                _apply(cfg, section, name, value, str(p))
    environ = os.environ if env is None else env
    section_names = {f.name for f in fields(cfg)}
    for key, value in sorted(environ.items()):
        if not key.startswith("KVTIER_"):
            continue
        if key in ENV_ALIASES:
            section, name = ENV_ALIASES[key]
        else:
            rest = key[len("KVTIER_"):].lower()
            section, _, name = rest.partition("_")
            if section not in section_names or not name:
                continue  # not ours (e.g. KVTIER_TEST_*): ignore rather than fail
        _apply(cfg, section, name, value, f"env {key}")
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, name = dotted.partition(".")
        _apply(cfg, section, name, value, f"flag {dotted}")
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-field checks with messages that say what to change."""
    if cfg.cpu.bytes < cfg.cpu.slab_bytes and cfg.cpu.bytes > 0:
        cfg.cpu.slab_bytes = max(cfg.cpu.bytes, 4096)
    if cfg.daemon.lease_sweep_s <= 0:
        raise ConfigError("daemon.lease_sweep_s must be > 0 (seconds between lease sweeps)")
    if cfg.cpu.bytes <= 0:
        raise ConfigError("cpu.bytes must be > 0: the cpu tier is the staging tier")
    if cfg.nvme.direct not in ("auto", "on", "off"):
        raise ConfigError("nvme.direct must be auto, on or off")
    if cfg.nvme.backend not in ("auto", "posix", "kvikio"):
        raise ConfigError("nvme.backend must be auto, posix or kvikio")
    if not 0 < cfg.nvme.backoff_min_s <= cfg.nvme.backoff_max_s:
        raise ConfigError("nvme.backoff_min_s must be > 0 and <= nvme.backoff_max_s")
    if cfg.redis.codec not in ("none", "lz4", "shuffle-lz4", "shuffle-zstd", "auto"):
        raise ConfigError("redis.codec must be none, lz4, shuffle-lz4, shuffle-zstd or auto")
    if cfg.redis.lookup_budget_s <= 0:
        raise ConfigError("redis.lookup_budget_s must be > 0 (e.g. 0.1: well under the "
                          "connector's step timeout)")
    if cfg.policy.eviction not in ("adaptive", "lru", "lfu", "cost"):
        raise ConfigError("policy.eviction must be adaptive, lru, lfu or cost")
    if not 0.0 <= cfg.policy.shadow_sample_rate <= 1.0:
        raise ConfigError("policy.shadow_sample_rate must be in [0, 1] (0: automatic)")
    if cfg.policy.prefetch_wait not in ("best_effort", "wait", "timeout"):
        raise ConfigError("policy.prefetch_wait must be best_effort, wait or timeout")
    d = cfg.daemon
    for name in ("max_context_tokens", "max_connections", "max_namespaces", "listen_backlog",
                 "max_frame_bytes", "max_inflight_per_conn"):
        if getattr(d, name) < 1:
            raise ConfigError(f"daemon.{name} must be >= 1")
    if d.read_timeout_s <= 0:
        raise ConfigError("daemon.read_timeout_s must be > 0 (a half-sent frame must not hold "
                          "a connection for ever)")
    if not 0 <= cfg.http.port <= 65535:
        raise ConfigError(f"http.port {cfg.http.port} out of range")
