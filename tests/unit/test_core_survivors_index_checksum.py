"""Checksum helpers, the block index and prefix-locality answers: edges the main suites
leave open (mutation review, round 4)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier import checksum as rc
from kvtier.errors import ChecksumError
from kvtier.frame import FLAG_STRIPE_TAG, FLAG_STRIPED, Codec, FrameHeader, payload_checksum
from kvtier.index import BlockIndex, BlockMeta, SlotState
from kvtier.prefix import PrefixLocality, RedisProbe

NS, KEY = bytes(range(16)), bytes(range(16, 32))


def test_header_for_keeps_the_flags_and_seq_it_is_given() -> None:
    """The Redis writer frames striped blocks with header_for: without their flags and
    seq (the stripes' per-write tag) readers take the head for a whole, short frame."""
    payload = bytes(range(256))
    flags = FLAG_STRIPED | FLAG_STRIPE_TAG
    header = rc.header_for(NS, KEY, 7, payload, raw_len=512, codec=Codec.LZ4,
                           seq=0xFEED_F00D_0000_0001, flags=flags)
    assert header == FrameHeader(NS, KEY, 7, 256, 512, payload_checksum(payload), Codec.LZ4,
                                 0xFEED_F00D_0000_0001, flags)
    assert FrameHeader.unpack(header.pack()) == header


def test_sizes_are_counted_in_bytes_for_typed_buffers() -> None:
    """A payload may be a typed view (e.g. fp16 pages): its length in elements is not its
    size, so a header or a verify that counted elements would refuse (or frame) the block
    with half its bytes."""
    pages = np.arange(512, dtype=np.float16)
    view = pages.data
    assert len(view) == 512 and view.nbytes == 1024
    header = rc.header_for(NS, KEY, 7, view)
    assert (header.payload_len, header.raw_len) == (1024, 1024)
    assert header.checksum == payload_checksum(pages.tobytes())
    rc.verify(header, view)
    with pytest.raises(ChecksumError, match="length"):
        rc.verify(header, pages[:-1].data)


def _meta(i: int, namespace: bytes) -> BlockMeta:
    m = BlockMeta(i.to_bytes(16, "little"), namespace, 1, 4096, None, i)
    m.cpu_state = SlotState.READY
    return m


def test_leading_stops_at_the_first_block_accept_refuses() -> None:
    """The store walks a chain with accept = "of this namespace": a block of another
    namespace under the same key must end the walk, or its KV is handed to this one."""
    index = BlockIndex()
    metas = [_meta(0, b"a" * 16), _meta(1, b"b" * 16), _meta(2, b"a" * 16)]
    for m in metas:
        index[m.key] = m
    keys = [m.key for m in metas]
    mine = list(index.leading(keys, lambda m: m.namespace == b"a" * 16))
    assert mine == [metas[0]]
    assert list(index.leading(keys)) == metas            # no filter: all present
    assert list(index.leading(keys, lambda m: False)) == []


def test_prefix_locality_tokens_follow_their_own_block_counts() -> None:
    """A router compares nodes by these token counts: hit, local and Redis each come from
    their own block count (a node holding 1 block locally and 3 in all is worth 3)."""
    answer = PrefixLocality(tokens_per_block=16, prompt_blocks=8, hit_blocks=5,
                            local_blocks=2, tier_blocks={"cpu": 1, "nvme": 1},
                            redis=RedisProbe.OK, redis_blocks=4)
    assert (answer.hit_tokens, answer.local_tokens, answer.redis_tokens) == (80, 32, 64)
    wire = answer.to_dict()
    assert (wire["hit_tokens"], wire["local_tokens"], wire["redis_tokens"]) == (80, 32, 64)
    assert wire["prompt_blocks"] == 8 and wire["redis"] == "ok"
    assert PrefixLocality.from_dict(wire) == answer
    assert [p.value for p in RedisProbe] == ["ok", "off", "down", "skipped", "timeout"]


def test_add_new_indexes_every_block_of_the_batch() -> None:
    """A batch put adds its blocks with add_new: one left out is a block whose bytes were
    written but that no lookup finds (and the presence filter still claims)."""
    index = BlockIndex()
    metas = [_meta(i, b"a" * 16) for i in range(3)]
    assert index.new_positions([m.key for m in metas] + [metas[0].key]) == [0, 1, 2]
    index.add_new(metas)
    assert [index[m.key] for m in metas] == metas and len(index) == 3
    assert index.new_positions([m.key for m in metas]) == []
