"""Typed configuration of the vLLM connector, read once from ``kv_connector_extra_config``.

Everything an operator may set lives here with its default; unknown keys are refused so a
typo (``tokens_per_blok``) is an error at engine start, not a silent default. The KV
geometry (layers, heads, head size, dtype, page size) is not configurable: it comes from
vLLM's own ``KVCacheConfig``, the same object on the scheduler and on every worker, so both
sides derive the identical :class:`~kvtier.layout.KVLayout` and hence the same namespace.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

from kvtier.errors import ConfigError
from kvtier.layout import CANONICAL_FORMAT, KVLayout, default_tokens_per_block
from kvtier.weights import WEIGHTS_MARK, fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

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
    "model_fingerprint",
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
                                  getattr(vllm_config, "cache_config", None)))


def check_parallelism(parallel: Any) -> None:
    """Refuse the parallel layouts the connector cannot key correctly (``ConfigError`` at
    engine start, never wrong KV later): pipeline stages hold other layers under the same
    layout, and context parallelism shards a page's tokens across ranks, where the page <->
    block mapping assumes whole pages of consecutive tokens on every rank."""
    if int(getattr(parallel, "pipeline_parallel_size", 1) or 1) > 1:
        raise ConfigError("KVTierConnector does not support pipeline parallelism yet")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(parallel, name, 1) or 1) > 1:
            raise ConfigError(f"KVTierConnector does not support context parallelism yet "
                              f"({name}={getattr(parallel, name)}); run without it")


def total_kv_heads(vllm_config: VllmConfig) -> int:
    """The model's KV heads, all ranks together (0 when vLLM cannot say): with fewer than
    TP ranks, vLLM gives each to several ranks, which then hold the same KV."""
    model = getattr(vllm_config, "model_config", None)
    try:
        heads = model.get_total_num_kv_heads() if model is not None else 0
    except Exception:   # a config vLLM builds no architecture for: keyed per rank
        return 0
    return heads if isinstance(heads, int) and heads > 0 else 0


def engine_fingerprint(model: Any, speculative: Any = None, cache: Any = None) -> str:
    """The weights fingerprint of a vLLM ``ModelConfig``: its checkpoint, revision, dtype,
    quantization and ``hf_overrides`` (a callable override counts by its name); with a
    draft model (``speculative``), its fingerprint too: a draft's layers share the engine's
    KV pages, so its weights decide part of every block.

    Also what else changes the KV the same weights compute (each found giving wrong tokens
    when left out): the KV cache dtype of ``cache`` (every fp8 variant is stored as uint8,
    so the layout cannot tell e4m3 from e5m2), a config given apart from the checkpoint
    (``hf_config_path``), and for LongRoPE models (Phi-3/3.5, Phi-4-mini) whether
    ``max_model_len`` selects the long factors for every token."""
    overrides = model.hf_overrides
    if callable(overrides):
        overrides = {"callable": getattr(overrides, "__qualname__", type(overrides).__name__)}
    settings = dict(overrides) if isinstance(overrides, Mapping) else {}
    draft = getattr(speculative, "draft_model_config", None)
    if draft is not None and getattr(draft, "model", None):
        settings["kvtier.draft"] = [str(getattr(speculative, "method", None)),
                                    engine_fingerprint(draft)]
    cache_dtype = str(getattr(cache, "cache_dtype", None) or "auto")
    if cache_dtype != "auto":
        settings["kvtier.kv_cache_dtype"] = cache_dtype
    config_path = getattr(model, "hf_config_path", None)
    if config_path and str(config_path) != str(model.model):
        settings["kvtier.hf_config"] = fingerprint(str(config_path))
    long_rope = _long_rope(model)
    if long_rope is not None:
        settings["kvtier.long_rope"] = long_rope
    return fingerprint(str(model.model), revision=model.revision, dtype=model.dtype,
                       quantization=model.quantization, overrides=settings or None)


def _long_rope(model: Any) -> bool | None:
    """For a LongRoPE model, whether vLLM uses the long factors (``max_model_len`` beyond
    the original context): the rotary embedding of every token, so the KV, depends on it.
    None for any other rope."""
    cfg = getattr(model, "hf_text_config", None)
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if not isinstance(params, Mapping) or \
            params.get("rope_type", params.get("type")) != "longrope":
        return None
    original = params.get("original_max_position_embeddings",
                          getattr(cfg, "original_max_position_embeddings", None))
    max_len = getattr(model, "max_model_len", None)
    if not isinstance(original, int) or not isinstance(max_len, int):
        return True   # undecidable here: its own namespace, never another's KV
    return max_len > original


class _AttentionSpec(Protocol):
    """What the layout reads of vLLM's attention KV cache spec (``AttentionSpec``)."""

    num_kv_heads: int
    head_size: int
    dtype: object
    block_size: int


def _is_attention_spec(spec: object) -> TypeGuard[_AttentionSpec]:
    """The attention fields the layout reads are there."""
    return all(hasattr(spec, a) for a in ("num_kv_heads", "head_size", "dtype", "block_size"))


KEEPS_EVERY_TOKEN = {"FullAttentionSpec": 2, "MLAAttentionSpec": 1}
"""vLLM's KV cache specs whose pages keep every token of a request while it runs (vLLM
gives them its full-attention manager), by exact class, and the components per token (K
and V, or an MLA latent). A subclass is another format (an R-SWA cache evicts pages of
generated tokens, a sink cache holds learned sinks): refused until it is checked."""


def layout_from_kv_cache_config(kv_cache_config: KVCacheConfig,
                                tokens_per_block: int) -> tuple[KVLayout, int]:
    """The kvtier layout of this engine's (per-rank) KV cache, and vLLM's page size.

    One KV cache group whose pages keep every token (``KEEPS_EVERY_TOKEN``): block keys
    are a chain over token chunks. Sliding-window and chunked-local layers qualify when
    vLLM allocates them as full attention (a model that mixes them with full-attention
    layers, run without vLLM's hybrid KV cache manager, as vLLM runs it with a connector
    that does not declare support for it): their pages keep every token, the window
    only limits what attention reads. An MLA latent cache (DeepSeek-V2/V3, Kimi K2: one
    vector per token and layer, no separate V) is one component per token; its cache
    dtype, when not the model's (vLLM's packed fp8 MLA formats), is part of ``kv_format``.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"KVTierConnector supports models with one KV cache group; this "
                          f"engine has {len(groups)} (a hybrid model under vLLM's hybrid KV "
                          f"cache manager, or a separate indexer cache): run it with "
                          f"--disable-hybrid-kv-cache-manager if its layers are all "
                          f"attention layers")
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    components = KEEPS_EVERY_TOKEN.get(kind)
    if components is None or not _is_attention_spec(spec):
        raise ConfigError(f"KVTierConnector supports KV caches whose pages keep every token "
                          f"({', '.join(KEEPS_EVERY_TOKEN)}); this model's is {kind}"
                          + (" (sliding-window or chunked-local pages are dropped as the "
                             "window moves)" if "Window" in kind or "Chunked" in kind
                             else ""))
    if getattr(spec, "non_causal", False):
        raise ConfigError("KVTierConnector needs causal attention: with non-causal layers "
                          "a token's KV depends on the tokens after it, not on its prefix")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise ConfigError(f"KVTierConnector needs one KV entry per token; this model keeps "
                          f"one per {1 / spec.tokens_per_state} tokens")  # type: ignore[attr-defined]
    kv_format = CANONICAL_FORMAT
    head_v = getattr(spec, "head_size_v", None) or spec.head_size
    if components == 1:
        cache_dtype = getattr(spec, "cache_dtype_str", None)
        if cache_dtype not in (None, "auto"):
            kv_format = f"{CANONICAL_FORMAT}:{cache_dtype}"
    elif head_v != spec.head_size:
        raise ConfigError(f"KVTierConnector needs K and V of the same head size, this "
                          f"model's are {spec.head_size} and {head_v}")
    layout = KVLayout(
        num_layers=len(groups[0].layer_names),
        num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        dtype=str(spec.dtype).removeprefix("torch."),
        tokens_per_block=tokens_per_block,
        kv_components=components,
        kv_format=kv_format,
    )
    return layout, int(spec.block_size)


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
