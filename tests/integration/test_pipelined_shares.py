"""Per-process caps hold for prepares pipelined on one connection (a real daemon).

A prepare checks its process's share and then awaits the store (eviction, an nvme
promotion), which opens the lease only at its end; the caps counted open leases only, so
every pipelined prepare saw the whole share: one process held a full arena's every slot
in open puts (another process then stored 0 of 8), pinned all of it in gets, and opened
four times its lease cap (found by review). ``kvtier.daemon.inflight`` reserves first."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.errors import LimitExceeded
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.protocol import pack
from tests.support.daemon import DaemonProcess
from tests.support.raw import register, reply
from tests.support.victim import victim

LAYOUT = KVLayout(2, 2, 32, "float16", 64)
BB = LAYOUT.block_bytes
ARENA = 64
SHARE = ARENA // 2   # the default client_put_share and client_get_share: 0.5


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "kvd", cpu_bytes=str(ARENA * BB), nvme_bytes="64MiB",
                       env={"KVTIER_POLICY_EVICTION": "lru",
                            "KVTIER_DAEMON_MAX_LEASES_PER_CLIENT": "8"}) as d:
        yield d


def _greedy(d: DaemonProcess) -> tuple[socket.socket, Namespace]:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(str(d.socket))
    s.sendall(pack({"id": 1, "op": "hello", "version": 1}))
    assert reply(s)["ok"]
    ns = Namespace("m", LAYOUT, 0, 1, "greedy")
    register(s, ns)
    return s, ns


def _req(rid: int, op: str, ns: Namespace, keys: list[bytes], **kw: Any) -> bytes:
    return pack({"id": rid, "op": op, "ns": ns.digest, "layout_fp": LAYOUT.fingerprint,
                 "keys": b"".join(keys), **kw})


def _store_chain(s: socket.socket, ns: Namespace, keys: list[bytes]) -> None:
    for i in range(0, len(keys), 16):
        s.sendall(_req(2, "put_prepare", ns, keys[i:i + 16],
                       parent=keys[i - 1] if i else None, depth=i))
        r = reply(s)
        assert r["ok"], r
        s.sendall(pack({"id": 3, "op": "put_commit", "lease": r["lease"]}))
        assert reply(s)["ok"]


def _pipelined(s: socket.socket, frames: list[bytes]) -> list[dict[str, Any]]:
    s.sendall(b"".join(frames))
    return [reply(s) for _ in frames]


def test_pipelined_puts_hold_at_most_the_share(daemon: DaemonProcess) -> None:
    s, ns = _greedy(daemon)
    _store_chain(s, ns, block_keys(ns, np.arange(ARENA * 64) + 10**8))   # a full arena
    replies = _pipelined(s, [
        _req(10 + j, "put_prepare", ns, block_keys(ns, np.arange(SHARE * 64) + j * 10**6))
        for j in range(8)])
    assert all(r["ok"] for r in replies), replies
    held = sum(o is not None for r in replies for o in r["offsets"])
    assert 0 < held <= SHARE     # (before: 64, the whole arena)
    assert daemon.stats()["daemon"]["capped_puts"] >= 1
    assert victim(daemon.socket, 8) == (8, 8, 8)   # (before: 0 stored)


def test_pipelined_gets_pin_at_most_the_share(daemon: DaemonProcess) -> None:
    s, ns = _greedy(daemon)
    chains = [block_keys(ns, np.arange(SHARE * 64) + j * 10**7) for j in range(4)]
    for keys in chains:   # twice the arena: the older chains are on nvme
        _store_chain(s, ns, keys)
    # four gets of a chain each, those on nvme awaiting promotions before their lease opens
    replies = _pipelined(s, [_req(10 + j, "get_prepare", ns, keys)
                             for j, keys in enumerate(chains)])
    assert all(r["ok"] for r in replies), replies
    pinned = sum(len(r["offsets"]) for r in replies)
    assert 0 < pinned <= SHARE   # (before: 64, the whole arena)
    assert daemon.stats()["daemon"]["capped_gets"] >= 1


def test_pipelined_prepares_open_at_most_the_lease_cap(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "kvd", cpu_bytes=str(ARENA * BB), nvme_bytes="64MiB",
                       env={"KVTIER_POLICY_EVICTION": "lru",
                            "KVTIER_DAEMON_MAX_LEASES_PER_CLIENT": "2"}) as d:
        s, ns = _greedy(d)
        keys = block_keys(ns, np.arange(2 * ARENA * 64))
        _store_chain(s, ns, keys)
        replies = _pipelined(s, [_req(10 + j, "get_prepare", ns, keys[j * 4:(j + 1) * 4])
                                 for j in range(8)])
        assert sum(r["ok"] for r in replies) <= 2   # (before: 8 open at once)
        assert {r["code"] for r in replies if not r["ok"]} == {LimitExceeded.code}


def test_pipelined_puts_of_a_stored_prefix_reserve_only_their_new_blocks(
        daemon: DaemonProcess) -> None:
    """Each prepare reserved a slot for every key, its stored prefix included: four puts of
    a 40-block stored prefix and 8 new blocks each used up the share while they evicted,
    and the last two were capped to 0 new blocks (found by review)."""
    s, ns = _greedy(daemon)
    prefix = np.arange(40 * 64)
    _store_chain(s, ns, block_keys(ns, prefix))
    _store_chain(s, ns, block_keys(ns, np.arange(24 * 64) + 10**7))   # the arena is full
    replies = _pipelined(s, [
        _req(10 + j, "put_prepare", ns,
             block_keys(ns, np.concatenate([prefix, 10**8 * (j + 1) + np.arange(8 * 64)])))
        for j in range(4)])
    assert [sum(o is not None for o in r["offsets"]) for r in replies] == [8, 8, 8, 8]
    assert daemon.stats()["daemon"]["capped_puts"] == 0
