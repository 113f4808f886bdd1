"""Every reply field the client reads is checked (found by review): a missing, mistyped or
out-of-range field is a ProtocolError naming it, never a KeyError/TypeError/ValueError/
IndexError in the caller nor a count believed; hbm offsets get the checks cpu offsets get;
a hello's bools are not ints. A same-uid daemon in a thread of the test process
(tests.support.fake_daemon.HostileSocketDaemon) says what each test wants."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.client import connect, connect_async
from kvtier.client.replies import devices_of, get_slots, lookup_hits, prefix_results, slot_offsets
from kvtier.errors import BufferSizeError, HandshakeError, ProtocolError
from kvtier.keys import KEY_SCHEME, block_keys
from kvtier.layout import KVLayout
from kvtier.tiers import hbm as hbm_mod
from kvtier.tiers.aligned import PAGE
from kvtier.tiers.hbm_mapping import HbmMapping
from tests.support.fake_daemon import HostileSocketDaemon

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=16)   # 8 KiB blocks: two pages
NB = LAYOUT.block_bytes
TOKENS = np.arange(2 * 16)   # two blocks


def answering(replies: dict[str, dict[str, Any]]) -> Callable[[socket.socket, dict[str, Any]],
                                                             None]:
    def handler(conn: socket.socket, req: dict[str, Any]) -> None:
        HostileSocketDaemon.send(conn, {"id": req["id"], "ok": True,
                                        **replies.get(req["op"], {})})
    return handler


def _get(c: Any, ns: Any, keys: Any) -> Any:
    return c.get(ns, keys, [np.zeros(NB, np.uint8) for _ in keys])


def _put(c: Any, ns: Any, keys: Any) -> Any:
    return c.put(ns, keys, [np.zeros(NB, np.uint8) for _ in keys])


PUT_OK = {"lease": 1, "offsets": [0, NB]}
CASES: dict[str, tuple[dict[str, dict[str, Any]], Callable[[Any, Any, Any], Any], str]] = {
    "stats missing": ({"stats": {}}, lambda c, ns, k: c.stats(), "stats"),
    "stats a list": ({"stats": {"stats": [1]}}, lambda c, ns, k: c.stats(), "stats"),
    "deleted missing": ({"delete": {}}, lambda c, ns, k: c.delete(ns, k), "deleted"),
    "deleted a str": ({"delete": {"deleted": "x"}}, lambda c, ns, k: c.delete(ns, k),
                      "deleted"),
    "deleted beyond the keys": ({"delete": {"deleted": 3}},
                                lambda c, ns, k: c.delete(ns, k), "deleted"),
    "get lease missing": ({"get_prepare": {"offsets": [0, NB]}}, _get, "lease"),
    "get lease a bool": ({"get_prepare": {"lease": True, "offsets": [0]}}, _get, "lease"),
    "devices an int": ({"get_prepare": {"lease": 1, "offsets": [0], "devices": 5}}, _get,
                       "devices"),
    "put lease missing": ({"put_prepare": {"offsets": [0, NB]}}, _put, "lease"),
    "stored a list": ({"put_prepare": PUT_OK, "put_commit": {"stored": [1]}}, _put,
                      "stored"),
    "stored a str": ({"put_prepare": PUT_OK, "put_commit": {"stored": "x"}}, _put, "stored"),
    "stored beyond the keys": ({"put_prepare": PUT_OK, "put_commit": {"stored": 10**6}},
                               _put, "stored"),
    "stored negative": ({"put_prepare": {"lease": 1, "offsets": [None, None]},
                         "put_commit": {"stored": -7}}, _put, "stored"),
    "results an int": ({"prefix_locality": {"results": 5}},
                       lambda c, ns, k: c.prefix_locality(ns, TOKENS), "results"),
    "results empty": ({"prefix_locality": {"results": []}},
                      lambda c, ns, k: c.prefix_locality(ns, TOKENS), "results"),
    "result without fields": ({"prefix_locality": {"results": [{}]}},
                              lambda c, ns, k: c.prefix_locality(ns, TOKENS), "prefix"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_reply_field_is_a_protocol_error(tmp_path: Path, case: str) -> None:
    replies, call, field_name = CASES[case]

    with HostileSocketDaemon(tmp_path, NB, handler=answering(replies)) as d:
        c = connect(d.path, timeout=2)
        ns = c.register_layout(LAYOUT, "m")
        with pytest.raises(ProtocolError, match=field_name):
            call(c, ns, block_keys(ns, TOKENS))
        c.close()


def test_a_registration_without_its_namespace_is_a_protocol_error(tmp_path: Path) -> None:
    with HostileSocketDaemon(tmp_path, NB, handler=answering({}),
                             answer_register=False) as d:
        c = connect(d.path, timeout=2)
        with pytest.raises(ProtocolError, match="namespace"):
            c.register_layout(LAYOUT, "m")
        c.close()


def test_the_async_client_checks_the_same_fields(tmp_path: Path) -> None:
    async def run(d: HostileSocketDaemon) -> None:
        c = await connect_async(d.path, timeout=2)
        ns = await c.register_layout(LAYOUT, "m")
        keys = block_keys(ns, TOKENS)
        with pytest.raises(ProtocolError, match="stats"):
            await c.stats()
        with pytest.raises(ProtocolError, match="deleted"):
            await c.delete(ns, keys)
        with pytest.raises(ProtocolError, match="stored"):
            await c.put(ns, keys, [np.zeros(NB, np.uint8)] * 2)
        await c.close()

    replies: dict[str, dict[str, Any]] = {"stats": {}, "delete": {"deleted": 5},
               "put_prepare": PUT_OK, "put_commit": {"stored": 3}}
    with HostileSocketDaemon(tmp_path, NB, handler=answering(replies)) as d:
        asyncio.run(run(d))


def test_the_safety_net_types_an_error_a_check_missed() -> None:
    from kvtier.client.replies import reads_reply

    @reads_reply
    def op() -> Any:
        reply = yield {"op": "x"}
        return reply["missing"]

    gen = op()
    next(gen)
    with pytest.raises(ProtocolError, match="KeyError"):
        gen.send({})


POOL = 16 * NB


class _HostPool(HbmMapping):
    """The real HbmMapping's checks over no memory (cupy is absent): ``view`` returns the
    device address the real one would wrap."""

    def view(self, offset: int, nbytes: int) -> Any:
        return self.device_ptr(offset, nbytes)


HBM_CASES = [("a bool", [True]), ("a float", [1.5]), ("off a slot boundary", [NB + 7]),
             ("the same slot twice", [NB, NB]), ("overlapping", [0, 4096]),
             ("past the pool", [POOL])]


@pytest.mark.parametrize("offsets", [o for _, o in HBM_CASES], ids=[n for n, _ in HBM_CASES])
def test_hbm_offsets_get_the_checks_cpu_offsets_get(tmp_path: Path, offsets: list[Any],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hbm_mod.HbmMapping, "open", classmethod(
        lambda cls, handle, size, device=0, pci_bus_id=None: _HostPool(1 << 40, size, 0)))
    released: list[int] = []

    def handler(conn: socket.socket, req: dict[str, Any]) -> None:
        if req["op"] == "get_release":
            released.append(req["lease"])
        answering({"get_prepare": {"lease": 3, "offsets": offsets, "ttl_s": 30.0,
                                   "devices": ["hbm"] * len(offsets)}})(conn, req)

    with HostileSocketDaemon(tmp_path, NB, handler=handler, hello_extra={
            "hbm": {"handle": b"\x01" * 64, "size": POOL, "device": 0}}) as d:
        c = connect(d.path, timeout=2, device=True)
        ns = c.register_layout(LAYOUT, "m")
        with pytest.raises(ProtocolError):
            c.prepare_get(ns, block_keys(ns, TOKENS))
        c.ping()   # (the release went out without a wait)
        assert released == [3]
        c.close()


ARENA = 16 * NB
PREFIX_RESULT = {"tokens_per_block": 16, "prompt_blocks": 2, "hit_blocks": 2,
                 "local_blocks": 2, "redis_blocks": 0, "tier_blocks": {"cpu": 2},
                 "redis": "off"}
REPLY_CHECKS: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    # name: (the check on a reply it must refuse, the same check on a sound one)
    "a slot running past the arena's end": (
        lambda: slot_offsets([ARENA - PAGE], 1, NB, ARENA, exact=False),
        lambda: slot_offsets([ARENA - NB], 1, NB, ARENA, exact=False)),
    "a get offset of None": (
        lambda: slot_offsets([0, None], 2, NB, ARENA, exact=False),
        lambda: slot_offsets([0, None], 2, NB, ARENA, exact=True)),   # a put's: no write
    "an offset a float": (
        lambda: slot_offsets([0.0], 1, NB, ARENA, exact=False),
        lambda: slot_offsets([0], 1, NB, ARENA, exact=False)),
    "an offset a bool": (
        lambda: slot_offsets([NB, False], 2, NB, ARENA, exact=False),
        lambda: slot_offsets([NB, 0], 2, NB, ARENA, exact=False)),
    "more hits than keys": (
        lambda: lookup_hits({"hits": 3, "tiers": ["cpu"] * 3}, 2),
        lambda: lookup_hits({"hits": 2, "tiers": ["cpu"] * 2}, 2)),
    "hbm slots to a client that asked for none": (
        lambda: get_slots({"offsets": [0], "devices": ["hbm"]}, 1, NB, ARENA, None),
        lambda: get_slots({"offsets": [0], "devices": ["hbm"]}, 1, NB, ARENA, ARENA)),
    "a device neither cpu nor hbm": (
        lambda: get_slots({"offsets": [0, NB], "devices": ["cpu", "gpu"]}, 2, NB, ARENA,
                          ARENA),
        lambda: get_slots({"offsets": [0, NB], "devices": ["cpu", "hbm"]}, 2, NB, ARENA,
                          ARENA)),
    "a device spelled otherwise": (
        lambda: devices_of({"devices": ["CPU"]}, 1),
        lambda: devices_of({"devices": ["cpu"]}, 1)),
    "more hit blocks than prompt blocks": (
        lambda: prefix_results({"results": [dict(PREFIX_RESULT, hit_blocks=3)]}, 1),
        lambda: prefix_results({"results": [PREFIX_RESULT]}, 1)),
}


@pytest.mark.parametrize("case", list(REPLY_CHECKS))
def test_each_reply_check_refuses_what_it_guards(case: str) -> None:
    """The checks of kvtier.client.replies on reply values, without a socket: a slot that
    ends past the arena (the copy would read or write beyond the mapping), a get offset of
    None or of another type than int (a bool or float is no slot), a hit count beyond the
    keys asked (with a tiers list that agrees with it), hbm slots to a client that mapped
    no pool, a device the client does not know (it would copy from the wrong memory), a
    prefix result with more hit blocks than blocks: each a ProtocolError, where the same
    reply made sound is accepted."""
    refused, sound = REPLY_CHECKS[case]
    sound()
    with pytest.raises(ProtocolError):
        refused()


def test_an_hbm_mapping_refuses_a_bool_or_float_offset() -> None:
    pool = HbmMapping(1 << 40, POOL, 0)
    for offset in (True, 1.5):
        with pytest.raises(BufferSizeError):
            pool.device_ptr(offset, NB)   # type: ignore[arg-type]


@pytest.mark.parametrize("extra,error", [
    ({"version": True}, HandshakeError),
    ({"arena": {"size": True}}, ProtocolError),
    ({"arena": {"path": "/dev/shm/a\x00b"}}, ProtocolError),
], ids=["version True", "arena size True", "NUL in the path"])
def test_a_hello_with_a_bool_or_a_nul_is_refused(tmp_path: Path, extra: dict[str, Any],
                                                 error: type[Exception]) -> None:
    def hello(conn: socket.socket, req: dict[str, Any]) -> None:
        arena = {"path": str(d.arena), "size": d.size, **extra.get("arena", {})}
        reply = {"id": req["id"], "ok": True, "version": 1, "conn": 1, "arena": arena,
                 **{k: v for k, v in extra.items() if k != "arena"}}
        HostileSocketDaemon.send(conn, reply)   # (no descriptor: the path is used)

    with HostileSocketDaemon(tmp_path, NB, hello=hello) as d, pytest.raises(error):
        connect(d.path, timeout=2).close()


def test_put_bytes_is_bounded_by_the_arena(tmp_path: Path) -> None:
    with HostileSocketDaemon(tmp_path, NB, hello=lambda conn, req: d.greet(
            conn, req, arena={"path": str(d.arena), "size": d.size,
                              "put_bytes": 2**63 - 1})) as d:
        c = connect(d.path, timeout=2)
        assert c.put_bytes == d.size
        c.close()


@pytest.mark.parametrize("scheme,refused", [
    ("xxh3_128-chain/1", True), (KEY_SCHEME, False), (None, False)],
    ids=["another scheme", "this scheme", "not announced"])
def test_a_daemon_that_keys_blocks_otherwise_is_refused_at_the_hello(
        tmp_path: Path, scheme: str | None, refused: bool) -> None:
    """A daemon started before kvtier was upgraded under it keys blocks with the old
    scheme: every register_layout failed with "incompatible kvtier versions", naming
    neither the scheme nor the fix (found by review). The daemon now announces its scheme,
    and a client of another one is told at the hello, with the way out."""
    def hello(conn: socket.socket, req: dict[str, Any]) -> None:
        reply = {"id": req["id"], "ok": True, "version": 1, "conn": 1, "server": "kvtier/0.0.9",
                 "arena": {"path": str(d.arena), "size": d.size}}
        if scheme is not None:
            reply["key_scheme"] = scheme
        HostileSocketDaemon.send(conn, reply)

    with HostileSocketDaemon(tmp_path, NB, hello=hello) as d:
        if refused:
            with pytest.raises(HandshakeError, match="restart the daemon after upgrading"):
                connect(d.path, timeout=2)
        else:
            connect(d.path, timeout=2).close()
