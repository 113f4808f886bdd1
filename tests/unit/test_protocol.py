"""Control-plane framing: round trips, and every malformed input is a ProtocolError."""

from __future__ import annotations

import datetime
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ProtocolError
from kvtier.protocol import (
    DEFAULT_MAX_FRAME,
    LENGTH,
    OPS,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    check_length,
    field,
    pack,
    unpack_body,
)


def body_of(frame: bytes) -> bytes:
    """Strip and check the 4-byte big-endian length prefix."""
    (n,) = LENGTH.unpack(frame[: LENGTH.size])
    assert n == len(frame) - LENGTH.size
    return frame[LENGTH.size:]


def packed(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_round_trip_keeps_bytes_and_strings_apart() -> None:
    msg = {"id": 7, "op": "lookup", "keys": b"\x00" * 32, "salt": "tenant", "n": None,
           "xs": [1, -2, 3.5, True], "m": {"k": b"v"}}
    assert unpack_body(body_of(pack(msg))) == msg


def test_length_prefix_is_big_endian_u32() -> None:
    frame = pack({"op": "ping"})
    assert frame[:4] == struct.pack(">I", len(frame) - 4)


def test_protocol_constants() -> None:
    assert PROTOCOL_VERSION in SUPPORTED_VERSIONS
    assert {"hello", "put_prepare", "put_commit", "get_prepare", "get_release"} <= OPS


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text(max_size=8), st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.binary(max_size=64),
    st.text(alphabet="abcxyz\u00e9\u4e2d", max_size=16),
    st.lists(st.integers(0, 10), max_size=4)), max_size=6))
def test_round_trip_of_arbitrary_maps(msg: dict[str, object]) -> None:
    assert unpack_body(body_of(pack(msg))) == msg


@pytest.mark.parametrize("obj", [[1, 2], "hello", 42, None, b"bytes", 1.5, True])
def test_a_frame_must_be_a_map(obj: object) -> None:
    with pytest.raises(ProtocolError, match="map"):
        unpack_body(packed(obj))


@pytest.mark.parametrize("body", [
    b"", b"\xc1", b"\x81", b"\x82\xa1a\x01", b"\xdf\xff\xff\xff\xff",
    b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
    packed({"a": 1}) + b"\x00",            # trailing bytes
    b"\x91" * 100_000 + b"\x80",            # nesting bomb
    b"\x81\xa1a\xa3\xff\xfe\xfd",          # invalid utf-8 in a str
], ids=["empty", "reserved-byte", "truncated-map", "truncated-pair", "huge-map-header",
        "huge-str-header", "huge-bin-header", "trailing", "deep-nesting", "bad-utf8"])
def test_garbage_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        unpack_body(body)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_raise_anything_but_protocol_error(body: bytes) -> None:
    try:
        msg = unpack_body(body)
    except ProtocolError:
        return
    assert isinstance(msg, dict)


@pytest.mark.parametrize("value", [
    msgpack.ExtType(5, b"payload"),
    msgpack.ExtType(127, b""),
    msgpack.Timestamp(1, 0),                                     # ext type -1
    [1, msgpack.Timestamp(1, 0)],
    {"nested": [{"t": msgpack.Timestamp(0, 5)}]},
], ids=["ext-5", "ext-127", "timestamp", "timestamp-in-list", "timestamp-nested"])
def test_ext_types_are_refused(value: object) -> None:
    with pytest.raises(ProtocolError, match="ext type"):
        unpack_body(packed({"op": "ping", "x": value}))


@pytest.mark.parametrize("ext_type", [-128, -2, -1])
def test_reserved_negative_ext_types_are_refused(ext_type: int) -> None:
    # {"x": fixext4(type, 4 zero bytes)}; -1 with 4 bytes is a valid 32-bit timestamp
    body = b"\x81\xa1x\xd6" + struct.pack("b", ext_type) + bytes(4)
    with pytest.raises(ProtocolError):
        unpack_body(body)


def test_datetime_encoded_as_timestamp_is_refused() -> None:
    body = msgpack.packb({"t": datetime.datetime.now(datetime.timezone.utc)}, datetime=True)
    with pytest.raises(ProtocolError, match="timestamp"):
        unpack_body(body)


@pytest.mark.parametrize("key", [1, None, 1.5, True])
def test_map_keys_must_be_strings(key: object) -> None:
    with pytest.raises(ProtocolError):
        unpack_body(packed({key: 1}))


def test_oversized_body_is_refused_before_decoding() -> None:
    body = packed({"blob": b"x" * 200})
    assert unpack_body(body, max_frame=len(body)) == {"blob": b"x" * 200}
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        unpack_body(body, max_frame=len(body) - 1)


@pytest.mark.parametrize(("n", "ok"), [(0, False), (1, True), (DEFAULT_MAX_FRAME, True),
                                       (DEFAULT_MAX_FRAME + 1, False), (2**32 - 1, False)])
def test_check_length(n: int, ok: bool) -> None:
    if ok:
        check_length(n, DEFAULT_MAX_FRAME)
        assert n > 0
    else:
        with pytest.raises(ProtocolError):
            check_length(n, DEFAULT_MAX_FRAME)


def test_field_returns_typed_values() -> None:
    msg = {"id": 3, "keys": b"k" * 16, "salt": None, "ok": True}
    assert field(msg, "id", int) == 3
    assert field(msg, "keys", bytes) == b"k" * 16
    assert field(msg, "salt", (str, type(None))) is None
    assert field(msg, "ok", bool) is True


@pytest.mark.parametrize(("msg", "name", "typ", "what"), [
    ({}, "id", int, "missing field 'id'"),
    ({"id": "3"}, "id", int, "type str"),
    ({"id": True}, "id", int, "type bool"),
    ({"id": 3.0}, "id", int, "type float"),
    ({"keys": "k" * 16}, "keys", bytes, "type str"),
])
def test_field_errors_name_the_field(msg: dict[str, object], name: str, typ: type,
                                     what: str) -> None:
    with pytest.raises(ProtocolError, match=what):
        field(msg, name, typ)
