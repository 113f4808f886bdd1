"""Trust between a client, its daemon and the arena: who listens, who may replace what.

Three checks close the socket hijack of issue 14 (another local user pre-creating the
socket directory, putting a fake daemon on the socket, and handing out an arena file it
can read and write):

- the daemon's socket directory: the default one is private (created 0700 and verified:
  owned by us, mode exactly 0700, not a symlink); a configured one must sit on a path that
  only root or the daemon's user can change (``kvtier.socket_path``);
- the daemon's uid, read with SO_PEERCRED right after ``connect()`` and before the client
  sends a byte (``check_daemon_peer``);
- the arena: a regular file owned by that uid with no group/other permission bits, at least
  as large as the daemon said (``arena_problem``), checked with fstat on the descriptor that
  is then mapped (received over the socket, or opened with O_NOFOLLOW).

The daemon's data directories and files follow the same idea (``data_dir_problem``,
``open_owned_file``): frames are checksummed, not signed, so a directory or slot file that
another user can write lets them forge KV or have the daemon truncate a file of theirs.

The ``*_problem`` helpers are pure: they take a stat result and return what is wrong, or
None, so the rules are unit-tested without other users.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import struct
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import StartupError, UntrustedDaemon

PRIVATE_DIR_MODE = 0o700
_PEERCRED = struct.Struct("3i")
_MAX_SYMLINKS = 40


@dataclass(frozen=True, slots=True)
class PeerCred:
    """The process at the other end of a Unix socket, as the kernel reports it."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCred:
    """SO_PEERCRED of a connected Unix socket (the listener's credentials for a client)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return PeerCred(*_PEERCRED.unpack(raw))


def check_daemon_peer(sock: socket.socket, path: str, trusted_uids: Collection[int]) -> PeerCred:
    """The daemon's credentials; UntrustedDaemon unless it runs as us or a trusted uid.

    Called before the client sends anything, so a fake daemon of another user learns
    nothing (no hello, no model id, no cache_salt, no KV).
    """
    cred = peer_credentials(sock)
    me = os.getuid()
    if cred.uid != me and cred.uid not in trusted_uids:
        raise UntrustedDaemon(
            f"refusing the daemon at {path}: it runs as uid {cred.uid} (pid {cred.pid}), not "
            f"as this client's uid {me}, so it could read and forge this client's KV (and a "
            f"kvtier daemon serves only its own user's processes): remove {path} and start "
            f"your own daemon with `kvtier serve`, or run this process as uid {cred.uid}")
    return cred


# -- pure rules ------------------------------------------------------------------------------
def private_dir_problem(st: os.stat_result, uid: int) -> str | None:
    """What makes an lstat result unfit as the default socket directory, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by uid {uid} that runs this daemon"
    mode = stat.S_IMODE(st.st_mode)
    if mode != PRIVATE_DIR_MODE:
        return f"has mode {mode:04o}, not 0700"
    return None


def shared_dir_problem(st: os.stat_result, uid: int) -> str | None:
    """What lets another user replace entries of a directory on the socket's path, or None.

    The rule: owned by root or the daemon's user, and not writable by group or others
    unless the sticky bit is set (as on /tmp: there nobody may rename or remove what they
    do not own). Anyone else who could write the directory could swap the socket.
    """
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid not in (0, uid):
        return f"is owned by uid {st.st_uid} (only root or uid {uid} may own it)"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022 and not mode & stat.S_ISVTX:
        who = {0o022: "group and others", 0o020: "its group", 0o002: "others"}[mode & 0o022]
        return f"is writable by {who} (mode {mode:04o}) without the sticky bit"
    return None


def arena_problem(st: os.stat_result, size: int, owner_uid: int) -> str | None:
    """What makes an opened arena file unfit to map, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != owner_uid:
        return f"is owned by uid {st.st_uid}, not by the daemon's uid {owner_uid}"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        return f"has mode {mode:04o}: group or others may read or write it"
    if st.st_size < size:
        return f"has {st.st_size} bytes, fewer than the {size} the daemon announced"
    return None


def owned_dir_problem(st: os.stat_result, uid: int) -> str | None:
    """What lets another user add or replace files in a data directory (the daemon's data
    directory, the nvme directory), or None: it must be ours and writable by nobody else.
    Stricter than ``shared_dir_problem``: the sticky bit does not help here, since it stops
    others from replacing our files but not from adding new ones (a slot file, a lock)."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    return _not_ours_alone(st, uid)


def owned_file_problem(st: os.stat_result, uid: int) -> str | None:
    """What makes an opened daemon data file (an nvme slot file, the nvme lock) unfit, or
    None: a regular file of our uid that neither group nor others may write (frames are
    checksummed, not signed, so whoever can write the file can forge KV), under one name
    only (the daemon truncates and rewrites these files: a second name would be another
    file's bytes, or a copy that changes behind it; found by review)."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_nlink > 1:
        return f"has {st.st_nlink} hard links (another name shares its bytes)"
    return _not_ours_alone(st, uid)


def _not_ours_alone(st: os.stat_result, uid: int) -> str | None:
    """Another owner than ``uid``, or write permission for group or others, or None."""
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by uid {uid} that runs this daemon"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        who = {0o022: "group and others", 0o020: "its group", 0o002: "others"}[mode & 0o022]
        return f"is writable by {who} (mode {mode:04o})"
    return None


def dirs_on_path(path: Path) -> list[Path]:
    """Every directory the kernel walks through to resolve ``path``, symlinks followed.

    Includes the directories that hold symlinks on the way (whoever can write one of them
    can re-point the link), so checking each of them covers the whole resolution.
    """
    pending = list(Path(os.path.abspath(path)).parts[1:])
    current = Path("/")
    seen = [current]
    hops = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        candidate = current / part
        st = os.lstat(candidate)
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > _MAX_SYMLINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
            target = Path(os.readlink(candidate))
            if target.is_absolute():
                current = Path("/")
                pending[:0] = list(target.parts[1:])
            else:
                pending[:0] = list(target.parts)
            continue
        current = candidate
        if current not in seen:
            seen.append(current)
    return seen


# -- daemon side: data directories and files -------------------------------------------------
def data_dir_problem(directory: Path, uid: int) -> tuple[Path, str] | None:
    """The first directory on the way to ``directory`` that another user could change:
    ``directory`` itself must pass ``owned_dir_problem``, the ones above it (symlinks
    followed) ``shared_dir_problem`` (root's, or sticky like /tmp, are fine)."""
    leaf = Path(os.path.realpath(directory))
    for d in dirs_on_path(directory):
        rule = owned_dir_problem if d == leaf else shared_dir_problem
        problem = rule(os.stat(d), uid)
        if problem is not None:
            return d, problem
    return None


def open_owned_file(path: Path, flags: int, what: str, flag: str) -> int:
    """Open a daemon data file without following a symlink and verify it on the descriptor
    (``owned_file_problem``); StartupError (one line: the path, what is wrong, the fix) when
    it is not ours alone. ``O_CREAT`` in ``flags`` creates it with mode 0600. Another user
    who planted a symlink there must not get it truncated or written through, nor a file of
    theirs read as frames."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:   # ELOOP (a symlink), EISDIR, EINVAL (a FIFO with O_DIRECT), ...
        try:
            st = os.lstat(path)
        except OSError:
            raise exc from None
        problem = ("is a symbolic link" if stat.S_ISLNK(st.st_mode)
                   else owned_file_problem(st, os.getuid()))
        if problem is None:
            raise
        raise _planted(path, problem, what, flag) from exc
    try:
        problem = owned_file_problem(os.fstat(fd), os.getuid())
    except BaseException:
        os.close(fd)
        raise
    if problem is not None:
        os.close(fd)
        raise _planted(path, problem, what, flag)
    return fd


def _planted(path: Path, problem: str, what: str, flag: str) -> StartupError:
    return StartupError(f"{what} {path} {problem}, so another user may have planted or "
                        f"changed it; remove it (`rm {path}`; what it caches is lost) or pass "
                        f"{flag} PATH in a directory of yours")


# -- daemon side: the socket directory -------------------------------------------------------
def _fix_for(path: Path) -> str:
    return f"or pass --socket PATH in a directory of yours (the socket path was {path})"


def ensure_private_dir(directory: Path, socket_path: Path) -> None:
    """Create the default socket directory with mode 0700, or verify the one that exists.

    Verified on the opened directory (O_NOFOLLOW | O_DIRECTORY, then fstat): owned by our
    uid, mode exactly 0700. A directory that fails is never used: someone else may have
    created it to take the socket over.
    """
    uid = os.getuid()
    created = False
    try:
        os.mkdir(directory, PRIVATE_DIR_MODE)
        created = True
    except FileExistsError:
        pass
    except OSError as exc:
        raise StartupError(
            f"cannot create the socket directory {directory}: {exc.strerror}; create it "
            f"with mode 0700 owned by uid {uid}, {_fix_for(socket_path)}") from exc
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:   # a symlink, a file, or another user's directory (EACCES)
        try:
            why = private_dir_problem(os.lstat(directory), uid) or exc.strerror
        except OSError:
            why = exc.strerror
        raise StartupError(f"socket directory {directory} {why}; remove it (`rm -r "
                           f"{directory}`) {_fix_for(socket_path)}") from exc
    try:
        if created:   # the umask may have narrowed mkdir's mode; set exactly what we verify
            os.fchmod(fd, PRIVATE_DIR_MODE)
        problem = private_dir_problem(os.fstat(fd), uid)
    finally:
        os.close(fd)
    if problem is None:
        return
    if problem.startswith("has mode"):
        fix = f"run `chmod 0700 {directory}` if you made it"
    else:
        fix = ("another user may have created it to take the socket over: remove it "
               f"(`rm -r {directory}`)")
    raise StartupError(f"socket directory {directory} {problem}; {fix}, "
                       f"{_fix_for(socket_path)}")


def hold_flock(fd: int, busy: Callable[[], str]) -> None:
    """Lock ``fd`` exclusively without waiting; StartupError(``busy()``, asked while the
    descriptor is still open) when another process holds it. ``fd`` is closed on failure."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        why = busy()
        os.close(fd)
        raise StartupError(why) from None
    except BaseException:
        os.close(fd)
        raise
