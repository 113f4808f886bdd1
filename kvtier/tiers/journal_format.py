"""The arena journal's on-disk format: fixed 128-byte records, each with its own xxh3-64.

Record 0 is a header (magic, format version, arena size and slab size, and in its namespace
field the id of the daemon run that wrote the journal, ``kvtier.tiers.journal_run``). Then,
in event-loop order: ``ALLOC(offset, nbytes)`` (a slot was handed out for writing),
``COMMIT(offset, key, namespace, layout_fp, nbytes, parent, depth, seq, checksum)`` (the
slot holds a complete block whose payload has that xxh3-64) and ``FREE(offset)``. A
compacted file holds one record per live slot, so a COMMIT there stands for its slot's ALLOC
too. How the records are written is in ``arena_journal``, how they are replayed in
``journal_replay``.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import xxhash

MAGIC = b"KVTJOURNAL\0\0\0\0\0\1"
VERSION = 1
RECORD = 128

# type u8 | flags u8 | pad u16 | depth u32 | offset u64 | nbytes u64 | key 16s | namespace 16s
# | parent 16s | layout_fp u64 | seq u64 | checksum u64 | generation u64 | pad, then xxh3-64
BODY = struct.Struct("<BBHIQQ16s16s16sQQQQ")
GENERATION = struct.Struct("<Q")
GENERATION_AT = BODY.size - GENERATION.size   # the generation is BODY's last field
_PAD = RECORD - 8 - BODY.size
_CHECK = struct.Struct("<Q")
HAS_PARENT = 1
_ZERO16 = bytes(16)


class RecordType(IntEnum):
    HEADER = 1
    ALLOC = 2
    COMMIT = 3
    FREE = 4


@dataclass(frozen=True, slots=True)
class CommitInfo:
    """What a COMMIT record says about the block in a slot."""

    key: bytes
    namespace: bytes
    layout_fp: int
    nbytes: int
    parent: bytes | None
    depth: int
    seq: int


@dataclass(frozen=True, slots=True)
class CommittedSlot:
    offset: int
    info: CommitInfo
    checksum: int
    order: int = 0             # position of its COMMIT record (replay keeps commit order)


def pack_record(rtype: RecordType, *, offset: int = 0, nbytes: int = 0, key: bytes = _ZERO16,
                namespace: bytes = _ZERO16, parent: bytes | None = None, layout_fp: int = 0,
                seq: int = 0, checksum: int = 0, depth: int = 0, generation: int = 0) -> bytes:
    """One whole record, its check appended."""
    body = BODY.pack(int(rtype), HAS_PARENT if parent is not None else 0, 0, depth, offset,
                     nbytes, key, namespace, parent or _ZERO16, layout_fp, seq, checksum,
                     generation) + bytes(_PAD)
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def header_record(arena_size: int, slab_bytes: int, run: bytes) -> bytes:
    """The header: the format, the arena's geometry and ``run`` (16 bytes), the id of the
    daemon run writing the journal."""
    return pack_record(RecordType.HEADER, offset=arena_size, nbytes=slab_bytes, key=MAGIC,
                       namespace=run, layout_fp=VERSION)


def commit_record(slot: CommittedSlot, generation: int) -> bytes:
    i = slot.info
    return pack_record(RecordType.COMMIT, offset=slot.offset, nbytes=i.nbytes, key=i.key,
                       namespace=i.namespace, parent=i.parent, layout_fp=i.layout_fp,
                       seq=i.seq, checksum=slot.checksum, depth=i.depth, generation=generation)


def record_valid(data: bytes, pos: int) -> bool:
    """Whether the record at ``pos`` matches its check (a torn write does not)."""
    body = data[pos: pos + RECORD - 8]
    (check,) = _CHECK.unpack_from(data, pos + RECORD - 8)
    return xxhash.xxh3_64_intdigest(body) == check


def open_private(path: Path, flags: int) -> int:
    """Open ``path`` without following a symlink and check it is ours: a regular file of this
    uid with no group/other permission bits (another local user may pre-create names in a
    shared /dev/shm). Raises PermissionError when it is not, OSError when it cannot open."""
    # O_NONBLOCK: a FIFO planted under the name would block the open until a writer came
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        os.close(fd)
        raise PermissionError(f"{path} is not a private file of uid {os.getuid()}")
    os.set_blocking(fd, True)
    return fd
