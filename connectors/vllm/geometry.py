"""What the engine's KV cache looks like, read from vLLM's own objects: the kvtier layout of
one rank's pages (``KVCacheConfig``) and the page format of its tensors, which ranks hold
the same KV, the parallel layouts the connector refuses, and whether vLLM lets the engine
compute on a cached context. Every check here runs at engine start: a geometry the
connector cannot key correctly is an error then, never wrong KV later.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

from kvtier.kernels.layouts import PagedLayout

from kvtier.errors import ConfigError, LayoutMismatch
from kvtier.layout import CANONICAL_FORMAT, KVLayout

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig


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


def tp_replicas(kv_cache_config: Any, layout: KVLayout, tp_size: int) -> int:
    """How many consecutive TP ranks hold identical KV for every layer: vLLM's own
    ``KVCacheConfig.kv_tp_replicas`` (from each layer's ``max_tp_shards``: every rank for an
    MLA latent; 1 for K and V heads, whose replication vLLM does not vouch for, since a
    model's layers may hold different KV-head counts under one per-rank spec). Without
    that field (an older vLLM), every rank for an MLA latent, else 1."""
    replicas = getattr(kv_cache_config, "kv_tp_replicas", None)
    if isinstance(replicas, int) and not isinstance(replicas, bool) and replicas >= 1:
        return replicas if tp_size % replicas == 0 else 1
    return tp_size if layout.kv_components == 1 else 1


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
    if not groups:
        raise ConfigError("KVTierConnector has nothing to serve: this model keeps no KV "
                          "cache (an encoder-only or attention-free model); run it "
                          "without --kv-transfer-config")
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
        why = ""
        if "Window" in kind or "Chunked" in kind:
            why = " (sliding-window or chunked-local pages are dropped as the window moves)"
        if kind == "SlidingWindowSpec":
            why += ("; to use kvtier, serve it with --disable-sliding-window (vLLM then caps "
                    "max_model_len at the window, and every page keeps its tokens)")
        raise ConfigError(f"KVTierConnector supports KV caches whose pages keep every token "
                          f"({', '.join(KEEPS_EVERY_TOKEN)}); this model's is {kind}{why}")
    if getattr(spec, "non_causal", False):
        raise ConfigError("KVTierConnector needs causal attention: with non-causal layers "
                          "a token's KV depends on the tokens after it, not on its prefix")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise ConfigError(f"KVTierConnector needs one KV entry per token; this model keeps "
                          f"one per {1 / spec.tokens_per_state} tokens")  # type: ignore[attr-defined]
    kv_format = CANONICAL_FORMAT
    if components == 1:
        cache_dtype = getattr(spec, "cache_dtype_str", None)
        if cache_dtype not in (None, "auto"):
            kv_format = f"{CANONICAL_FORMAT}:{cache_dtype}"
    elif (head_v := getattr(spec, "head_size_v", None) or spec.head_size) != spec.head_size:
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


def with_engine_page_format(layout: KVLayout, vllm_config: Any, block_size: int) -> KVLayout:
    """``layout`` with the page format of a CPU engine's K|V cache in its ``kv_format``.

    vLLM's CPU attention writes K in a layout of its kernel's own (the ISA it picks for the
    model's dtype, head size and page size: ``vec``, ``vec16``, ``amx``, ``neon``, ...): at
    a page of 64 tokens or more the ``vec`` kernel interleaves K rows in groups of 32
    tokens. The worker copies pages verbatim, so an engine reloads its own KV exactly, but
    the bytes are not another engine's: a CPU engine with 128-token pages loaded what one
    with 32-token pages saved and gave wrong tokens (found by review). CPU engines
    therefore share KV only with engines of the same kernel and page size (a node of
    another CPU kind, through Redis, included); GPU engines and MLA latents keep the
    canonical format."""
    if layout.kv_components != 2 or layout.kv_format != CANONICAL_FORMAT:
        return layout
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return layout
    except Exception:   # no platform to ask (the worker side driven without vLLM)
        return layout
    isa = _cpu_attention_isa(vllm_config, layout, block_size)
    return replace(layout, kv_format=f"{CANONICAL_FORMAT}@cpu:{isa}:{block_size}")


def with_cache_dtype(layout: KVLayout, vllm_config: Any) -> KVLayout:
    """``layout`` with vLLM's ``kv_cache_dtype`` in its ``kv_format`` when the cache stores
    K and V in another dtype than it names: every fp8 variant is stored as uint8, so the
    layout alone cannot tell e4m3 from e5m2, and with ``model_fingerprint`` "off" or a
    version string (no weights fingerprint to name the cache dtype) two such engines
    would share KV (found by review). An MLA layout names its cache dtype already."""
    cache = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)
    if layout.kv_components != 2 or not isinstance(cache, str) or cache in ("auto",
                                                                             layout.dtype):
        return layout
    return replace(layout, kv_format=f"{layout.kv_format}:{cache}")


def _cpu_attention_isa(vllm_config: Any, layout: KVLayout, block_size: int) -> str:
    """The kernel vLLM's CPU attention picks for this engine (its own choice, asked the way
    its metadata builder asks), or this machine's kind when that cannot be asked."""
    import torch

    model = getattr(vllm_config, "model_config", None)
    dtype: Any = getattr(model, "dtype", None) or getattr(torch, layout.dtype, None)
    cache = getattr(vllm_config, "cache_config", None)
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, block_size, layout.head_dim,
                                 getattr(cache, "cache_dtype", None)))
    except Exception:
        import platform

        amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
        return f"{platform.machine()}{'-amx' if amx else ''}"


def context_reuse_refused(vllm_config: Any) -> str | None:
    """Why vLLM never computes this model on a cached context (its
    ``ModelConfig.is_prefix_caching_supported``), or None. Pooling models with MEAN, CLS
    or STEP pooling pool over every prompt token in one prefill: with a loaded prefix the
    pooler raised "partial prefill is not supported with MEAN pooling" and the engine core
    died (vLLM turns its own prefix cache off for them, and leaves their requests'
    ``skip_reading_prefix_cache`` unset; found by review)."""
    model = getattr(vllm_config, "model_config", None)
    try:
        supported = getattr(model, "is_prefix_caching_supported", True)
    except Exception:   # (a config vLLM could not answer for: as if supported)
        return None
    if supported is not False:
        return None
    pooler = getattr(model, "pooler_config", None)
    pooling = getattr(pooler, "seq_pooling_type", None) or getattr(pooler, "pooling_type",
                                                                    None)
    what = f"a pooling model with {pooling} pooling" if pooling else \
        f"a model of attention type {getattr(model, 'attn_type', None)!r}"
    return f"vLLM does not support prefix caching for this model ({what})"


def context_loads(mode: str, vllm_config: Any, layout: KVLayout) -> tuple[bool, str]:
    """Whether an engine loads under ``context_reuse`` ``mode``, and why not ("" when it
    does, or when ``mode`` "off" is the only reason). "on" forces loads past vLLM's CPU
    MLA test, but is refused (ConfigError) where vLLM caches no prefix at all: a loaded
    prefix fails every request it reaches there."""
    refused = context_reuse_refused(vllm_config)
    if mode == "on" and refused:
        raise ConfigError(f"KVTierConnector: context_reuse \"on\" cannot load here: "
                          f"{refused}, so a loaded prefix fails its requests; use "
                          f"\"auto\" (saves only)")
    if mode == "on" or (mode == "auto" and engine_reuses_context(vllm_config, layout)):
        return True, ""
    if mode != "auto":   # the operator's choice, whatever else holds
        return False, ""
    return False, refused or ("vLLM runs this MLA model on its reference CPU attention "
                              "and keeps context reuse off for it")


def engine_reuses_context(vllm_config: Any, layout: KVLayout) -> bool:
    """Whether vLLM lets this engine compute on a cached context: not for a model it
    supports no prefix caching for (``context_reuse_refused``). Its CPU platform runs MLA
    models on a reference attention unless an AMX MLA kernel (or DeepSeek-V4's) serves
    them, and then turns prefix caching off: that attention over a cached context is not
    its production path (on vLLM 0.32 it gives other tokens than a full prefill, with
    vLLM's own prefix cache forced on as with loaded KV). This follows the same test as
    ``vllm/platforms/cpu.py``, so an engine whose operator turned prefix caching off still
    loads."""
    if context_reuse_refused(vllm_config) is not None:
        return False
    if layout.kv_components != 1:
        return True
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return True
        return not _reference_cpu_mla(vllm_config, current_platform)
    except Exception:   # no platform to ask: as vLLM configured the cache
        cache = getattr(vllm_config, "cache_config", None)
        return bool(getattr(cache, "enable_prefix_caching", True))


def _reference_cpu_mla(vllm_config: Any, platform: Any) -> bool:
    """vLLM's CPU platform keeps context reuse off for an MLA model unless AMX kernels
    serve it: its AMX MLA kernel (x86 with AMX tiles, the reference ``CPU_MLA`` backend not
    asked for by name), or DeepSeek-V4's own on such a CPU."""
    import torch
    from vllm.platforms.interface import CpuArchEnum

    amx = (platform.get_cpu_architecture() == CpuArchEnum.X86
           and bool(torch.cpu._is_amx_tile_supported()))
    model = getattr(vllm_config, "model_config", None)
    if getattr(getattr(model, "hf_config", None), "model_type", None) == "deepseek_v4":
        return not amx
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return not amx or getattr(backend, "name", None) == "CPU_MLA"


def paged_layout_of(kv_cache: torch.Tensor, kv_components: int = 2) -> PagedLayout:
    """Which page format a vLLM 0.32 layer cache uses.

    CPU backend: ``[pages, heads, page_size, 2*head]`` used as K rows then V rows per
    head. GPU backends: 5-D ``[2, pages, page_size, heads, head]`` (FlashAttention NHD) or
    the standardized 4-D ``[pages, heads, page_size, 2*head]`` with K|V halves. MLA
    (``kv_components`` 1): ``[pages, page_size, latent]`` (see ``latent_pages``).
    """
    if kv_components == 1:
        if kv_cache.dim() == 3:
            return PagedLayout.MLA
        raise LayoutMismatch(f"unsupported vLLM MLA cache shape {tuple(kv_cache.shape)} on "
                             f"{kv_cache.device}")
    if kv_cache.device.type == "cpu" and kv_cache.dim() == 4:
        return PagedLayout.CPU
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2:
        return PagedLayout.NHD
    if kv_cache.dim() == 4:
        return PagedLayout.PACKED_KV
    raise LayoutMismatch(f"unsupported vLLM KV cache shape {tuple(kv_cache.shape)} on "
                         f"{kv_cache.device}")


def latent_pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """An MLA layer cache as ``[pages, page_size, latent]``: GPU backends allocate it so;
    the CPU backend as ``[pages, 1, page_size, latent]`` (one KV head), viewed without its
    head dim (the same memory). A shape the same size as a K|V cache must not be read as
    one: the bytes would still round-trip, permuted within each page, but under the wrong
    layout for any other engine."""
    if kv_cache.dim() == 4 and kv_cache.shape[1] == 1:
        return kv_cache.squeeze(1)
    return kv_cache


def engine_caches(kv_caches: dict[str, torch.Tensor], layout: KVLayout,
                  tokens_per_block: int) -> tuple[list[torch.Tensor], PagedLayout, int]:
    """The caches vLLM registered, in model order (an MLA cache as its latent pages),
    their paged layout and the bytes of one kvtier block, checked against the ``layout``
    the scheduler side derived from ``KVCacheConfig`` (LayoutMismatch otherwise)."""
    caches = list(kv_caches.values())
    if layout.kv_components == 1:
        caches = [latent_pages(c) for c in caches]
    if len(caches) != layout.num_layers:
        raise LayoutMismatch(f"vLLM registered {len(caches)} layer caches, the KV cache "
                             f"config has {layout.num_layers} layers (layers that reuse "
                             f"another layer's KV cache, as Gemma 3n's do, are not supported)")
    paged = paged_layout_of(caches[0], layout.kv_components)
    from kvtier.kernels.api import block_bytes

    nbytes = block_bytes(caches, paged, tokens_per_block)
    if nbytes != layout.block_bytes:
        raise LayoutMismatch(f"vLLM caches give {nbytes} bytes per kvtier block, the "
                             f"layout {layout} expects {layout.block_bytes}")
    return caches, paged, nbytes
