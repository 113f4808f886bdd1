"""KVLayout: geometry, fingerprint stability, and from_dict on untrusted input."""

from __future__ import annotations

import pytest

from kvtier.errors import LayoutMismatch
from kvtier.layout import CANONICAL_FORMAT, DTYPE_BYTES, KVLayout

LLAMA_8B: dict[str, object] = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
                               "dtype": "bfloat16", "tokens_per_block": 256,
                               "kv_components": 2, "kv_format": CANONICAL_FORMAT}


def with_fields(**changes: object) -> dict[str, object]:
    return {**LLAMA_8B, **changes}


def test_block_bytes_of_llama_8b() -> None:
    lay = KVLayout.from_dict(LLAMA_8B)
    assert lay.element_bytes == 2
    assert lay.bytes_per_token == 32 * 2 * 8 * 128 * 2 == 131072
    assert lay.block_bytes == 131072 * 256 == 32 * 2**20


def test_mla_has_one_component() -> None:
    lay = KVLayout(61, 1, 576, "float8_e4m3fn", tokens_per_block=64, kv_components=1)
    assert lay.block_bytes == 61 * 1 * 1 * 576 * 1 * 64


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_every_dtype_has_its_element_size(dtype: str) -> None:
    lay = KVLayout(1, 1, 1, dtype, tokens_per_block=1)
    assert lay.block_bytes == 2 * DTYPE_BYTES[dtype]


def test_to_dict_from_dict_round_trip() -> None:
    lay = KVLayout(4, 2, 64, "float16", tokens_per_block=16, kv_components=1, kv_format="x")
    assert KVLayout.from_dict(lay.to_dict()) == lay
    assert KVLayout.from_dict(lay.to_dict()).fingerprint == lay.fingerprint


def test_defaults_fill_optional_fields() -> None:
    lay = KVLayout.from_dict({"num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                              "dtype": "float16"})
    assert (lay.tokens_per_block, lay.kv_components, lay.kv_format) == (256, 2,
                                                                         CANONICAL_FORMAT)


def test_fingerprint_is_a_stable_64_bit_value() -> None:
    lay = KVLayout.from_dict(LLAMA_8B)
    assert 0 <= lay.fingerprint < 2**64
    assert lay.fingerprint == KVLayout.from_dict(dict(reversed(list(LLAMA_8B.items())))).fingerprint


@pytest.mark.parametrize("change", [
    {"num_layers": 33}, {"num_kv_heads": 4}, {"head_dim": 64}, {"dtype": "float16"},
    {"tokens_per_block": 16}, {"kv_components": 1}, {"kv_format": "vllm_paged"},
], ids=lambda c: next(iter(c)))
def test_every_field_changes_the_fingerprint(change: dict[str, object]) -> None:
    assert KVLayout.from_dict(with_fields(**change)).fingerprint != \
        KVLayout.from_dict(LLAMA_8B).fingerprint


@pytest.mark.parametrize("data", [
    with_fields(extra=1),
    with_fields(**{"num_layers ": 3}),
    dict([*LLAMA_8B.items(), (b"num_layers", 32)]),      # one key of another type
], ids=["extra", "trailing-space", "bytes-key"])
def test_from_dict_rejects_unknown_fields(data: dict[object, object]) -> None:
    with pytest.raises(LayoutMismatch, match="unknown layout fields"):
        KVLayout.from_dict(data)


@pytest.mark.parametrize("missing", ["num_layers", "num_kv_heads", "head_dim", "dtype"])
def test_from_dict_rejects_missing_fields(missing: str) -> None:
    data = {k: v for k, v in LLAMA_8B.items() if k != missing}
    with pytest.raises(LayoutMismatch, match=missing):
        KVLayout.from_dict(data)


@pytest.mark.parametrize("data", [None, [], "layout", 42, [("num_layers", 1)]])
def test_from_dict_rejects_non_maps(data: object) -> None:
    with pytest.raises(LayoutMismatch, match="map"):
        KVLayout.from_dict(data)


@pytest.mark.parametrize("change", [
    {"num_layers": 0}, {"num_layers": -1}, {"num_layers": 1.0}, {"num_layers": "32"},
    {"num_layers": True}, {"num_kv_heads": None}, {"head_dim": 2**0.5},
    {"tokens_per_block": 0}, {"tokens_per_block": False},
    {"kv_components": 3}, {"kv_components": 0}, {"kv_components": 2.0},
    {"kv_components": True}, {"kv_components": "2"},
    {"dtype": "float64"}, {"dtype": "BF16"}, {"dtype": ["float16"]}, {"dtype": 2},
    {"kv_format": ""}, {"kv_format": 1}, {"kv_format": ["x"]}, {"kv_format": None},
], ids=repr)
def test_from_dict_rejects_bad_values(change: dict[str, object]) -> None:
    with pytest.raises(LayoutMismatch):
        KVLayout.from_dict(with_fields(**change))


def test_equal_layouts_have_equal_fingerprints() -> None:
    # 2.0 == 2, so a float that slipped through would make equal layouts disagree on disk
    a = KVLayout.from_dict(LLAMA_8B)
    b = KVLayout(**LLAMA_8B)  # type: ignore[arg-type]
    assert a == b
    assert a.fingerprint == b.fingerprint


def test_layout_mismatch_message_names_the_field() -> None:
    with pytest.raises(LayoutMismatch, match=r"head_dim.*positive int"):
        KVLayout.from_dict(with_fields(head_dim=0))
    with pytest.raises(LayoutMismatch, match="float64"):
        KVLayout.from_dict(with_fields(dtype="float64"))


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim",
                                   "tokens_per_block"])
def test_absurd_dimensions_are_a_typed_error(field: str) -> None:
    """A dimension from a socket or an HTTP body of 2**31 or more (2**80 once made msgpack
    fail while fingerprinting) is LayoutMismatch, not an OverflowError."""
    data = {**KVLayout(2, 2, 32, "float16", 64).to_dict(), field: 2**80}
    with pytest.raises(LayoutMismatch):
        KVLayout.from_dict(data)
    with pytest.raises(LayoutMismatch):
        KVLayout.from_dict({**data, field: 2**31})
