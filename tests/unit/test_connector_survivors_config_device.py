"""One arena mapping per process (``device.ArenaRegistry``), on real mappings of private
files with clients stood in (mutation review survivors): clients share the first mapping
of an arena file, a new file under the same path (a restarted daemon) is never read
through the old mapping, and registration happens once and never takes the engine down."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiers.arena_mapping import ArenaMapping
from tests.support.vllm_fakes import fake

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.device import ArenaRegistry

SIZE = 4096


def arena_file(path: Path, fill: int, size: int = SIZE) -> str:
    """A private arena file of ``size`` bytes of ``fill`` (a new file: its own inode)."""
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, bytes([fill]) * size)
    finally:
        os.close(fd)
    return str(path)


def client(path: str, size: int = SIZE) -> Any:
    """A client as ``kvtier.client`` leaves it after mapping the daemon's arena."""
    return fake(_ops=fake(arena_path=path, arena=ArenaMapping(path, size)))


def test_clients_of_one_arena_share_the_first_mapping_registered_once(
        tmp_path: Path) -> None:
    path = arena_file(tmp_path / "arena", 1)
    calls: list[tuple[int, int]] = []
    def register(address: int, nbytes: int) -> bool:
        calls.append((address, nbytes))
        return True

    reg = ArenaRegistry(register=register)
    first, second = client(path), client(path)
    own = second._ops.arena
    reg.adopt(first)
    reg.adopt(second)
    shared = first._ops.arena
    assert second._ops.arena is shared and shared.keep_mapped
    assert own.buf.size == 0                       # its own reference dropped
    assert len(calls) == 1 and calls[0][1] == SIZE
    (done,) = reg.registrations.values()
    assert done.ok and done.address == calls[0][0]
    shared.close()                                 # a client's close keeps it mapped
    assert int(shared.buf[0]) == 1


def test_a_new_arena_under_the_same_path_is_not_read_through_the_old_one(
        tmp_path: Path) -> None:
    """A restarted daemon may reuse its arena's path for a new file: read through the old
    mapping, a load would copy the dead daemon's bytes as the new block's."""
    path = arena_file(tmp_path / "arena", 1)
    reg = ArenaRegistry()
    old = client(path)
    reg.adopt(old)
    old_mapping = old._ops.arena
    arena_file(tmp_path / "arena", 2)              # the new daemon's arena file
    new = client(path)
    reg.adopt(new)
    assert new._ops.arena is not old_mapping and int(new._ops.arena.buf[0]) == 2
    assert list(reg.arenas.values()) == [new._ops.arena]
    assert not old_mapping.keep_mapped and old_mapping.buf.size == 0   # unmapped


def answer(ok: bool, address: int, nbytes: int) -> bool:
    return ok


def test_a_registered_old_arena_stays_mapped_a_failed_one_does_not(tmp_path: Path) -> None:
    """A copy of the old daemon's blocks may still run on a stream from a registered
    mapping; one whose registration failed holds no such copy."""
    kept: list[ArenaMapping] = []
    for ok in (True, False):
        path = arena_file(tmp_path / f"arena-{ok}", 1)
        reg = ArenaRegistry(register=functools.partial(answer, ok))
        old = client(path)
        reg.adopt(old)
        arena_file(tmp_path / f"arena-{ok}", 2)
        reg.adopt(client(path))
        assert (old._ops.arena in reg.arenas.values()) is ok
        if ok:
            kept.append(old._ops.arena)
    assert kept[0].keep_mapped and int(kept[0].buf[0]) == 1


def test_a_larger_announced_arena_replaces_the_mapping(tmp_path: Path) -> None:
    path = arena_file(tmp_path / "arena", 3, size=2 * SIZE)
    reg = ArenaRegistry()
    small, large = client(path), client(path, 2 * SIZE)
    reg.adopt(small)
    reg.adopt(large)
    assert large._ops.arena.size == 2 * SIZE
    assert list(reg.arenas.values()) == [large._ops.arena]


def test_a_failing_registration_leaves_pageable_copies(tmp_path: Path) -> None:
    def register(address: int, nbytes: int) -> bool:
        raise RuntimeError("cudaHostRegister failed")

    path = arena_file(tmp_path / "arena", 1)
    reg = ArenaRegistry(register=register)
    c = client(path)
    reg.adopt(c)                                   # does not raise
    (done,) = reg.registrations.values()
    assert not done.ok and int(c._ops.arena.buf[0]) == 1
