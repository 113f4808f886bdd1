"""Engine geometries the connector must refuse or map exactly (mutation review
survivors): a cache with fewer KV entries than tokens, page formats told apart by device
and shape, the engine's registered caches checked against the layout, and a CPU engine's
K page format named by its kernel and page size."""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.errors import ConfigError, LayoutMismatch

pytest.importorskip("vllm", reason="the connector package imports vLLM")
torch = pytest.importorskip("torch")

from kvtier.connectors.vllm.geometry import (  # noqa: E402
    engine_caches,
    engine_reuses_context,
    latent_pages,
    layout_from_kv_cache_config,
    paged_layout_of,
    with_engine_page_format,
)
from kvtier.kernels.layouts import PagedLayout  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
)

from kvtier.layout import CANONICAL_FORMAT, KVLayout  # noqa: E402

PAGE, TPB = 16, 64


def kv_config(spec: object, layers: int = 2) -> KVCacheConfig:
    group = KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(layers)],
                             spec)   # type: ignore[arg-type]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])


def full(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=PAGE, num_kv_heads=2, head_size=32,
                             dtype=torch.float32, **kw)


def mla(**kw: Any) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=PAGE, num_kv_heads=1, head_size=64,
                            dtype=torch.float32, **kw)


@pytest.mark.parametrize("per_state", [Fraction(1, 4), Fraction(1, 2), 2])
def test_a_cache_without_one_entry_per_token_is_refused(per_state: object) -> None:
    """A compressed cache (one entry per 4 tokens) keyed as one per token would load
    other tokens' KV."""
    with pytest.raises(ConfigError, match="one KV entry per token"):
        layout_from_kv_cache_config(kv_config(full(tokens_per_state=per_state)), TPB)
    with pytest.raises(ConfigError, match="one KV entry per token"):
        layout_from_kv_cache_config(kv_config(mla(tokens_per_state=per_state)), TPB)


def test_an_mla_cache_dtype_of_auto_is_the_model_s_own() -> None:
    """vLLM names the cache dtype "auto" by default: the same format as an unnamed one."""
    auto, _ = layout_from_kv_cache_config(kv_config(mla(cache_dtype_str="auto")), TPB)
    plain, _ = layout_from_kv_cache_config(kv_config(mla()), TPB)
    assert auto.kv_format == plain.kv_format == CANONICAL_FORMAT


def test_page_formats_are_told_apart_by_device_and_shape() -> None:
    """A 4-D cache off the CPU is the packed K|V format, not the CPU kernel's; a 5-D one
    is NHD only with K and V in its first dim; other shapes are refused."""
    meta = {"device": "meta"}
    assert paged_layout_of(torch.empty(8, 2, PAGE, 64, **meta)) is PagedLayout.PACKED_KV
    assert paged_layout_of(torch.empty(2, 8, PAGE, 2, 32, **meta)) is PagedLayout.NHD
    assert paged_layout_of(torch.empty(8, 2, PAGE, 64)) is PagedLayout.CPU
    for shape in ((3, 8, PAGE, 2, 32), (8, PAGE, 64), (8, 2, PAGE, 2, 32, 1)):
        with pytest.raises(LayoutMismatch, match="unsupported vLLM KV cache shape"):
            paged_layout_of(torch.empty(*shape, **meta))
    for latent in ((8, 1, PAGE, 64), (8, PAGE * 64)):
        with pytest.raises(LayoutMismatch, match="MLA cache shape"):
            paged_layout_of(torch.empty(*latent), 1)


def test_latent_pages_of_one_token_keep_their_page_dim() -> None:
    pages = torch.zeros(8, 1, 64)          # [pages, page_size 1, latent]: already latent
    assert latent_pages(pages).shape == (8, 1, 64)


def layout(**kw: Any) -> KVLayout:
    fields: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32,
                              "dtype": "float32", "tokens_per_block": TPB, **kw}
    return KVLayout(**fields)


def test_the_registered_caches_are_checked_against_the_layout() -> None:
    """As many caches as the layout has layers, of its block bytes; an MLA engine's CPU
    caches are read as latent pages."""
    cpu = {f"l{i}": torch.zeros(8, 2, PAGE, 64) for i in range(2)}
    caches, paged, nbytes = engine_caches(cpu, layout(), TPB)
    assert (len(caches), paged, nbytes) == (2, PagedLayout.CPU, layout().block_bytes)
    for count in (1, 3):
        with pytest.raises(LayoutMismatch, match=f"registered {count} layer caches"):
            engine_caches({f"l{i}": torch.zeros(8, 2, PAGE, 64) for i in range(count)},
                          layout(), TPB)
    with pytest.raises(LayoutMismatch, match="bytes per kvtier block"):
        engine_caches(cpu, layout(num_kv_heads=4), TPB)
    latent = layout(num_kv_heads=1, head_dim=64, kv_components=1)
    mla_cpu = {f"l{i}": torch.zeros(8, 1, PAGE, 64) for i in range(2)}
    caches, paged, nbytes = engine_caches(mla_cpu, latent, TPB)
    assert paged is PagedLayout.MLA and caches[0].shape == (8, PAGE, 64)
    assert nbytes == latent.block_bytes


def cpu_engine(monkeypatch: pytest.MonkeyPatch, amx: bool, dtype: Any) -> Any:
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    return SimpleNamespace(model_config=SimpleNamespace(dtype=dtype),
                           cache_config=SimpleNamespace(cache_dtype="auto"))


def test_a_cpu_engine_s_page_format_names_its_kernel_and_page_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU engines share KV only with engines of the same attention kernel and page size
    (their K rows are interleaved by the kernel; review repro: 128-token pages loaded what
    32-token pages saved). The kernel is vLLM's choice for the engine's own dtype, page
    size, head size and cache dtype (vLLM's chooser stood in: importing it starts a
    process)."""
    import sys

    from vllm.platforms import current_platform

    asked: list[tuple[Any, ...]] = []

    def isa(dtype: Any, block_size: int, head_size: int, cache_dtype: Any) -> str:
        asked.append((dtype, block_size, head_size, cache_dtype))
        return "amx" if block_size % 32 == 0 else "vec16"

    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.cpu_attn",
                        SimpleNamespace(_get_attn_isa=isa))
    plain = layout(dtype="bfloat16", head_dim=128)
    engine = cpu_engine(monkeypatch, True, torch.bfloat16)
    at16, at32, at64 = (with_engine_page_format(plain, engine, p) for p in (16, 32, 64))
    assert asked == [(torch.bfloat16, p, 128, "auto") for p in (16, 32, 64)]
    assert (at16.kv_format, at32.kv_format, at64.kv_format) == tuple(
        f"{CANONICAL_FORMAT}@cpu:{k}:{p}" for k, p in (("vec16", 16), ("amx", 32),
                                                         ("amx", 64)))
    assert len({at16.fingerprint, at32.fingerprint, at64.fingerprint}) == 3
    latent = layout(num_kv_heads=1, head_dim=64, kv_components=1)
    assert with_engine_page_format(latent, engine, 32) == latent   # MLA: canonical
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert with_engine_page_format(plain, engine, 32) == plain      # a GPU engine


def test_without_vllm_s_kernel_chooser_the_machine_kind_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import platform
    import sys

    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.cpu_attn", None)
    plain = layout(dtype="bfloat16", head_dim=128)
    amx = with_engine_page_format(plain, cpu_engine(monkeypatch, True, torch.bfloat16), 32)
    vec = with_engine_page_format(plain, cpu_engine(monkeypatch, False, torch.bfloat16), 32)
    assert amx.kv_format == f"{CANONICAL_FORMAT}@cpu:{platform.machine()}-amx:32"
    assert vec.kv_format == f"{CANONICAL_FORMAT}@cpu:{platform.machine()}:32"


def test_deepseek_v4_reuses_context_on_a_cpu_only_with_amx(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    latent = layout(num_kv_heads=1, head_dim=64, kv_components=1)
    engine = SimpleNamespace(model_config=SimpleNamespace(
        hf_config=SimpleNamespace(model_type="deepseek_v4")),
        attention_config=SimpleNamespace(backend=SimpleNamespace(name="CPU_MLA")))
    cpu_engine(monkeypatch, False, torch.bfloat16)
    assert not engine_reuses_context(engine, latent)
    if current_platform.get_cpu_architecture().name == "X86":
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
        assert engine_reuses_context(engine, latent)   # its own kernel, whatever backend


def test_without_a_platform_to_ask_context_reuse_follows_the_prefix_cache(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    def unknown() -> bool:
        raise RuntimeError("no platform")

    monkeypatch.setattr(current_platform, "is_cpu", unknown)
    latent = layout(num_kv_heads=1, head_dim=64, kv_components=1)
    for on in (False, True):
        engine = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=on))
        assert engine_reuses_context(engine, latent) is on
