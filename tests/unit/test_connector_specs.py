"""Which vLLM KV cache specs the connector serves, and the layout it derives: pages that
keep every token (full attention, local layers vLLM allocates as full, MLA latents: one
576-wide component per token and layer, with one namespace for all TP ranks, since vLLM
replicates the latent on every rank); refused with a ConfigError otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.errors import ConfigError, LayoutMismatch

pytest.importorskip("vllm", reason="the connector package imports vLLM")
torch = pytest.importorskip("torch")

from kvtier.connectors.vllm.config import ConnectorConfig  # noqa: E402
from kvtier.connectors.vllm.geometry import (  # noqa: E402
    engine_reuses_context,
    latent_pages,
    layout_from_kv_cache_config,
    paged_layout_of,
    tp_replicas,
)
from kvtier.connectors.vllm.link import DaemonLink  # noqa: E402
from kvtier.kernels.layouts import PagedLayout  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    RSWASpec,
    SlidingWindowSpec,
)

from kvtier.layout import CANONICAL_FORMAT  # noqa: E402


def kv_config(spec: object, layers: int = 3) -> KVCacheConfig:
    group = KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(layers)],
                             spec)   # type: ignore[arg-type]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])


def mla(**kw: object) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                            dtype=torch.bfloat16, **kw)   # type: ignore[arg-type]


def test_an_mla_spec_is_one_latent_component_per_token() -> None:
    layout, page = layout_from_kv_cache_config(kv_config(mla()), 64)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.kv_components,
            layout.dtype, page) == (3, 1, 576, 1, "bfloat16", 16)
    assert layout.kv_format == CANONICAL_FORMAT
    assert layout.block_bytes == 3 * 64 * 576 * 2        # not twice that: no V


def test_a_packed_mla_cache_dtype_is_its_own_format() -> None:
    layout, _ = layout_from_kv_cache_config(kv_config(mla(cache_dtype_str="fp8_ds_mla")), 64)
    plain, _ = layout_from_kv_cache_config(kv_config(mla()), 64)
    assert layout.kv_format.endswith(":fp8_ds_mla")
    assert layout.fingerprint != plain.fingerprint


def test_k_and_v_of_other_sizes_outside_mla_are_refused() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, head_size_v=64,
                             dtype=torch.float16)
    with pytest.raises(ConfigError, match="128 and 64"):
        layout_from_kv_cache_config(kv_config(spec), 64)


def link(layout: object, tp_size: int, replicas: int = 1) -> DaemonLink:
    cfg = ConnectorConfig.from_extra({"model_id": "m"}, block_size=16, default_model_id="m")
    return DaemonLink(cfg, layout, tp_size=tp_size,   # type: ignore[arg-type]
                      replicas=replicas)


def test_tp_ranks_share_the_latent_namespace_and_shard_k_and_v() -> None:
    latent, _ = layout_from_kv_cache_config(kv_config(mla()), 64)
    heads, _ = layout_from_kv_cache_config(kv_config(full()), 64)
    said = kv_config(mla())
    said.kv_tp_replicas = 4            # as vLLM computes it: the latent's max_tp_shards is 1
    mla4 = link(latent, 4, tp_replicas(said, latent, 4))
    mha4 = link(heads, 4, tp_replicas(kv_config(full()), heads, 4))
    assert (mla4.replicas, mla4.shards, mha4.replicas, mha4.shards) == (4, 1, 1, 4)
    spaces = {mla4.namespace("t", r).digest for r in range(4)}
    assert spaces == {link(latent, 1).namespace("t", 0).digest}   # as a TP 1 engine keys
    assert len({mha4.namespace("t", r).digest for r in range(4)}) == 4
    assert mla4.namespace("t", 3).tp_size == 1


def test_replication_is_what_vllm_s_kv_cache_config_says() -> None:
    """vLLM's ``kv_tp_replicas`` counts ranks holding identical KV for every layer: every
    rank for an MLA latent, 1 for K and V heads even where the model has fewer KV heads
    than ranks (a model's layers may hold different KV-head counts under one per-rank
    spec: sharing a namespace there gave rank 1 rank 0's heads, review repro)."""
    latent, _ = layout_from_kv_cache_config(kv_config(mla()), 64)
    one_head, _ = layout_from_kv_cache_config(kv_config(full(num_kv_heads=1)), 64)
    said = kv_config(full(num_kv_heads=1))
    assert tp_replicas(said, one_head, 8) == 1          # vLLM's default: not replicated
    said.kv_tp_replicas = 2
    assert tp_replicas(said, one_head, 8) == 2          # what vLLM vouches for is used
    said.kv_tp_replicas = 3
    assert tp_replicas(said, one_head, 8) == 1          # not a divisor of the TP size
    older = SimpleNamespace(kv_cache_groups=[])        # a vLLM without the field
    assert (tp_replicas(older, latent, 8), tp_replicas(older, one_head, 8)) == (8, 1)
    two = link(one_head, 8, 2)
    assert (two.replicas, two.shards) == (2, 4)
    assert two.namespace("t", 5).digest == link(one_head, 4).namespace("t", 2).digest


def test_the_cpu_backend_s_latent_pages_are_read_without_their_head_dim() -> None:
    cpu = torch.zeros(8, 1, 16, 576)          # the CPU backend: [pages, 1, page, latent]
    pages = latent_pages(cpu)
    assert pages.shape == (8, 16, 576) and pages.data_ptr() == cpu.data_ptr()
    assert paged_layout_of(pages, 1) is PagedLayout.MLA
    assert paged_layout_of(cpu, 2) is PagedLayout.CPU     # the same shape as K|V halves
    with pytest.raises(LayoutMismatch, match="MLA cache shape"):
        paged_layout_of(torch.zeros(2, 8, 16, 1, 576), 1)


def full(**kw: object) -> FullAttentionSpec:
    fields: dict[str, object] = {"num_kv_heads": 2, **kw}
    return FullAttentionSpec(block_size=16, head_size=128, dtype=torch.float16,
                             **fields)   # type: ignore[arg-type]


def test_local_layers_allocated_as_full_attention_are_served() -> None:
    """vLLM's merged spec of sliding layers promoted beside full ones keeps the window as
    a field; its pages keep every token."""
    layout, _ = layout_from_kv_cache_config(kv_config(full(sliding_window=512)), 64)
    assert layout.kv_components == 2 and layout.num_kv_heads == 2


@pytest.mark.parametrize(("spec", "match"), [
    (SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.float16,
                       sliding_window=512),
     "SlidingWindowSpec .*dropped.*serve it with --disable-sliding-window"),
    (RSWASpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.float16,
              rswa_window=64), "RSWASpec"),
    (full(non_causal=True), "causal"),
])
def test_caches_that_do_not_keep_every_token_of_a_causal_prefix_are_refused(
        spec: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        layout_from_kv_cache_config(kv_config(spec), 64)


def test_several_groups_are_refused_with_the_way_out() -> None:
    cfg = kv_config(full())
    cfg.kv_cache_groups.append(cfg.kv_cache_groups[0])
    with pytest.raises(ConfigError, match="disable-hybrid-kv-cache-manager"):
        layout_from_kv_cache_config(cfg, 64)


def test_loads_follow_vllm_s_own_context_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU platform runs an MLA model on its reference attention (no AMX tiles)
    and keeps context reuse off for it: context_reuse "auto" does not load there. It
    loads for K and V models, for MLA on a GPU, and for an AMX CPU (vLLM's AMX MLA
    kernel), whether or not the operator turned prefix caching off."""
    import torch
    from vllm.platforms import current_platform

    latent, _ = layout_from_kv_cache_config(kv_config(mla()), 64)
    heads, _ = layout_from_kv_cache_config(kv_config(full()), 64)
    engine = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=False),
                             model_config=SimpleNamespace(hf_config=SimpleNamespace(
                                 model_type="deepseek_v2")),
                             attention_config=SimpleNamespace(backend=None))
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not engine_reuses_context(engine, latent)
    assert engine_reuses_context(engine, heads)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    if current_platform.get_cpu_architecture().name == "X86":
        assert engine_reuses_context(engine, latent)           # vLLM's AMX MLA kernel
        engine.attention_config.backend = SimpleNamespace(name="CPU_MLA")
        assert not engine_reuses_context(engine, latent)       # the reference, by name
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert engine_reuses_context(engine, latent)               # a GPU engine loads
    cfg = ConnectorConfig.from_extra({}, block_size=16, default_model_id="m")
    assert cfg.context_reuse == "auto"
    with pytest.raises(ConfigError, match="context_reuse"):
        ConnectorConfig.from_extra({"context_reuse": "yes"}, block_size=16,
                                   default_model_id="m")


def test_a_quantized_kv_cache_dtype_is_part_of_the_format() -> None:
    """Every fp8 variant is stored as uint8: with ``model_fingerprint`` "off" (no weights
    fingerprint naming the cache dtype) an e4m3 and an e5m2 engine shared one namespace
    (found by review). The cache dtype is in ``kv_format`` whenever the cache stores
    another dtype than it names; "auto", or the layout's own dtype, changes nothing."""
    from kvtier.connectors.vllm.geometry import with_cache_dtype

    layout, _ = layout_from_kv_cache_config(kv_config(FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=128, dtype=torch.uint8)), 64)

    def engine(cache_dtype: object) -> SimpleNamespace:
        return SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype))

    e4m3, e5m2 = (with_cache_dtype(layout, engine(d)) for d in ("fp8_e4m3", "fp8_e5m2"))
    assert e4m3.kv_format == f"{CANONICAL_FORMAT}:fp8_e4m3"
    assert e4m3.fingerprint != e5m2.fingerprint
    for same in ("auto", "uint8", None):
        assert with_cache_dtype(layout, engine(same)) == layout
    assert with_cache_dtype(layout, None) == layout
    latent, _ = layout_from_kv_cache_config(kv_config(mla(cache_dtype_str="fp8_ds_mla")), 64)
    assert with_cache_dtype(latent, engine("fp8_ds_mla")) == latent   # named already


def test_a_model_vllm_caches_no_prefix_of_never_loads() -> None:
    """A MEAN (or CLS) pooling model pools over the whole prompt in one prefill: a loaded
    prefix made its pooler raise and the engine core die (found by review). vLLM says so
    in ``is_prefix_caching_supported``; "auto" then never loads, on any platform."""
    from kvtier.connectors.vllm.geometry import context_reuse_refused

    heads, _ = layout_from_kv_cache_config(kv_config(full()), 64)

    def engine(supported: bool, pooling: str | None = "MEAN") -> SimpleNamespace:
        pooler = None if pooling is None else SimpleNamespace(seq_pooling_type=pooling)
        return SimpleNamespace(model_config=SimpleNamespace(
            is_prefix_caching_supported=supported, pooler_config=pooler,
            attn_type="decoder", hf_config=SimpleNamespace(model_type="llama")))

    assert context_reuse_refused(engine(True)) is None
    assert engine_reuses_context(engine(True), heads)
    why = context_reuse_refused(engine(False))
    assert why is not None and "MEAN pooling" in why
    assert not engine_reuses_context(engine(False), heads)
    assert "attention type" in (context_reuse_refused(engine(False, None)) or "")
    assert context_reuse_refused(SimpleNamespace()) is None   # nothing to ask: as before


def test_a_model_without_a_kv_cache_is_told_so() -> None:
    """An encoder-only model has no KV cache group: the refusal said to disable the hybrid
    KV cache manager, which changes nothing there."""
    empty = KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[])
    with pytest.raises(ConfigError, match="keeps no KV cache") as err:
        layout_from_kv_cache_config(empty, 64)
    assert "hybrid" not in str(err.value)


def test_context_reuse_on_is_refused_where_vllm_caches_no_prefix() -> None:
    """"on" forces loads past vLLM's CPU MLA test, but a MEAN pooling model's pooler
    fails every request a load reaches: the engine is refused at start, in one line."""
    from kvtier.connectors.vllm.geometry import context_loads

    heads, _ = layout_from_kv_cache_config(kv_config(full()), 64)
    engine = SimpleNamespace(model_config=SimpleNamespace(
        is_prefix_caching_supported=False, attn_type="decoder",
        pooler_config=SimpleNamespace(seq_pooling_type="CLS")))
    assert context_loads("auto", engine, heads) == (
        False, "vLLM does not support prefix caching for this model (a pooling model with "
        "CLS pooling)")
    assert context_loads("off", engine, heads) == (False, "")   # the operator's reason
    with pytest.raises(ConfigError, match="CLS pooling") as err:
        context_loads("on", engine, heads)
    assert "\n" not in str(err.value)
    plain = SimpleNamespace(model_config=SimpleNamespace(is_prefix_caching_supported=True))
    assert context_loads("on", plain, heads) == context_loads("auto", plain, heads) == (
        True, "")
    assert context_loads("off", plain, heads) == (False, "")
