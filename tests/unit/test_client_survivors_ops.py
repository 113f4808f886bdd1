"""Survivors of the client mutation round: the sans-I/O ops (``kvtier.client.ops``) and the
lease rules (``kvtier.client.leases``), driven by hand or by both clients' ``_run`` over the
scripted daemon of test_client_ops (a real arena mapping; no socket, no process)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvtier.client import PUT_BATCH
from kvtier.client import ops as ops_mod
from kvtier.client.ops import RELEASE_SAFE_SHARE, Op, Ops
from kvtier.client.replies import LookupResult, ReplyBound, get_slots, slot_offsets
from kvtier.errors import HandshakeError, LeaseExpired, ProtocolError
from kvtier.tiers.aligned import PAGE
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.hbm_mapping import HbmMapping
from tests.support.arena import temp_arena
from tests.unit.test_client_ops import (
    BLOCK,
    NS,
    AsyncDriver,
    ScriptedDaemon,
    SyncDriver,
    blocks,
    keys,
)


def request(sent: Any) -> dict[str, Any]:
    """What an op yielded, as the request it is (not a NoWait or a Settle)."""
    assert isinstance(sent, dict), sent
    return sent


def finish(op: Op, reply: dict[str, Any]) -> Any:
    """Send ``reply`` to the op's one request; its result."""
    next(op)
    with pytest.raises(StopIteration) as stop:
        op.send(reply)
    return stop.value.value


@pytest.fixture
def registered() -> Iterator[Ops]:
    """Ops over a real arena mapping, its namespace not registered yet."""
    with temp_arena(1 << 20, 1 << 20) as arena:
        o = Ops()
        o.arena = ArenaMapping(str(arena.path), arena.size)
        yield o
        o.close()


@pytest.fixture
def ops(registered: Ops) -> Ops:
    """Ops whose namespace is registered (as test_client_ops' fixture)."""
    registered._registered.add(NS.digest)
    return registered


@pytest.fixture(params=["sync", "async"])
def driver(request: pytest.FixtureRequest) -> type[SyncDriver] | type[AsyncDriver]:
    """Both clients' ``_run`` over the scripted daemon: they must behave alike."""
    return SyncDriver if request.param == "sync" else AsyncDriver


# -- registration and put -----------------------------------------------------------------
@pytest.mark.parametrize("max_keys", [0, -3])
def test_a_registration_that_names_no_positive_limit_sets_none(registered: Ops,
                                                               max_keys: int) -> None:
    """A ``max_keys`` of 0 or less in a registration reply is no limit (the daemon did not
    say one), never a bound every put exceeds. Mutant that survived: any int was taken,
    so after ``max_keys: 0`` every put of this namespace was refused (LimitExceeded)."""
    finish(registered.op_register(NS.layout, NS.model_id, 0, 1, None),
           {"ok": True, "ns": NS.digest, "max_keys": max_keys})
    op = registered.op_put(NS, keys(2), blocks(2), False, None)
    assert request(next(op))["op"] == "put_prepare"


def test_a_piece_at_a_depth_names_its_depth_even_without_a_parent(ops: Ops) -> None:
    """``prepare_put(start_depth=d)`` with no parent still tells the daemon the depth (the
    piece's blocks are stored at their place in the chain). Mutant that survived: the depth
    went only with a parent, so such a piece was stored as a chain's first blocks."""
    req = request(next(ops.op_prepare_put(NS, keys(1), None, 5)))
    assert req["depth"] == 5 and req["parent"] is None
    assert "depth" not in request(next(ops.op_prepare_put(NS, keys(1), None, 0)))


def test_a_put_lease_whose_offsets_are_refused_is_aborted_at_once(ops: Ops) -> None:
    """A put_prepare reply whose offsets the client refuses is a ProtocolError, and the
    lease it granted is aborted right away (quietly): nothing was written, and the slots
    must not stay write-locked until the TTL. Mutant that survived: the abort was dropped,
    so every such reply pinned its slots for a whole TTL."""
    op = ops.op_prepare_put(NS, keys(2), None, 0)
    next(op)
    abort = request(op.send({"ok": True, "lease": 9, "offsets": [0]}))   # one for two keys
    assert abort == {"op": "put_abort", "lease": 9}
    with pytest.raises(ProtocolError, match="1 offsets for 2 keys"):
        op.throw(LeaseExpired("the abort's own error is not the caller's"))


def test_a_put_of_exactly_one_batch_reports_its_output_tokens(ops: Ops, driver: Any) -> None:
    """The commit of a put's last batch carries ``output_tokens``, also when the put is
    exactly one batch long. Mutant that survived: the last batch was found with ``>``, so a
    put of exactly PUT_BATCH blocks never reported its output tokens."""
    daemon = ScriptedDaemon()
    driver(daemon).run(ops.op_put(NS, keys(PUT_BATCH), blocks(PUT_BATCH), False, 17))
    assert [r.get("output_tokens") for r in daemon.requests] == [None, 17]


# -- commit replies ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [{"redis_synced": 1}, {"redis_synced": "yes"},
                                 {"redis_sync_reason": "x" * 33},
                                 {"redis_visible": 3}, {"redis_visible": -1}],
                         ids=["synced int", "synced str", "reason long", "visible beyond",
                              "visible negative"])
def test_a_synchronous_commit_checks_what_it_reports(bad: dict[str, Any]) -> None:
    """A commit with ``redis_sync_s`` believes ``redis_synced`` only as a bool, a reason of
    at most 32 characters, and ``redis_visible`` only within the keys committed. Mutants
    that survived: any non-None synced, a reason of any length, any visible count."""
    reply = {"ok": True, "stored": 2, "redis_visible": 2, "redis_synced": True, **bad}
    with pytest.raises(ProtocolError):
        finish(Ops.op_commit_sync(3, False, None, 1.0, 2), reply)
    assert finish(Ops.op_commit_sync(3, False, None, 1.0, 2),
                  {"ok": True, "stored": 2, "redis_visible": 2, "redis_synced": True,
                   "redis_sync_reason": "x" * 32}) == (2, 2, True, "x" * 32)


# -- get: device placement and the safe window ---------------------------------------------
class FakePool:
    """An HBM mapping already opened (``Ops.hbm``): a device get may be asked."""

    size = 1 << 20


def test_a_copying_get_never_asks_for_device_placement(ops: Ops) -> None:
    """``get`` copies through cpu views whatever the client's ``device`` default: it asks
    the daemon for none (``prefer_device=False`` wins over ``device=True``). Mutant that
    survived: False was read as "use the default", so a GPU engine's get asked for hbm
    slots and read device views into host buffers."""
    ops.device = True
    ops.hbm = FakePool()
    out = [np.zeros(BLOCK, np.uint8)]
    assert "device" not in request(next(ops.op_get(NS, keys(1), out)))
    assert request(next(ops.op_prepare_get(NS, keys(1))))["device"] is True
    ops.hbm = None


def test_a_get_asks_for_device_placement_only_with_a_pool_mapped(ops: Ops) -> None:
    """``prefer_device=True`` on a client that has no HBM pool mapped (the daemon has none,
    or it could not be mapped here) asks for cpu slots: hbm slots would be a
    ProtocolError. Mutant that survived: the preference alone sent ``device``."""
    assert "device" not in request(next(ops.op_prepare_get(NS, keys(1), prefer_device=True)))


def test_the_safe_window_starts_before_the_get_is_asked(
        ops: Ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """The window in which a release may skip its reply runs from before the get_prepare
    went out (the daemon's TTL runs from later): a slow reply shortens it, never moves it.
    Mutant that survived: the clock was read after the reply, so a reply that took long
    stretched the window past what the daemon guarantees."""
    clock = [100.0]

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return clock[0]

    monkeypatch.setattr(ops_mod, "time", Clock)
    op = ops.op_prepare_get(NS, keys(1))
    next(op)
    clock[0] += 7.0   # the reply takes 7 s
    with pytest.raises(StopIteration) as stop:
        op.send({"ok": True, "lease": 1, "offsets": [0], "ttl_s": 20.0})
    assert stop.value.value[3] == 100.0 + RELEASE_SAFE_SHARE * 20.0


def test_the_safe_window_is_at_most_half_the_ttl() -> None:
    """A release skips its reply only within half the lease's TTL (docs: a round trip off
    every load, while the slots are provably held): the margin covers the time between the
    copy's end and the check. Mutant that survived: a share of 0.95 of the TTL."""
    assert 0 < RELEASE_SAFE_SHARE <= 0.5


# -- lookup and close ----------------------------------------------------------------------
def test_a_lookup_of_no_keys_asks_nothing(ops: Ops) -> None:
    """A lookup of an empty chain is answered here (0 hits) without a round trip. Mutant
    that survived: it was sent to the daemon like any other."""
    op = ops.op_lookup(NS, [], True)
    with pytest.raises(StopIteration) as stop:
        next(op)
    assert (stop.value.value.hits, stop.value.value.tiers) == (0, [])


class ClosingView:
    """A presence filter that records its close."""

    closed = 0

    def close(self) -> None:
        self.closed += 1


def test_close_unmaps_the_presence_filter(ops: Ops) -> None:
    """``close`` closes the presence filter's mapping (and forgets it: a second close does
    nothing). Mutant that survived: the filter stayed mapped (a mapping and a descriptor
    leaked per client)."""
    view = ClosingView()
    ops.presence = view  # type: ignore[assignment]
    ops.close()
    ops.close()
    assert view.closed == 1 and ops.presence is None


# -- registration, hello, probes and reports ----------------------------------------------
def test_a_registration_naming_another_namespace_is_refused(registered: Ops) -> None:
    """A registration reply whose ``ns`` digest is not the client's (a daemon keying blocks
    with another kvtier version) is a HandshakeError, and the namespace stays unregistered.
    Mutant that survived: only a missing digest was refused, a different one taken."""
    with pytest.raises(HandshakeError, match="another namespace digest"):
        finish(registered.op_register(NS.layout, NS.model_id, 0, 1, None),
               {"ok": True, "ns": b"\x00" * len(NS.digest)})
    assert NS.digest not in registered._registered


@pytest.mark.parametrize("announced", [-4096, 0, True])
def test_a_hello_announcing_no_positive_put_budget_means_unknown(announced: Any) -> None:
    """A hello's ``put_bytes`` is believed only as a positive int (capped at the arena);
    anything else is 0, "not announced". Mutant that survived: a negative or zero int was
    taken as the budget (a negative put budget)."""
    with temp_arena(1 << 20, 1 << 20) as arena:
        o = Ops()
        o.on_hello({"version": 1, "arena": {"path": str(arena.path), "size": arena.size,
                                            "put_bytes": announced}})
        assert o.put_bytes == 0
        o.close()


def test_a_batch_probe_names_each_prompts_length() -> None:
    """``prefix_locality_batch`` sends one chain length per prompt (the daemon splits the
    keys by them). Mutant that survived: only the first prompt's length was sent."""
    tokens = NS.layout.tokens_per_block
    req = request(next(Ops.op_prefix(NS, [range(2 * tokens), range(3 * tokens)], True, True)))
    assert req["lengths"] == [2, 3]
    assert "lengths" not in request(next(Ops.op_prefix(NS, [range(tokens)], True, False)))


def test_a_report_names_the_engine_it_comes_from(ops: Ops) -> None:
    """``report_engine(engine_id=...)`` sends the engine's id (the daemon counts its
    cumulative counters once across reconnects by it). Mutant that survived: the id was
    dropped, so a reconnecting engine's counters were counted again."""
    assert request(next(ops.op_report({"running": 2.0}, "engine-7"))) == {
        "op": "report_engine", "running": 2.0, "engine_id": "engine-7"}
    assert "engine_id" not in request(next(ops.op_report({"running": 2.0})))


# -- the HBM pool: mapped at most once, only on its own GPU --------------------------------
POOL = {"handle": b"h" * 64, "size": 1 << 20, "device": 1, "pci_bus_id": "0000:02:00.0"}


def test_a_pool_on_another_gpu_is_not_mapped_and_not_tried_again(
        ops: Ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device get on a client whose current GPU is not the pool's asks for cpu slots and
    never maps the pool (a CUDA context on the other GPU); the answer is kept, so later
    gets do not ask CUDA again. Mutants that survived: the GPU check dropped (the pool was
    mapped from another GPU); a failure was tried again at every get."""
    asked: list[tuple[int, str | None]] = []

    def on_current_device(device: int = 0, *, pci_bus_id: str | None = None) -> bool:
        asked.append((device, pci_bus_id))
        return False

    def must_not_open(*_: Any, **__: Any) -> None:
        raise AssertionError("the pool was mapped from another GPU")

    monkeypatch.setattr(HbmMapping, "on_current_device", on_current_device)
    monkeypatch.setattr(HbmMapping, "open", must_not_open)
    ops.hbm_info = dict(POOL)
    for _ in range(2):
        assert "device" not in request(next(ops.op_prepare_get(NS, keys(1),
                                                               prefer_device=True)))
    assert asked == [(1, "0000:02:00.0")]
    assert ops.hbm is None and ops.hbm_error is not None


@pytest.mark.parametrize(("offsets", "error"), [
    ([PAGE, PAGE], "overlapping"), ([0, 3 * PAGE, 0], "overlapping"),
    ([BLOCK], "slot boundary"), ([0, PAGE + 8], "slot boundary")])
def test_two_keys_never_share_a_slot_nor_straddle_one(offsets: list[int], error: str) -> None:
    """A reply naming the same slot for two keys (a get would hand out one block's bytes
    as the other's, a put would write two blocks into one slot), or an offset off a slot
    boundary (straddling two slots), is a ProtocolError. Mutants that survived: the
    overlap check looked only at three or more offsets; the boundary check dropped."""
    for exact in (True, False):
        with pytest.raises(ProtocolError, match=error):
            slot_offsets(offsets, len(offsets), BLOCK, 1 << 20, exact=exact)
    assert slot_offsets([0, PAGE], 2, BLOCK, 1 << 20, exact=True) == [0, PAGE]


def test_a_negative_slot_is_refused_by_the_reply_check() -> None:
    """``slot_offsets`` refuses a negative offset itself (a slice from it would count from
    the arena's end: another block's bytes), before any view exists: a put lease with one
    is then aborted at once, not left to its TTL. Mutant that survived: the lower bound
    dropped (only the arena mapping's own check stood behind it, after the abort point)."""
    with pytest.raises(ProtocolError, match="outside the arena"):
        slot_offsets([-PAGE], 1, BLOCK, 1 << 20, exact=True)
    assert slot_offsets([PAGE], 1, BLOCK, 1 << 20, exact=True) == [PAGE]


def test_more_slots_than_keys_across_both_devices_are_refused() -> None:
    """A get reply naming more slots than keys asked is a ProtocolError also when they are
    split between the arena and the HBM pool (each device's share alone fits). Mutant that
    survived: only each device's count was checked, so one key got two views."""
    with pytest.raises(ProtocolError, match="2 offsets for 1 keys"):
        get_slots({"offsets": [0, 0], "devices": ["cpu", "hbm"]}, 1, BLOCK, 1 << 20, 1 << 20)
    assert get_slots({"offsets": [0, 0], "devices": ["cpu", "hbm"]}, 2, BLOCK, 1 << 20,
                     1 << 20) == ([0, 0], ["cpu", "hbm"])


def test_a_lookup_names_one_tier_per_hit() -> None:
    """A lookup reply's ``tiers`` has one entry per hit: fewer or more is a ProtocolError
    (a caller indexing tiers by block would fail, or read a tier for a miss). Mutant that
    survived: the length of tiers was not compared with hits."""
    for tiers in (["cpu"], ["cpu", "nvme", "cpu"]):
        with pytest.raises(ProtocolError, match="tiers"):
            LookupResult.from_reply({"hits": 2, "tiers": tiers}, 3)


def test_a_lookup_believes_only_finite_positive_bandwidths() -> None:
    """The reload bandwidths of a lookup reply are kept only when finite and positive: a
    connector divides block bytes by them to decide whether a reload beats recomputing.
    Mutant that survived: any number was kept (inf, nan, 0, negatives)."""
    reply = {"hits": 0, "tiers": [], "bandwidth": {
        "cpu": 8e9, "nvme": float("inf"), "redis": float("nan"), "hbm": 0, "x": -1.0}}
    assert LookupResult.from_reply(reply, 1).bandwidth == {"cpu": 8e9}


def test_a_wider_bound_widens_each_limit_it_needs() -> None:
    """The asyncio client's reply bound (the widest of its requests') takes the larger of
    each limit: a request with more entries in all but no larger arrays still widens the
    entries. Mutant that survived: the bound was kept whole whenever its item limit fit,
    so a reply the request allows was refused as too large."""
    assert ReplyBound(10, 100).wider(ReplyBound(5, 200)) == ReplyBound(10, 200)
    assert ReplyBound(10, 100).wider(ReplyBound(20, 50)) == ReplyBound(20, 100)
    assert ReplyBound(10, 100).wider(ReplyBound(5, 50)) == ReplyBound(10, 100)
