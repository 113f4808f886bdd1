"""The Redis tier's pure checks, each at its edge: a read's header verdict
(``judge_header``, ``never_valid``, ``lengths_sound``), a striped read's verdict over its
stripes, the stripe keys a delete or a rewrite takes along, a batch's first failure, read
batching, and what the health rounds make of INFO/DBSIZE (mutation review: none of these
edges was pinned)."""

from __future__ import annotations

from typing import Any

from kvtier.frame import (
    FLAG_STRIPE_TAG,
    FLAG_STRIPED,
    HEADER_SIZE,
    STRIPE_BYTES,
    STRIPED_MIN_BYTES,
    Codec,
    FrameHeader,
)
from kvtier.tiers.redis_blocks import (
    BlockRead,
    ReadStatus,
    judge_header,
    lengths_sound,
    never_valid,
)
from kvtier.tiers.redis_info import ServerStats, key_count
from kvtier.tiers.redis_reads import _batches
from kvtier.tiers.redis_resp import ErrorReply
from kvtier.tiers.redis_stripes import _verdict, owned_part_keys, part_keys, replaced_parts
from kvtier.tiers.redis_writes import _first_failures
from tests.support.redis_tier import LAYOUT_FP, NS

KEY = bytes(range(32, 48))


def header(raw: int, payload: int | None = None, *, codec: Codec = Codec.NONE,
           flags: int = 0, seq: int = 0) -> FrameHeader:
    return FrameHeader(NS, KEY, LAYOUT_FP, raw if payload is None else payload, raw, 0,
                       codec, seq, flags)


def verdict(h: FrameHeader, out_bytes: int, n: int | None = None) -> FrameHeader | BlockRead:
    return judge_header(h.pack(), KEY, out_bytes, NS, LAYOUT_FP, n)


def status(v: FrameHeader | BlockRead) -> ReadStatus | None:
    return v.status if isinstance(v, BlockRead) else None


def test_a_frame_smaller_than_the_buffer_does_not_fit_it() -> None:
    """A sound frame of fewer raw bytes than the caller's buffer is NOFIT, like a larger
    one: taken as fitting, the buffer's tail would keep whatever it held before (stale
    bytes served as the block's)."""
    assert status(verdict(header(4096), 8192)) is ReadStatus.NOFIT
    assert status(verdict(header(8192), 4096)) is ReadStatus.NOFIT
    assert isinstance(verdict(header(4096), 4096), FrameHeader)


def test_the_smallest_striped_block_is_valid_and_one_byte_less_is_not() -> None:
    """kvtier stripes blocks of STRIPED_MIN_BYTES or more: the striped flag on exactly that
    size is a frame it wrote (refused, every such block would be deleted as corrupt), one
    byte less never is."""
    striped = FLAG_STRIPED | FLAG_STRIPE_TAG
    assert never_valid(header(STRIPED_MIN_BYTES, flags=striped), None) is None
    assert never_valid(header(STRIPED_MIN_BYTES - 1, flags=striped), None) is not None
    assert never_valid(header(4096), 8192) is not None
    assert never_valid(header(4096), 4096) is None


def test_an_uncompressed_payload_must_be_exactly_the_block() -> None:
    """Uncompressed, payload_len is raw_len: a shorter one (a planted header) is refused
    before a read trusts it; a compressed one may be anything up to its codec's bound,
    not a byte more."""
    assert lengths_sound(header(4096))
    assert not lengths_sound(header(4096, 4095))
    assert not lengths_sound(header(4096, 4097))
    assert lengths_sound(header(4096, 100, codec=Codec.LZ4))
    bound = 4096 + 4096 // 255 + 16
    assert lengths_sound(header(4096, bound, codec=Codec.LZ4))
    assert not lengths_sound(header(4096, bound + 1, codec=Codec.LZ4))


def test_a_get_value_of_another_length_than_its_header_says_is_corrupt() -> None:
    """A GET's value must hold the header and exactly the payload it announces (a
    striped head: stripe 0 only); one byte more or less is corrupt."""
    h = header(4096)
    assert isinstance(verdict(h, 4096, HEADER_SIZE + 4096), FrameHeader)
    assert status(verdict(h, 4096, HEADER_SIZE + 4095)) is ReadStatus.CORRUPT
    assert status(verdict(h, 4096, HEADER_SIZE + 4097)) is ReadStatus.CORRUPT
    s = header(STRIPED_MIN_BYTES, flags=FLAG_STRIPED | FLAG_STRIPE_TAG, seq=7)
    assert isinstance(verdict(s, STRIPED_MIN_BYTES, HEADER_SIZE + STRIPE_BYTES), FrameHeader)


def test_an_old_frames_stripes_are_named_without_a_tag() -> None:
    """A striped frame written before tags (no FLAG_STRIPE_TAG) has its stripes under
    key:i, whatever its seq: named after the seq, a reader misses every such block and a
    delete leaves its stripes behind."""
    old = header(STRIPED_MIN_BYTES, flags=FLAG_STRIPED, seq=5)
    assert part_keys(b"k", old) == [b"k:1"]
    new = header(STRIPED_MIN_BYTES, flags=FLAG_STRIPED | FLAG_STRIPE_TAG, seq=5)
    assert part_keys(b"k", new) == [b"k:%016x:1" % 5]


def test_a_delete_takes_along_only_the_stripes_of_a_head_of_the_namespaces_size() -> None:
    """A striped head whose raw_len is not its namespace's block size is no block of it:
    deleting it must not name stripes (up to MAX_PAYLOAD's worth of keys) after it."""
    h = header(3 * STRIPE_BYTES, flags=FLAG_STRIPED | FLAG_STRIPE_TAG, seq=1)
    assert len(owned_part_keys(b"k", h, 3 * STRIPE_BYTES)) == 2
    assert len(owned_part_keys(b"k", h, None)) == 2
    assert owned_part_keys(b"k", h, 2 * STRIPE_BYTES) == []
    assert owned_part_keys(b"k", header(3 * STRIPE_BYTES), None) == []


def test_a_rewrite_with_the_same_tag_deletes_no_stripes() -> None:
    """The stripes a rewrite replaced are those of another tag only: the head read back
    with the writer's own tag names the stripes just written, which must stay."""
    old = header(2 * STRIPE_BYTES, flags=FLAG_STRIPED | FLAG_STRIPE_TAG, seq=9)
    assert replaced_parts(b"k", old, 9, 2 * STRIPE_BYTES) == []
    assert replaced_parts(b"k", old, 10, 2 * STRIPE_BYTES) == [b"k:%016x:1" % 9]
    assert replaced_parts(b"k", None, 10, 2 * STRIPE_BYTES) == []


def test_a_stripe_shorter_or_longer_than_its_place_is_corrupt() -> None:
    """Each stripe must fill its slice exactly: shorter leaves the slice's tail stale,
    longer never fits; both are corrupt (a missing one is MISSING, an error reply about
    the server an ERROR, a stripe of another type CORRUPT)."""
    dests = [memoryview(bytearray(8)), memoryview(bytearray(4))]

    def v(*got: object) -> ReadStatus:
        return _verdict(list(got), dests)[0]

    assert v(8, 4) is ReadStatus.OK
    assert v(8, 3) is ReadStatus.CORRUPT
    assert v(8, 5) is ReadStatus.CORRUPT
    assert v(8, None) is ReadStatus.MISSING
    assert v(3, None) is ReadStatus.CORRUPT
    assert v(8, ErrorReply("OOM no")) is ReadStatus.ERROR
    assert v(8, ErrorReply("WRONGTYPE x")) is ReadStatus.CORRUPT


def test_a_blocks_outcome_is_its_first_set_that_failed() -> None:
    """A striped block is stored only when every SET of it was: one refused stripe
    followed by stored ones is still the refusal."""
    a: Any = object()
    b: Any = object()
    refused = ErrorReply("OOM full")
    sets: list[Any] = [(b"a:1", a, None), (b"a:2", a, None), (b"a:3", a, None),
                       (b"b", b, None)]
    got = _first_failures(sets, ["OK", refused, "OK", "OK"])
    assert got == {id(a): refused, id(b): "OK"}


def test_a_read_batch_takes_blocks_up_to_exactly_its_byte_bound() -> None:
    """Blocks whose sizes add up to exactly max_bytes are one batch, not two."""
    assert _batches([10, 10, 10], 32, 20) == [(0, 2), (2, 3)]
    assert _batches([10, 10], 32, 19) == [(0, 1), (1, 2)]


def info(used: int, cap: str) -> list[Any]:
    return ["PONG", b"# Memory\r\nused_memory:%d\r\nmaxmemory:%s\r\n" % (used, cap.encode()),
            3]


def test_server_stats_sum_masters_and_a_master_without_a_limit_unbounds_them() -> None:
    """The limit is the masters' sum only when each has a maxmemory (0: unbounded);
    a field of more than 20 digits is no byte count; DBSIZE only as a plain count."""
    stats = ServerStats()
    stats.take([info(10, "100"), info(5, "50")])
    assert (stats.used, stats.limit, stats.keys) == (15, 150, 6)
    stats.take([info(10, "100"), info(5, "0")])
    assert (stats.used, stats.limit) == (15, 0)
    stats.take([info(10, "1" * 21)])
    assert stats.limit == 0 and stats.used == 10
    stats.take([info(10, "9" * 20)])
    assert stats.limit == int("9" * 20)
    assert key_count(1 << 63) == 0 and key_count((1 << 63) - 1) == (1 << 63) - 1
    assert key_count(-1) == 0 and key_count(True) == 0
