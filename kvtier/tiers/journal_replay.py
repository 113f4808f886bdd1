"""Replay of an arena journal after a crash: what every live slot held at the end.

``read_journal`` turns the records into a ``JournalState``: committed blocks (to be verified
against the arena bytes) and slots still being written at the crash (the store quarantines
them for one lease TTL: a stalled client of the dead daemon may still write). Records are
appended by one thread, in order, so replay stops at the first one that does not check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.tiers.journal_format import (
    BODY,
    HAS_PARENT,
    MAGIC,
    RECORD,
    VERSION,
    CommitInfo,
    CommittedSlot,
    RecordType,
    open_private,
    record_valid,
)


@dataclass(slots=True)
class JournalState:
    """A replayed journal: the arena geometry and what every live slot held at the end."""

    arena_size: int
    slab_bytes: int
    run: bytes = bytes(16)     # the id of the run that wrote it (kvtier.tiers.journal_run)
    committed: list[CommittedSlot] = field(default_factory=list)   # in commit order
    writing: list[tuple[int, int]] = field(default_factory=list)   # (offset, nbytes)
    records: int = 0
    torn: int = 0              # a last record that did not check (the crash tore it)
    inconsistent: int = 0      # records contradicting the ones before (counted, ignored)


@dataclass(slots=True)
class _Live:
    generation: int
    nbytes: int
    commit: CommittedSlot | None = None


def read_journal(path: Path) -> JournalState | None:
    """Replay the journal at ``path``; None when there is none or it is not a valid one."""
    try:
        fd = open_private(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        data = _read_all(fd)
    finally:
        os.close(fd)
    if len(data) < RECORD or not record_valid(data, 0):
        return None
    head = BODY.unpack_from(data, 0)
    if head[0] != RecordType.HEADER or head[6] != MAGIC or head[9] != VERSION:
        return None
    state = JournalState(arena_size=head[4], slab_bytes=head[5], run=head[7])
    live: dict[int, _Live] = {}
    pos = RECORD
    while pos + RECORD <= len(data):
        if data[pos] == 0:
            break
        if not record_valid(data, pos):
            state.torn += 1
            break
        _apply(state, live, BODY.unpack_from(data, pos))
        state.records += 1
        pos += RECORD
    committed = [lv.commit for lv in live.values() if lv.commit is not None]
    state.committed = sorted(committed, key=lambda c: c.order)
    state.writing = [(off, lv.nbytes) for off, lv in live.items() if lv.commit is None]
    return state


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    chunks = []
    pos = 0
    while pos < size:
        chunk = os.pread(fd, min(8 << 20, size - pos), pos)
        if not chunk:
            break
        chunks.append(chunk)
        pos += len(chunk)
    return b"".join(chunks)


def _apply(state: JournalState, live: dict[int, _Live], rec: tuple[Any, ...]) -> None:
    rtype, flags, _, depth, offset, nbytes, key, ns, parent, layout_fp, seq, checksum, gen = rec
    if rtype == RecordType.ALLOC:
        if offset in live:
            state.inconsistent += 1
        live[offset] = _Live(gen, nbytes)
    elif rtype == RecordType.FREE:
        if live.pop(offset, None) is None:
            state.inconsistent += 1
    elif rtype == RecordType.COMMIT:
        lv = live.get(offset)
        if lv is None:   # a compacted file: a committed slot's one record stands for its ALLOC
            lv = live[offset] = _Live(gen, nbytes)
        elif lv.generation != gen or lv.commit is not None:
            state.inconsistent += 1
            return
        info = CommitInfo(key, ns, layout_fp, nbytes,
                          parent if flags & HAS_PARENT else None, depth, seq)
        lv.commit = CommittedSlot(offset, info, checksum, state.records)
    else:
        state.inconsistent += 1
