"""Layout edges the main suites leave open (mutation review, round 4): the kv_format
bound is inclusive and a kv_format without UTF-8 bytes is a typed refusal, the default
block is never below one page, every dtype has its true width, and the fingerprint is the
full 64-bit digest frames carry across restarts."""

from __future__ import annotations

import msgpack
import pytest
import xxhash

from kvtier.errors import LayoutMismatch
from kvtier.layout import DTYPE_BYTES, MAX_KV_FORMAT, KVLayout, default_tokens_per_block
from tests.support.keys import layout


def test_a_kv_format_of_exactly_the_limit_is_taken() -> None:
    """A format of MAX_KV_FORMAT characters is documented as allowed: an off-by-one bound
    would refuse an engine whose page format name is exactly that long."""
    name = "f" * MAX_KV_FORMAT
    assert layout(kv_format=name).kv_format == name
    with pytest.raises(LayoutMismatch, match="kv_format"):
        layout(kv_format=name + "f")


def test_a_kv_format_with_a_lone_surrogate_is_a_layout_mismatch() -> None:
    """A lone surrogate (from JSON) has no UTF-8 bytes to fingerprint: without the check
    the layout raises a bare UnicodeEncodeError from msgpack instead of the typed refusal
    the control plane turns into an error reply."""
    data = dict(layout().to_dict(), kv_format="paged\ud800")
    with pytest.raises(LayoutMismatch, match="Unicode"):
        KVLayout.from_dict(data)


@pytest.mark.parametrize(("page", "want"), [(1, 256), (16, 256), (48, 240), (256, 256),
                                            (384, 384), (512, 512), (1024, 1024)])
def test_the_default_block_is_a_whole_number_of_pages_and_at_least_one(page: int,
                                                                      want: int) -> None:
    """An engine page larger than DEFAULT_TOKENS_PER_BLOCK still gets a block of one page:
    without the floor the default is 0 tokens, which no layout accepts."""
    got = default_tokens_per_block(page)
    assert got == want and got % page == 0


@pytest.mark.parametrize(("dtype", "size"), [
    ("float32", 4), ("float16", 2), ("bfloat16", 2), ("float8_e4m3fn", 1),
    ("float8_e5m2", 1), ("int8", 1), ("uint8", 1)])
def test_each_dtype_has_its_true_element_size(dtype: str, size: int) -> None:
    """block_bytes is what every tier allocates and checks per key: a wrong width for one
    dtype sizes its blocks wrongly (pages cut short or read past), whatever else agrees."""
    assert DTYPE_BYTES[dtype] == size
    assert KVLayout(3, 2, 8, dtype, tokens_per_block=4).block_bytes == 3 * 2 * 2 * 8 * 4 * size


def test_the_fingerprint_is_the_full_64_bit_xxh3_of_the_sorted_fields() -> None:
    """Frames on nvme and in Redis carry this number across restarts and daemons: another
    derivation turns every stored block into a miss, and a narrower one (e.g. 32 bits) lets
    two geometries meet by chance far sooner."""
    lay = layout(kv_format="vllm_paged")
    packed = msgpack.packb(sorted(lay.to_dict().items()), use_bin_type=True)
    assert lay.fingerprint == xxhash.xxh3_64_intdigest(packed)
    assert lay.fingerprint >= 2**32   # (this geometry's digest has high bits set)
