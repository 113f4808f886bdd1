"""Startup checks that fail fast, each with one line naming the path and the fix.

They run before anything is built (arena, nvme index rebuild, Redis), so an operator learns
about an unwritable data directory, an unsafe socket directory, a busy HTTP port or a too
small /dev/shm within a second and never from a traceback. Every failure is a StartupError;
``kvtier serve`` prints it as ``kvtier: <message>`` and exits 2 (``--debug`` adds the
traceback).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import stat
import tempfile
from pathlib import Path

from kvtier.errors import StartupError
from kvtier.trust import data_dir_problem
from kvtier.units import format_bytes

log = logging.getLogger("kvtier.daemon")


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def dir_path_problem(path: Path) -> tuple[Path, str] | None:
    """What makes ``path`` unusable as a directory, found without creating anything: a
    symbolic link loop on the way, a symbolic link to nothing, or something that is not a
    directory at ``path`` or above it. Returns (the path at fault, what is wrong), or None
    when ``path`` is a directory or could be created (other errors, such as a permission,
    are left to the attempt that creates it, which says them as they are)."""
    p = Path(os.path.abspath(path))
    try:
        st = os.stat(p)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return p, ("is a symbolic link loop, or has one above it (too many levels of "
                       "symbolic links)")
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            return None
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.lstat(p).st_mode):
                return p, f"is a symbolic link to {os.readlink(p)}, which does not exist"
        return None if p.parent == p else dir_path_problem(p.parent)
    if not stat.S_ISDIR(st.st_mode):
        return p, f"is not a directory (it is {_kind(st.st_mode)})"
    return None


def _kind(mode: int) -> str:
    return ("a regular file" if stat.S_ISREG(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device")


def check_dir_path(path: Path, what: str, setting: str, flag: str) -> None:
    """StartupError (one line naming ``setting`` and the fix) when ``dir_path_problem``
    finds one; creates nothing, so it can run before the checks that must not leave
    directories behind."""
    found = dir_path_problem(path)
    if found is None:
        return
    where, problem = found
    at = "it" if where == Path(os.path.abspath(path)) else str(where)
    raise StartupError(f"{what} {path} is unusable: {at} {problem}; fix that path or set "
                       f"{setting} to a directory of yours ({flag} PATH)")


def shm_dir_problem(shm_dir: Path, uid: int) -> str | None:
    """Why ``shm_dir`` cannot hold the cpu tier's arena, as the one line a start prints
    (what is wrong and the fix), or None: it must be a directory that nobody but root or
    ``uid`` can change (else another user could remove or replace the arena)."""
    from kvtier.trust import shared_dir_problem

    found = dir_path_problem(shm_dir)
    if found is not None:
        where, problem = found
        at = "it " if where == Path(os.path.abspath(shm_dir)) else f"{where} "
        return (f"shared-memory directory {shm_dir} (cpu.shm_dir) is unusable: {at}{problem}; "
                "set cpu.shm_dir to a tmpfs directory such as /dev/shm")
    try:
        st = os.stat(shm_dir)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return (f"shared-memory directory {shm_dir} does not exist: set cpu.shm_dir to a "
                    "tmpfs directory such as /dev/shm")
        return (f"shared-memory directory {shm_dir} (cpu.shm_dir) is unusable "
                f"({exc.strerror}); set cpu.shm_dir to a tmpfs directory such as /dev/shm")
    unsafe = shared_dir_problem(st, uid)
    if unsafe is not None:   # (the arena's own files are checked as they are opened)
        return (f"shared-memory directory {shm_dir} {unsafe}, so another user could remove "
                "or replace the arena: set cpu.shm_dir to /dev/shm or a directory of yours")
    return None


def check_writable_dir(path: Path, what: str, flag: str, setting: str = "") -> None:
    """Create ``path`` (mode 0700) if missing, prove we can create files in it, and that
    no other user can (``check_owned_dir``).

    A probe file is created and removed: permission bits alone do not tell (a read-only
    mount, root on NFS, ACLs), and the nvme tier would otherwise fail later, mid-setup.
    ``dir_path_problem`` first: mkdir says only "File exists" for a symbolic link loop.
    """
    if setting:
        check_dir_path(path, what, setting, flag)
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
        fd, probe = tempfile.mkstemp(prefix=".kvtier-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise StartupError(f"{what} {path} is unusable: {_why(exc, path, flag)}") from exc
    check_owned_dir(path, what, flag)


def check_owned_dir(path: Path, what: str, flag: str) -> None:
    """``path`` is ours and writable by nobody else, nor is any directory above it (root's,
    or sticky like /tmp, are fine there): whoever can add files to the nvme directory can
    plant frames the daemon serves as KV (checksums do not say who wrote them).
    StartupError otherwise, naming the directory and the chmod/chown that fixes it."""
    try:
        found = data_dir_problem(path, os.getuid())
    except OSError as exc:
        raise StartupError(f"{what} {path} is unusable: {_why(exc, path, flag)}") from exc
    if found is None:
        return
    where, problem = found
    if "writable by" in problem:
        fix = f"run `chmod go-w {where}`"
    elif where == Path(os.path.realpath(path)):
        fix = f"run `chown {_user()} {where}` if it is yours"
    else:
        fix = "use a directory owned by you or root"
    raise StartupError(f"{what} {path} is not safe: {where} {problem}, so another user could "
                       f"plant or replace the daemon's files; {fix}, or pass {flag} PATH in "
                       "a directory of yours")


def _why(exc: OSError, path: Path, flag: str) -> str:
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EROFS:
        return (f"it is on a read-only file system; remount it read-write or pass {flag} "
                "PATH on a writable one")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"{reason} for user {_user()} (uid {os.getuid()}); {_refused_fix(exc, path, flag)}"
    if exc.errno == errno.ENOSPC:
        return f"no space left on its file system; free some or pass {flag} PATH"
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
    return f"{reason}{where}; fix it or pass {flag} PATH"


def _refused_fix(exc: OSError, path: Path, flag: str) -> str:
    """The fix of a refused write (EACCES, EPERM) in ``path``: chown when the directory
    where it was refused is another user's; when it is the daemon user's own, chown does
    nothing (found by review): chmod when its mode lacks the owner's write or search bit,
    else the causes that outrank ownership and mode (an immutable attribute, a read-only
    mount, a security module), each with its command."""
    where, st = _nearest(Path(os.path.abspath(exc.filename or path)))
    if st is None or st.st_uid != os.getuid():
        owner = "" if st is None else f"{where} belongs to {_name_of(st.st_uid)}; "
        return f"{owner}make it writable (`chown -R {_user()} {path}`) or pass {flag} PATH"
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISDIR(st.st_mode) and mode & 0o300 != 0o300:
        return (f"{where} is yours but mode {mode:04o}: run `chmod u+rwx {where}` or pass "
                f"{flag} PATH")
    return (f"{where} is yours (mode {mode:04o}), so its owner and mode are not the cause: "
            f"it is immutable (`lsattr -d {where}` shows i; `chattr -i {where}` as root), on "
            f"a read-only mount (`findmnt -T {where}`; remount it read-write), or a security "
            f"policy (SELinux, AppArmor) denies it; fix that or pass {flag} PATH")


def _nearest(p: Path) -> tuple[Path, os.stat_result | None]:
    """``p``, or its nearest ancestor that exists (a probe file or a directory that could
    not be made), with its stat; (``p``, None) when none can be read."""
    for candidate in (p, *p.parents):
        with contextlib.suppress(OSError):
            return candidate, os.stat(candidate)
    return p, None


def _name_of(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def shm_free_bytes(shm_dir: Path) -> int:
    """Bytes an unprivileged process can still allocate in ``shm_dir`` (statvfs)."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def shm_side_bytes(*, warm_restart: bool) -> int:
    """Shared memory the cpu tier takes in cpu.shm_dir beside its arena: the presence
    filter (kvtier.presence, 4 MiB) and, with cpu.warm_restart, the arena journal (its
    first file, twice: a compaction writes the next one beside it)."""
    from kvtier.presence import file_bytes
    from kvtier.tiers.arena_journal import MIN_RECORDS
    from kvtier.tiers.journal_format import RECORD

    return file_bytes() + (2 * MIN_RECORDS * RECORD if warm_restart else 0)


def side_files(arena: Path) -> tuple[Path, Path]:
    """The presence filter and journal files of the arena at ``arena``."""
    return Path(f"{arena}.presence"), arena.with_suffix(".journal")


def check_shm_space(shm_dir: Path, nbytes: int, *, reusable: Path | None = None,
                    side_bytes: int = 0) -> None:
    """The cpu tier's arena must fit in the free space of its shared-memory file system.

    tmpfs accepts a sparse file of any size and fails only when a page is touched (SIGBUS,
    which kills the daemon): so the check comes before the arena is created. ``reusable``:
    this daemon's stable arena (warm restart), whose pages (and its presence filter's and
    journal's) count as available because it is adopted or replaced. ``side_bytes``
    (``shm_side_bytes``): what the presence filter and journal need besides; without room
    for them the daemon serves all the same, without them (logged here as a warning, and
    again as each fails), so that is not a refusal.
    """
    try:
        free = shm_free_bytes(shm_dir)
    except OSError as exc:
        raise StartupError(f"shared-memory directory {shm_dir} is unusable "
                           f"({exc.strerror}); set cpu.shm_dir to a tmpfs directory such as "
                           "/dev/shm") from exc
    for path in () if reusable is None else (reusable, *side_files(reusable)):
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                free += st.st_blocks * 512     # the pages it really holds
    grow = (f"lower --cpu-bytes (cpu.bytes) or enlarge {shm_dir} (e.g. `mount -o "
            f"remount,size=<bytes> {shm_dir}`, or docker --shm-size)")
    if nbytes > free:
        raise StartupError(
            f"the cpu tier needs {_size(nbytes)} of shared memory but {shm_dir} has only "
            f"{_size(free)} free: {grow}")
    if nbytes + side_bytes > free:
        log.warning("%s has %s free: room for the cpu tier's arena (cpu.bytes %s) but not for "
                    "its presence filter and arena journal (%s more), so the daemon serves "
                    "without them (clients ask for every lookup, no warm restart): free space "
                    "in %s, %s", shm_dir, format_bytes(free, digits=2),
                    format_bytes(nbytes, digits=2), format_bytes(side_bytes, digits=2),
                    shm_dir, grow)


def setup_error(exc: OSError) -> StartupError:
    """Any other OSError during setup, as one line that names the path it concerns."""
    reason = exc.strerror or exc.__class__.__name__
    if exc.filename is not None:
        target = f" {exc.filename}"
        if exc.filename2 is not None:
            target += f" -> {exc.filename2}"
        target += ":"
        fix = "check that path (owner, permissions, free space, file system)"
    else:
        target, fix = "", "check the paths and settings of this daemon"
    return StartupError(f"cannot start:{target} {reason}; {fix} (run with --debug for a "
                        "traceback)")


def _size(n: int) -> str:
    return format_bytes(n, digits=2, exact=True)
