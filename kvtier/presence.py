"""Which blocks might this node hold? A shared, read-only presence filter for clients.

A lookup costs an engine's scheduler a round trip to the daemon even when kvtier can add
nothing to the prompt: a new conversation, document or tool schema, or a prompt whose
cached part vLLM's own prefix cache already covers. Measured in a vLLM engine on a 2-vCPU
VM, the daemon handles a lookup in ~0.1 ms, but the round trip takes 0.2-4 ms (waking a
halted vCPU for the daemon and back) while the engine's forward waits for the scheduler.

The daemon keeps a counting Bloom filter of the keys in its index: a private 0600 file
beside the arena, ``2**COUNTERS_LOG2`` one-byte counters after a small header, ``HASHES``
counters per key taken from the key's own bytes (keys are 128-bit hashes already). A key
entering the index increments its counters, leaving decrements them; a counter that
reaches 255 stays there (never decremented: it can only cause a false "maybe"). Clients
get a read-only descriptor with the hello (SCM_RIGHTS) and map it read-only
(``PresenceView``) after the checks the arena gets (a private regular file of the daemon's
uid, as large as announced, the announced header).

A lookup walks a chain from its first block and stops at the first block not in the
index, so the first key the filter rules out bounds the lookup's answer. What that bound
may cost and may not:
- It speaks for this node's local tiers only. A daemon with a Redis tier announces its
  filter as not ``exact`` (a chain may continue in Redis): clients then always ask.
- A key added just after the client read the filter is a miss that a lookup a moment
  later would have hit: the same race as a lookup sent a moment earlier. Never wrong KV:
  loads still go through leases.
- A "maybe" (present, or a false positive) leaves the decision to the lookup.
- A client uses its view only while its connection to the daemon that made it is open: a
  restarted daemon has a new filter, and the client reconnects through a lookup.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.errors import UntrustedArena
from kvtier.trust import arena_problem

MAGIC = b"KVTPRES1"
HEADER = struct.Struct("<8sBB")          # magic, counters_log2, hashes
HEADER_BYTES = 64                        # counters start here (a cache line)
COUNTERS_LOG2 = 22                       # 4 MiB: 400k blocks -> ~2% false "maybe", 1M ~10%
HASHES = 3
KEY_BYTES = 16
_SATURATED = 255
_WORDS = struct.Struct("<4I")           # a key's four 32-bit words (keys are 16 bytes)


def _positions(keys: bytes, n: int, mask: int, hashes: int) -> np.ndarray:
    """(n, hashes) counter indexes: disjoint little-endian 32-bit words of each key."""
    words = np.frombuffer(keys, dtype="<u4", count=n * 4).reshape(n, 4)
    return words[:, :hashes] & np.uint32(mask)


def _check(counters_log2: int, hashes: int) -> None:
    if not 1 <= hashes <= 4 or not 10 <= counters_log2 <= 30:
        raise ValueError(f"presence filter: {hashes} hashes, 2**{counters_log2} counters")


@dataclass(slots=True, eq=False)
class PresenceFilter:
    """The daemon's side: creates the file, counts keys in and out, removes it at close."""

    path: Path
    counters_log2: int
    hashes: int
    _fd: int
    _mm: mmap.mmap

    @classmethod
    def create(cls, path: Path, counters_log2: int = COUNTERS_LOG2,
               hashes: int = HASHES) -> PresenceFilter:
        """A zeroed filter at ``path`` (a stale file of a crashed daemon is reset)."""
        _check(counters_log2, hashes)
        size = HEADER_BYTES + (1 << counters_log2)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        problem: str | None = "unchecked"
        try:
            problem = arena_problem(os.fstat(fd), 0, os.getuid())
            if problem is not None:
                raise PermissionError(f"presence filter {path} {problem}: remove it")
            os.ftruncate(fd, 0)       # zero every counter of a stale file
            os.ftruncate(fd, size)
            # its pages now, not when a counter is first written: a full tmpfs fails here
            # (ENOSPC, the daemon serves without the filter) instead of SIGBUS mid-request
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if problem is None:   # our file: not left behind half made (a full tmpfs)
                _unlink_if_same(path, fd)
            os.close(fd)
            raise
        mm[:HEADER.size] = HEADER.pack(MAGIC, counters_log2, hashes)
        return cls(path, counters_log2, hashes, fd, mm)

    def announce(self, exact: bool) -> dict[str, Any]:
        """The hello's ``presence`` entry."""
        return {"counters_log2": self.counters_log2, "hashes": self.hashes, "exact": exact}

    def _at(self, key: bytes) -> list[int]:
        """Byte offsets in the mapping of ``key``'s counters (the index keeps this on its
        hot path: plain ints and mmap item access, no numpy scalars)."""
        mask = (1 << self.counters_log2) - 1
        return [HEADER_BYTES + (w & mask) for w in _WORDS.unpack_from(key)[:self.hashes]]

    def add(self, key: bytes) -> None:
        self.add_many((key,))

    def add_many(self, keys: Sequence[bytes]) -> None:
        """``add`` of every key (repeats count). A plain loop on purpose: the daemon runs it
        with caches cold from its last wake-up, where numpy's dispatch cost more than it
        saved (32 keys, caches flushed: 0.14 ms here, 0.50 ms through np.unique)."""
        mm, mask, hashes = self._mm, (1 << self.counters_log2) - 1, self.hashes
        if mm.closed:   # the daemon is stopping: a late request's blocks change nothing
            return
        for key in keys:
            for w in _WORDS.unpack_from(key)[:hashes]:
                i = HEADER_BYTES + (w & mask)
                if mm[i] < _SATURATED:
                    mm[i] += 1

    def remove(self, key: bytes) -> None:
        mm = self._mm
        if mm.closed:   # (as in add_many)
            return
        for i in self._at(key):
            if 0 < mm[i] < _SATURATED:
                mm[i] -= 1

    def open_for_client(self) -> int:
        """A new read-only descriptor of the file, to pass to a client."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        if os.fstat(fd).st_ino != os.fstat(self._fd).st_ino:
            os.close(fd)
            raise PermissionError(f"presence filter {self.path} was replaced under the daemon")
        return fd

    def close(self) -> None:
        """Unmap and remove the file (a client still mapping it keeps its own pages)."""
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _unlink_if_same(path: Path, fd: int) -> None:
    """Remove ``path`` if it is still the file open as ``fd`` (never another's file)."""
    with contextlib.suppress(OSError):
        st, now = os.fstat(fd), os.lstat(path)
        if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
            os.unlink(path)


def file_bytes(counters_log2: int = COUNTERS_LOG2) -> int:
    """Shared memory a filter's file takes (whole pages): what cpu.shm_dir must have free
    beside the arena (kvtier.daemon.preflight.shm_side_bytes)."""
    return -(-(HEADER_BYTES + (1 << counters_log2)) // 4096) * 4096


class PresenceView:
    """A client's read-only view of a daemon's presence filter (module docstring)."""

    __slots__ = ("_counts", "_mask", "_mm", "exact", "hashes")

    def __init__(self, fd: int, announced: dict[str, Any], owner_uid: int) -> None:
        """Map ``fd`` (taken over: closed here) after the arena's checks; ``announced``:
        the hello's ``presence`` entry. UntrustedArena when the file is not what the daemon
        announced, ValueError when the announcement itself is malformed."""
        try:
            log2, hashes = int(announced["counters_log2"]), int(announced["hashes"])
            _check(log2, hashes)
            size = HEADER_BYTES + (1 << log2)
            problem = arena_problem(os.fstat(fd), size, owner_uid)
            if problem is not None:
                raise UntrustedArena(f"refusing the daemon's presence filter: it {problem}")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        if HEADER.unpack_from(mm) != (MAGIC, log2, hashes):
            mm.close()
            raise UntrustedArena("refusing the daemon's presence filter: its header does not "
                                 "match what the daemon announced")
        self._mm = mm
        self._counts = np.frombuffer(mm, dtype=np.uint8, offset=HEADER_BYTES)
        self._mask = (1 << log2) - 1
        self.hashes = hashes
        self.exact = bool(announced.get("exact"))

    def leading_bound(self, keys: Sequence[bytes]) -> int:
        """An upper bound on the leading blocks of ``keys`` in the daemon's index: the
        position of the first key the filter rules out (``len(keys)`` when none is)."""
        n = len(keys)
        if n == 0:
            return 0
        joined = b"".join(keys)
        if len(joined) != n * KEY_BYTES:
            return n   # not kvtier block keys: no bound
        hit = self._counts[_positions(joined, n, self._mask, self.hashes)].all(axis=1)
        return n if hit.all() else int(np.argmin(hit))

    def close(self) -> None:
        self._counts = np.zeros(0, np.uint8)
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()
