"""Which daemon run of a data directory an arena journal belongs to.

A crashed daemon leaves its arena and journal in the shared-memory directory for the next
start to adopt. A start that does not adopt them (warm restart off, another ``cpu.shm_dir``,
a refused adoption) still serves from the data directory: it deletes blocks, stores new
bytes under old keys and writes nvme frames. Adopted after it, the old arena would serve
its stale bytes over those and bring deleted blocks back (found by review). So each run
that takes over the data directory writes a fresh random id to ``<data_dir>/arena-run``
and into its journal's header; a journal is adopted only when its id is the one the file
names, that is, when no run came between.

The file lives in the data directory (private to the daemon's uid, ``kvtier.trust``) and
is replaced by a rename, so a crash leaves the old id or the new one whole. No fsync: the
arena lives in shared memory, which a machine crash loses anyway.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from pathlib import Path

from kvtier.trust import owned_file_problem

RUN_FILE = "arena-run"
RUN_BYTES = 16

log = logging.getLogger("kvtier.tiers.arena")


def last_run(data_dir: Path) -> bytes | None:
    """The id of the last run that took over ``data_dir``; None when there is none or the
    file is not ours alone or not an id (then no journal is adopted: a cold start)."""
    path = data_dir / RUN_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read %s (%s): the cpu tier starts cold", path, exc)
        return None
    try:
        problem = owned_file_problem(os.fstat(fd), os.getuid())
        text = os.read(fd, 2 * RUN_BYTES + 2) if problem is None else b""
    finally:
        os.close(fd)
    if problem is not None:
        log.warning("%s %s: the cpu tier starts cold", path, problem)
        return None
    try:
        run = bytes.fromhex(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        run = b""
    return run if len(run) == RUN_BYTES else None


def begin_run(data_dir: Path) -> bytes:
    """A fresh run id, written to ``data_dir`` (replacing the last one) before this run
    changes anything a journal describes; OSError when it cannot be written."""
    run = secrets.token_bytes(RUN_BYTES)
    tmp = data_dir / f".{RUN_FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(run.hex() + "\n")
        os.replace(tmp, data_dir / RUN_FILE)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return run
