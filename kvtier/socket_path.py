"""The daemon's control socket path: its directory (private by default, on a path only root
or the daemon's user can change), the lock that keeps two daemons off one path, and
claiming the path from a stale socket of ours. The trust rules themselves are in
``kvtier.trust``; this is what the daemon's start does with them for its socket.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from kvtier.errors import StartupError
from kvtier.trust import (
    PRIVATE_DIR_MODE,
    dirs_on_path,
    ensure_private_dir,
    hold_flock,
    open_owned_file,
    shared_dir_problem,
)

SUN_PATH_MAX = 107   # sockaddr_un.sun_path holds 108 bytes including the terminating NUL


def socket_dir_problem(directory: Path, uid: int) -> tuple[Path, str] | None:
    """The first directory on the way to ``directory`` that another user could change."""
    for d in dirs_on_path(directory):
        problem = shared_dir_problem(os.stat(d), uid)
        if problem is not None:
            return d, problem
    return None


def socket_path_problem(socket_path: Path) -> str | None:
    """Why no Unix socket can be made at ``socket_path`` whatever its directory (longer
    than ``SUN_PATH_MAX`` bytes), as the one line a start prints; None when it can."""
    size = len(os.fsencode(socket_path))
    if size <= SUN_PATH_MAX:
        return None
    return (f"socket path {socket_path} is {size} bytes, longer than the {SUN_PATH_MAX} a "
            "Unix socket allows: pass a shorter --socket")


def prepare_socket_dir(socket_path: Path, *, default_dir: Path | None) -> None:
    """Make the socket's directory ready and safe, or raise StartupError (one line).

    ``default_dir``: the default runtime directory (kvtier.config.default_runtime_dir);
    when the socket lives there it must be private (``ensure_private_dir``). Any directory,
    default or configured, must sit on a path only root or our uid can change
    (``shared_dir_problem``); a missing configured directory is created with mode 0700.
    """
    uid = os.getuid()
    too_long = socket_path_problem(socket_path)
    if too_long is not None:
        raise StartupError(too_long)
    directory = socket_path.parent
    if default_dir is not None and directory == default_dir:
        ensure_private_dir(directory, socket_path)
    elif not os.path.lexists(directory):
        try:
            os.makedirs(directory, mode=PRIVATE_DIR_MODE)
        except OSError as exc:
            raise StartupError(f"cannot create the socket directory {directory}: "
                               f"{exc.strerror}; create it or pass another --socket") from exc
    try:
        found = socket_dir_problem(directory, uid)
    except OSError as exc:
        raise StartupError(f"socket directory {directory} is unusable ({exc.strerror}: "
                           f"{exc.filename}); create it or pass another --socket") from exc
    if found is None and not os.access(directory, os.W_OK | os.X_OK):
        found = (directory, f"is not writable by uid {uid}, so the socket cannot be created "
                            "there")
    if found is not None:
        where, problem = found
        fix = ("use a directory of yours" if "not writable" in problem
               else f"run `chmod go-w {where}`" if "writable by" in problem
               else "use a directory owned by you or root")
        unsafe = "not writable" not in problem
        risk = ", so another user could replace the socket" if unsafe else ""
        raise StartupError(f"socket directory {directory} is not "
                           f"{'safe' if unsafe else 'usable'}: {where} {problem}{risk}; "
                           f"{fix}, or pass --socket PATH in a directory of yours")


def _socket_alive(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(0.5)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def lock_socket_path(socket_path: Path) -> int:
    """Hold ``<socket>.lock`` (flock) for the daemon's life, so that two daemons started at
    once on one socket cannot both pass ``claim_socket_path`` (the listener's bind replaces
    a socket file, so the later one would take the path from the earlier). The file is
    kept at exit: removing a lock file races with the next daemon opening it. Returns the
    descriptor, to close at exit."""
    lock = socket_path.with_name(socket_path.name + ".lock")
    fd = open_owned_file(lock, os.O_RDWR | os.O_CREAT, "socket lock file", "--socket")
    hold_flock(fd, lambda: f"another kvtier daemon is already serving (or starting on) "
                           f"{socket_path}: it holds {lock}; stop it or pass another --socket")
    return fd


def claim_socket_path(socket_path: Path) -> None:
    """Remove a stale socket of ours at ``socket_path``; StartupError for anything else.

    Never removes a file that is not a socket, nor another user's socket, nor a live one.
    """
    try:
        st = os.lstat(socket_path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"{socket_path} exists and is not a socket: remove it or pass "
                           "another --socket")
    if _socket_alive(socket_path):   # a kvtier daemon would hold <socket>.lock (taken first)
        raise StartupError(f"something is listening on {socket_path} and does not answer as "
                           "kvtier (no kvtier daemon holds its .lock file): stop that process "
                           "or pass another --socket")
    if st.st_uid != os.getuid():
        raise StartupError(f"stale socket {socket_path} belongs to uid {st.st_uid}: remove it "
                           "or pass another --socket")
    try:
        socket_path.unlink()
    except OSError as exc:
        raise StartupError(f"cannot remove the stale socket {socket_path}: {exc.strerror}; "
                           "remove it or pass another --socket") from exc
