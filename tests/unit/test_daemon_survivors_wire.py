"""Survivors of the request-handling mutation round: the wire forms (``kvtier.codec``,
``kvtier.prefix``), the lease table's byte counts (``kvtier.leases``) and the engines'
reports (``kvtier.daemon.engines``).

Pure Python, no process: each test builds the object and checks the one field or refusal a
mutant got wrong while every other test passed.
"""

from __future__ import annotations

import struct

import pytest

from kvtier import codec as codecs
from kvtier.daemon.engines import EngineReports
from kvtier.errors import ConfigError, FrameError, LeaseError, LeaseExpired
from kvtier.frame import Codec
from kvtier.index import BlockMeta
from kvtier.leases import EXPIRED_IDS_PER_OWNER, LeaseKind, LeaseTable
from kvtier.prefix import PrefixLocality, RedisProbe
from tests.support.store import DIGEST, FP, FakeClock


def _shuffled(elem_bytes: int, planes: list[bytes], tail: bytes = b"") -> bytes:
    """A shuffled payload as ``_encode_shuffled`` lays it out, every plane stored raw."""
    table = b"".join(struct.pack("<BI", 0, len(p)) for p in planes)
    return bytes([elem_bytes]) + table + b"".join(planes) + tail


@pytest.mark.skipif(not codecs.available(Codec.SHUFFLE_LZ4), reason="needs lz4")
def test_a_shuffled_payload_wider_than_eight_bytes_per_element_is_refused() -> None:
    """A shuffled payload names its element width in its first byte; kvtier writes 1..8
    (``_MAX_ELEM_BYTES``, the bound ``max_encoded_len`` is computed with) and a reader
    refuses any other as a corrupt frame (a miss), while the same layout at width 8
    decodes. Mutant that survived: the upper bound of the width check dropped."""
    ok = _shuffled(8, [bytes([j, j]) for j in range(8)])
    assert codecs.decode(Codec.SHUFFLE_LZ4, ok, 16) == bytes(
        b for _ in range(2) for b in range(8))
    wide = _shuffled(9, [bytes([j, j]) for j in range(9)])
    with pytest.raises(FrameError, match="element width"):
        codecs.decode(Codec.SHUFFLE_LZ4, wide, 18)


def _meta(i: int, nbytes: int) -> BlockMeta:
    return BlockMeta(bytes([i]) * 16, DIGEST, FP, nbytes, None, 0)


@pytest.mark.parametrize("kind", list(LeaseKind))
def test_an_owners_lease_bytes_add_up_over_its_leases(kind: LeaseKind) -> None:
    """``put_bytes``/``get_bytes`` of an owner are the sum over all its open leases of
    that kind (the per-process caps ``client_put_bytes``/``client_get_bytes`` read them),
    and fall by each lease's bytes as it ends. Mutant that survived: a second lease's
    bytes replaced the first's instead of adding to them, so a process holding many
    leases counted as holding one."""
    table = LeaseTable(10.0, FakeClock())
    held = table.put_bytes if kind is LeaseKind.PUT else table.get_bytes
    first = table.open(kind, 7, [_meta(1, 4096), _meta(2, 4096)])
    second = table.open(kind, 7, [_meta(3, 4096)])
    table.open(kind, 8, [_meta(4, 4096)])
    assert held(7) == 3 * 4096 and held(8) == 4096
    table.take(7, first.id, kind)
    assert held(7) == 4096
    table.take(7, second.id, kind)
    assert held(7) == 0 and held(8) == 4096


def test_a_prefix_answer_states_its_tokens_from_its_own_block_counts() -> None:
    """The wire form of a probe (``PrefixLocality.to_dict``, what /v1/prefix answers and
    routers read) gives each count in blocks and in tokens: hit, local and Redis tokens
    are their own block counts times ``tokens_per_block``, and ``from_dict`` reads it
    back as it was. Mutants that survived: ``hit_tokens`` from the local blocks,
    ``redis_tokens`` from the hit blocks."""
    p = PrefixLocality(16, 10, 7, 3, {"cpu": 2, "nvme": 1}, RedisProbe.OK, 5)
    wire = p.to_dict()
    assert (wire["hit_tokens"], wire["local_tokens"], wire["redis_tokens"]) == (112, 48, 80)
    assert (wire["hit_blocks"], wire["local_blocks"], wire["redis_blocks"]) == (7, 3, 5)
    assert PrefixLocality.from_dict(wire) == p


def test_connections_that_never_reported_are_not_counted_as_engines() -> None:
    """The stats' ``connector.engines`` counts the connections that reported as engines
    (``report_engine``); a plain client's connection (an empty report dict) is not one and
    adds nothing. Mutant that survived: empty reports were counted, so every connected
    tool or client showed up as an engine."""
    reports = EngineReports()
    engine: dict[str, float] = {}
    reports.report(engine, {"running": 2})
    assert reports.summary([engine, {}, {}]) == {"engines": 1, "running": 2.0}


def test_an_expired_lease_is_reported_expired_once_and_its_ids_are_bounded() -> None:
    """A swept lease's id is remembered for its owner: the first late use of it is a
    LeaseExpired, a second a plain LeaseError (it was used); at most
    ``EXPIRED_IDS_PER_OWNER`` ids are kept per owner (oldest forgotten), and none once the
    owner's connection closed. Mutants that survived: the id kept after it was reported
    (leases-expired-once), no bound (leases-expired-bound), and a closed owner's ids kept
    for good (leases-owner-expired-forget)."""
    clock = FakeClock()
    table = LeaseTable(10.0, clock)
    leases = [table.open(LeaseKind.GET, 7, []) for _ in range(EXPIRED_IDS_PER_OWNER + 1)]
    clock.advance(10.0)
    assert len(table.take_expired()) == EXPIRED_IDS_PER_OWNER + 1
    last = leases[-1].id
    with pytest.raises(LeaseExpired):
        table.take(7, last, LeaseKind.GET)
    with pytest.raises(LeaseError) as second:
        table.take(7, last, LeaseKind.GET)
    assert not isinstance(second.value, LeaseExpired)
    with pytest.raises(LeaseError) as forgotten:   # the oldest id, beyond the bound
        table.take(7, leases[0].id, LeaseKind.GET)
    assert not isinstance(forgotten.value, LeaseExpired)
    with pytest.raises(LeaseExpired):
        table.take(7, leases[1].id, LeaseKind.GET)
    table.take_owner(7)
    with pytest.raises(LeaseError) as closed:
        table.take(7, leases[2].id, LeaseKind.GET)
    assert not isinstance(closed.value, LeaseExpired)


def test_a_configured_codec_whose_library_is_missing_is_refused_at_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``redis.codec`` naming a codec whose library is not installed is a ConfigError
    when the config is read (the daemon does not start), not failed writes later; ``auto``
    is taken. Mutant that survived (codec-config-avail): the check dropped (this machine
    has both libraries, so no test had a codec unavailable)."""
    monkeypatch.setattr(codecs, "available", lambda codec: False)
    for name in ("shuffle-lz4", "shuffle-zstd"):
        with pytest.raises(ConfigError, match="needs the"):
            codecs.from_config(name)
    assert codecs.from_config("auto") is None
