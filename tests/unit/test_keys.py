"""Block keys: byte-level determinism, namespace isolation, the chained-prefix property."""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import LayoutMismatch
from kvtier.keys import KEY_BYTES, KEY_SCHEME, ROOT_KEY, Namespace, block_keys
from tests.support.keys import TOKENS, TPB, layout, ns


def test_keys_are_16_bytes_one_per_full_block() -> None:
    keys = block_keys(ns(), TOKENS)
    assert len(keys) == 4
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 4


def test_partial_trailing_chunk_is_not_keyed() -> None:
    full = block_keys(ns(), TOKENS)
    assert block_keys(ns(), [*TOKENS, 7, 8, 9]) == full
    assert block_keys(ns(), TOKENS[: TPB - 1]) == []
    assert block_keys(ns(), []) == []


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40), cut=st.integers(0, 40))
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(tokens: list[int], cut: int) -> None:
    keys = block_keys(ns(), tokens)
    assert block_keys(ns(), tokens[:cut]) == keys[: min(cut, len(tokens)) // TPB]


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=2 * TPB, max_size=40),
       pos=st.integers(0, 39), delta=st.integers(1, 2**32 - 1))
def test_changing_one_token_changes_its_block_and_every_later_key(
        tokens: list[int], pos: int, delta: int) -> None:
    pos %= len(tokens)
    other = list(tokens)
    other[pos] = (other[pos] + delta) % 2**32
    a, b = block_keys(ns(), tokens), block_keys(ns(), other)
    changed = pos // TPB
    assert a[:changed] == b[:changed]
    assert all(x != y for x, y in zip(a[changed:], b[changed:], strict=True))


def test_parent_continues_a_chain() -> None:
    keys = block_keys(ns(), TOKENS)
    assert block_keys(ns(), TOKENS[2 * TPB:], parent=keys[1]) == keys[2:]
    assert block_keys(ns(), TOKENS, parent=ROOT_KEY) == keys
    assert block_keys(ns(), TOKENS[TPB:]) != keys[1:]  # a block is bound to its prefix


def test_tokens_per_block_argument_overrides_the_layout() -> None:
    assert len(block_keys(ns(), TOKENS, tokens_per_block=8)) == 2
    assert block_keys(ns(), TOKENS, tokens_per_block=8) != block_keys(ns(), TOKENS)[:2]


@pytest.mark.parametrize("tokens", [
    TOKENS,
    tuple(TOKENS),
    np.array(TOKENS, dtype=np.int64),
    np.array(TOKENS, dtype=np.int32),
    np.array(TOKENS, dtype=">u4"),
    np.array(TOKENS, dtype=np.uint64),
    np.repeat(np.array(TOKENS, dtype="<u4"), 2)[::2],  # strided view
], ids=["list", "tuple", "int64", "int32", "big-endian-u4", "uint64", "strided"])
def test_same_keys_for_every_container_of_the_same_ids(tokens: object) -> None:
    assert block_keys(ns(), tokens) == block_keys(ns(), TOKENS)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [
    [-1, 0, 0, 0],
    [2**32, 0, 0, 0],
    np.array([2**32, 0, 0, 0], dtype=np.int64),
    np.array([-1, 0, 0, 0], dtype=np.int64),
    np.array([2**32 + 5, 0, 0, 0], dtype=np.uint64),   # unsigned, but wider than u4
    [1.5, 0.0, 0.0, 0.0],
    [[1, 2, 3, 4]],
], ids=["negative", "too-big", "np-too-big", "np-negative", "np-uint64-too-big", "float", "2d"])
def test_token_ids_that_would_wrap_are_refused(tokens: object) -> None:
    # a silent cast would make two different prompts share keys (a uint64 2**32 + 5
    # would become token 5: unsigned ids wider than u4 need the range check too)
    with pytest.raises(ValueError):
        block_keys(ns(), tokens)  # type: ignore[arg-type]


NAMESPACE_VARIANTS: dict[str, Namespace] = {
    "base": ns(),
    "salt-a": ns(cache_salt="tenant-a"),
    "salt-b": ns(cache_salt="tenant-b"),
    "salt-empty": ns(cache_salt=""),
    "model": ns(model_id="org/model-8b"),
    "tp-rank-1-of-2": ns(tp_rank=1, tp_size=2),
    "tp-rank-0-of-2": ns(tp_rank=0, tp_size=2),
    "dtype": ns(layout=layout(dtype="bfloat16")),
    "layers": ns(layout=layout(num_layers=3)),
    "heads": ns(layout=layout(num_kv_heads=4)),
    "head-dim": ns(layout=layout(head_dim=16)),
    "mla": ns(layout=layout(kv_components=1)),
    "format": ns(layout=layout(kv_format="vllm_paged")),
}


def test_no_two_namespaces_share_a_key() -> None:
    seen: dict[bytes, str] = {}
    for name, namespace in NAMESPACE_VARIANTS.items():
        for key in block_keys(namespace, TOKENS):
            assert key not in seen, f"{name} and {seen[key]} share a key"
            seen[key] = name
    digests = {n.digest for n in NAMESPACE_VARIANTS.values()}
    assert len(digests) == len(NAMESPACE_VARIANTS)


def test_tokens_per_block_is_part_of_the_namespace() -> None:
    a = ns(layout=layout(tokens_per_block=4))
    b = ns(layout=layout(tokens_per_block=8))
    assert block_keys(a, TOKENS, tokens_per_block=8) != block_keys(b, TOKENS)


def test_with_salt_changes_only_the_salt() -> None:
    base = ns(tp_rank=1, tp_size=2)
    salted = base.with_salt("tenant-a")
    assert (salted.model_id, salted.layout, salted.tp_rank, salted.tp_size) == (
        base.model_id, base.layout, base.tp_rank, base.tp_size)
    assert salted.cache_salt == "tenant-a"
    assert salted.digest != base.digest
    assert salted.with_salt(None).digest == base.digest


def test_equal_namespaces_have_equal_digests() -> None:
    assert ns() == ns()
    assert ns().digest == ns().digest
    assert hash(ns()) == hash(ns())


@pytest.mark.parametrize(("rank", "size"), [(-1, 1), (1, 1), (2, 2), (0, 0)])
def test_tp_rank_outside_tp_size_is_rejected(rank: int, size: int) -> None:
    with pytest.raises(LayoutMismatch, match="tp_rank"):
        ns(tp_rank=rank, tp_size=size)


def test_keys_are_the_documented_blake2b_chain() -> None:
    # docs/architecture.md ("Block keys"), spelled out independently of kvtier.keys: a
    # router or another implementation that follows the text gets the same keys.
    space = ns(cache_salt="tenant-a")
    packed = msgpack.packb([2, space.model_id, space.layout.fingerprint, space.tp_rank,
                            space.tp_size, space.cache_salt], use_bin_type=True)
    digest = hashlib.blake2b(packed, digest_size=16, person=b"kvtier-ns/2").digest()
    assert space.digest == digest
    prev, want = b"\x00" * 16, []
    for i in range(len(TOKENS) // TPB):
        chunk = b"".join(t.to_bytes(4, "little") for t in TOKENS[i * TPB:(i + 1) * TPB])
        prev = hashlib.blake2b(digest + prev + chunk, digest_size=16,
                               person=b"kvtier-key/2").digest()
        want.append(prev)
    assert block_keys(space, TOKENS) == want
    assert KEY_SCHEME == "blake2b_128-chain/2"


@pytest.mark.parametrize("parent", [b"", b"\x00" * 15, b"\x00" * 17, b"\x00" * 32])
def test_a_parent_that_is_not_a_whole_key_is_refused(parent: bytes) -> None:
    # a shorter parent would let a prefix of the chunk's ids stand in for key bytes
    with pytest.raises(ValueError, match="parent key"):
        block_keys(ns(), TOKENS, parent=parent)
