"""Typed configuration of the vLLM connector, read once from ``kv_connector_extra_config``.

Everything an operator may set lives here with its default; unknown keys are refused so a
typo (``tokens_per_blok``) is an error at engine start, not a silent default. The KV
geometry (layers, heads, head size, dtype, page size) is not configurable: it comes from
vLLM's own ``KVCacheConfig`` (``geometry.py``), the same object on the scheduler and on
every worker, so both sides derive the identical layout and hence the same namespace.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError
from kvtier.keys import name_refusal
from kvtier.layout import default_tokens_per_block
from kvtier.weights import WEIGHTS_MARK

from .fingerprint import engine_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig

DEFAULT_MAX_INFLIGHT_SAVE_BYTES = 256 * 2**20
"""Saves copying at once at most (per worker); beyond it a save is dropped, not waited for."""
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
"""Recompute speed assumed until the engine's own prefill throughput has been measured."""
TIERS = ("hbm", "cpu", "nvme", "redis")
ROLES = ("kv_both", "kv_producer", "kv_consumer")
DEFAULT_REDIS_SYNC_TIMEOUT_S = 1.5
"""A producer's wait for its blocks to be visible in Redis, per save (below 90% of the
default ``timeout_s``, which bounds every daemon call)."""

_KEYS = frozenset({
    "socket_path", "tokens_per_block", "model_id", "namespace", "save_decode_tokens",
    "async_load", "timeout_s", "reconnect_min_s", "reconnect_max_s",
    "max_inflight_save_bytes", "prefill_tokens_per_s", "tier_bandwidth",
    "skip_slower_than_recompute", "device_loads", "redis_sync_timeout_s", "presence_filter",
    "model_fingerprint", "context_reuse",
})


def default_socket_path() -> Path:
    """The daemon's default socket: ``kvtier.config.default_socket_path()`` when it exists,
    else ``$KVTIER_SOCKET``, ``$XDG_RUNTIME_DIR/kvtier/kvtier.sock`` or
    ``/tmp/kvtier-$UID/kvtier.sock`` (the same rules, kept here for older cores)."""
    try:
        from kvtier.config import default_socket_path as core_default
    except ImportError:
        pass
    else:
        return Path(core_default())
    env = os.environ.get("KVTIER_SOCKET")
    if env:
        return Path(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "kvtier" / "kvtier.sock"
    return Path(f"/tmp/kvtier-{os.getuid()}") / "kvtier.sock"


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """What the connector needs besides vLLM's own config.

    ``tokens_per_block`` must be a multiple of vLLM's ``block_size`` (a kvtier block spans
    whole engine pages). ``model_id`` defaults to vLLM's model path/name; ``namespace``
    (optional) prefixes it so two deployments of one model can be kept apart.
    ``model_fingerprint``: ``auto`` (default) appends a fingerprint of the checkpoint's
    files and of the compute dtype, quantization and config overrides
    (``kvtier.weights``), so that KV of other weights under the same name is never
    served; another string is appended instead (a version the operator manages); ``off``
    appends nothing.
    ``save_decode_tokens`` also offloads KV of generated tokens (off by default: prompts are
    what gets reused). ``async_load`` loads in a background thread between scheduler steps
    (vLLM's ``WAITING_FOR_REMOTE_KVS`` path) instead of before the step's forward.
    ``timeout_s`` bounds every daemon call; reconnect attempts back off from
    ``reconnect_min_s`` to ``reconnect_max_s``.

    Data path (issue 11): ``max_inflight_save_bytes`` bounds the bytes of saves copying
    at once per worker (a save beyond it is dropped and counted, never waited for).
    ``skip_slower_than_recompute`` makes the scheduler load only the leading blocks whose
    reload time (block bytes over the daemon-measured bandwidth of the tier holding them,
    or ``tier_bandwidth[tier]`` bytes/s when configured) does not exceed their recompute
    time (tokens over the engine's measured prefill throughput, ``prefill_tokens_per_s``
    until measured). ``device_loads``: read blocks from the daemon's HBM pool as device
    views (default: when the engine's KV caches are on a GPU). ``presence_filter``: answer
    a lookup without a round trip when the daemon's presence filter shows it can add
    nothing beyond vLLM's own prefix cache (kvtier.presence; counted in
    ``lookups_without_round_trip``).

    Prefill/decode (issue 15, docs/pd-disaggregation.md): ``role`` is vLLM's ``kv_role``.
    ``kv_producer`` saves every full prompt block (a loaded prefix too), never drops a save
    for lack of room, and finishes a step only once its saves are committed with a
    synchronous write-through to Redis, bounded by ``redis_sync_timeout_s`` per save (and
    by 90% of ``timeout_s``); ``kv_consumer`` loads and never saves; ``kv_both`` does both,
    off the critical path.

    ``context_reuse``: ``auto`` (default) loads into an engine unless vLLM itself turned
    context reuse off for its platform and model (``engine_reuses_context``: vLLM's CPU
    platform does for MLA models, whose attention over a cached context is its reference
    path and gives other tokens than a full prefill); ``on`` loads anyway (tests of the
    data path); ``off`` never loads. Saves are unchanged.
    """

    socket_path: Path
    tokens_per_block: int
    model_id: str
    save_decode_tokens: bool = False
    async_load: bool = False
    timeout_s: float = 2.0
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 10.0
    max_inflight_save_bytes: int = DEFAULT_MAX_INFLIGHT_SAVE_BYTES
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    tier_bandwidth: dict[str, float] = field(default_factory=dict)
    skip_slower_than_recompute: bool = True
    device_loads: bool | None = None
    role: str = "kv_both"
    redis_sync_timeout_s: float = DEFAULT_REDIS_SYNC_TIMEOUT_S
    presence_filter: bool = True
    context_reuse: str = "auto"

    @property
    def saves(self) -> bool:
        """Whether this engine offloads KV at all (a consumer never does)."""
        return self.role != "kv_consumer"

    @property
    def producer(self) -> bool:
        """Whether saves are synchronous, complete and written through to Redis."""
        return self.role == "kv_producer"

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, *, block_size: int,
                   default_model_id: str, role: str | None = None,
                   weights: Callable[[], str] | None = None) -> ConnectorConfig:
        """Validate ``kv_connector_extra_config`` (and vLLM's ``kv_role``, None meaning
        ``kv_both``); a bad value raises ``ConfigError``. ``weights`` computes the
        checkpoint's fingerprint (``model_fingerprint = "auto"``; None: there is none)."""
        role = role or "kv_both"
        if role not in ROLES:
            raise ConfigError(f"kv_role {role!r} is not one KVTierConnector knows; use one "
                              f"of {list(ROLES)}")
        extra = dict(extra or {})
        unknown = set(extra) - _KEYS
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {sorted(unknown)}; "
                              f"KVTierConnector accepts {sorted(_KEYS)}")
        tpb = _positive_int(extra, "tokens_per_block",
                            default_tokens_per_block(block_size))
        if tpb % block_size:
            raise ConfigError(f"tokens_per_block={tpb} must be a multiple of vLLM's "
                              f"block_size={block_size}; use e.g. "
                              f"{default_tokens_per_block(block_size)}")
        model_id = str(extra.get("model_id") or default_model_id)
        prefix = extra.get("namespace")
        if prefix:
            model_id = f"{prefix}/{model_id}"
        mode = extra.get("model_fingerprint", "auto")
        if not isinstance(mode, str) or not mode or WEIGHTS_MARK in mode:
            raise ConfigError(f"model_fingerprint={mode!r}: use 'auto', 'off' or a "
                              "version string of your own")
        mark = (weights() if weights is not None else None) if mode == "auto" else \
            None if mode == "off" else mode
        if mark:
            model_id = f"{model_id}{WEIGHTS_MARK}{mark}"
        _check_model_id(model_id)
        socket = extra.get("socket_path")
        min_s = _positive_float(extra, "reconnect_min_s", 0.5)
        return cls(
            socket_path=Path(socket) if socket else default_socket_path(),
            tokens_per_block=tpb,
            model_id=model_id,
            save_decode_tokens=_flag(extra, "save_decode_tokens", False),
            async_load=_flag(extra, "async_load", False),
            timeout_s=_positive_float(extra, "timeout_s", 2.0),
            reconnect_min_s=min_s,
            reconnect_max_s=max(min_s, _positive_float(extra, "reconnect_max_s", 10.0)),
            max_inflight_save_bytes=_positive_int(extra, "max_inflight_save_bytes",
                                                  DEFAULT_MAX_INFLIGHT_SAVE_BYTES),
            prefill_tokens_per_s=_positive_float(extra, "prefill_tokens_per_s",
                                                 DEFAULT_PREFILL_TOKENS_PER_S),
            tier_bandwidth=_tier_bandwidth(extra.get("tier_bandwidth")),
            skip_slower_than_recompute=_flag(extra, "skip_slower_than_recompute", True),
            presence_filter=_flag(extra, "presence_filter", True),
            device_loads=_auto_flag(extra, "device_loads"),
            role=role,
            redis_sync_timeout_s=_positive_float(extra, "redis_sync_timeout_s",
                                                 DEFAULT_REDIS_SYNC_TIMEOUT_S),
            context_reuse=_choice(extra, "context_reuse", ("auto", "on", "off")),
        )

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> ConnectorConfig:
        """Read the connector's section of a vLLM config."""
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config if transfer is not None else {}
        model = vllm_config.model_config
        return cls.from_extra(extra, block_size=vllm_config.cache_config.block_size,
                              default_model_id=str(model.model),
                              role=getattr(transfer, "kv_role", None),
                              weights=lambda: engine_fingerprint(
                                  model, getattr(vllm_config, "speculative_config", None),
                                  getattr(vllm_config, "cache_config", None),
                                  getattr(vllm_config, "load_config", None)))


def _choice(extra: dict[str, Any], key: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (the first by default)."""
    value = extra.get(key, choices[0])
    if value not in choices:
        raise ConfigError(f"kv_connector_extra_config.{key} must be one of "
                          f"{', '.join(map(repr, choices))}, got {value!r}")
    return str(value)


def _positive_int(extra: dict[str, Any], key: str, default: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"kv_connector_extra_config.{key} must be a positive int, "
                          f"got {value!r}")
    return value


def _positive_float(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"kv_connector_extra_config.{key} must be a positive number, "
                          f"got {value!r}")
    return float(value)


def _tier_bandwidth(value: Any) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict) or any(k not in TIERS for k in value) or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0
            for v in value.values()):
        raise ConfigError(f"kv_connector_extra_config.tier_bandwidth must map tiers "
                          f"{list(TIERS)} to positive bytes/s, got {value!r}")
    return {str(k): float(v) for k, v in value.items()}


def _auto_flag(extra: dict[str, Any], key: str) -> bool | None:
    value = extra.get(key, "auto")
    if value == "auto" or value is None:
        return None
    if not isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config.{key} must be true, false or "
                          f'"auto", got {value!r}')
    return value


def _flag(extra: dict[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config.{key} must be true or false, "
                          f"got {value!r}")
    return value


def _check_model_id(model_id: str) -> None:
    """Refuse at start a model id the daemon would refuse at every register_layout (over
    ``MAX_NAME_CHARS`` with its namespace and weights mark, or not valid Unicode): each
    lookup and save of the engine was a refused round trip and a warning (found by
    review)."""
    reason = name_refusal(model_id)
    if reason is not None:
        raise ConfigError(f"kvtier model_id (with its namespace and weights mark) is "
                          f"{reason}: set a shorter or valid model_id (or namespace) in "
                          "kv_connector_extra_config")
