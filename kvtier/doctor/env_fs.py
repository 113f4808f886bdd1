"""File-system checks of ``doctor --env``: /dev/shm, the data dir, the socket directory."""

from __future__ import annotations

import contextlib
import errno
import math
import mmap
import os
import stat as stat_mod
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvtier.config import Config, default_runtime_dir
from kvtier.daemon.preflight import dir_path_problem, shm_dir_problem, shm_side_bytes
from kvtier.doctor.env import Check, Host, Verdict
from kvtier.socket_path import socket_dir_problem, socket_path_problem
from kvtier.trust import owned_dir_problem, private_dir_problem
from kvtier.units import format_bytes


@dataclass(frozen=True, slots=True)
class Mount:
    point: str
    fstype: str
    source: str


def parse_mountinfo(text: str) -> list[Mount]:
    """/proc/self/mountinfo lines -> mounts (mount point, fs type, source)."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        point = fields[4].replace("\\040", " ")
        out.append(Mount(point, tail[0], tail[1]))
    return out


def mount_of(path: str, text: str) -> Mount | None:
    """The mount holding ``path`` (the longest mount point that is a prefix of it)."""
    best: Mount | None = None
    p = os.path.normpath(path)
    for m in parse_mountinfo(text):
        inside = p == m.point or p.startswith(m.point.rstrip("/") + "/") or m.point == "/"
        if inside and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


def _existing(path: Path, host: Host) -> Path:
    """``path`` or its nearest existing ancestor (the data dir may not exist yet)."""
    p = path
    while not host.exists(str(p)) and p != p.parent:
        p = p.parent
    return p


def _arena_bytes(shm: str, host: Host) -> int:
    """Bytes of this user's kvtier arenas already in ``shm`` (a running daemon's), with
    their presence filters and journals."""
    total = 0
    for name in host.listdir(shm):
        if name.startswith(f"kvtier-{host.uid()}-") and name.endswith(
                (".arena", ".arena.presence", ".journal")):
            with contextlib.suppress(OSError):
                total += host.stat(os.path.join(shm, name)).st_size
    return total


def mount_size(nbytes: float) -> str:
    """``nbytes`` as tmpfs's ``size=`` takes it: whole MiB with an ``m`` suffix, rounded
    up so that it is enough. ``70.9 GiB`` (a space, a decimal) was no mount option."""
    return f"{max(1, math.ceil(nbytes / 2**20))}m"


def check_shm(cfg: Config, host: Host) -> Check:
    """The cpu tier is a file in cpu.shm_dir: it must fit, and be memory (tmpfs); so should
    its presence filter and journal, without which the daemon serves degraded."""
    shm = str(cfg.cpu.shm_dir)
    need = cfg.cpu.bytes
    side = shm_side_bytes(warm_restart=cfg.cpu.warm_restart)
    refused = shm_dir_problem(cfg.cpu.shm_dir, host.uid())   # what a start refuses
    if refused is not None:
        return Check("shm size", Verdict.FAIL, refused + " (kvtier serve refuses to start)",
                     "set cpu.shm_dir to a tmpfs directory of root's or yours (/dev/shm)")
    if not host.exists(shm):
        return Check("shm size", Verdict.FAIL, f"{shm} does not exist (cpu.shm_dir)",
                     "mount a tmpfs there or set cpu.shm_dir to one (e.g. /dev/shm)")
    total, avail = host.statvfs(shm)
    mine = _arena_bytes(shm, host)
    m = mount_of(shm, host.mountinfo())
    fstype = m.fstype if m else "?"
    room = avail + mine
    detail = (f"{shm} ({fstype}): {format_bytes(total)} total, {format_bytes(avail)} free"
              + (f" + {format_bytes(mine)} in kvtier arenas" if mine else "")
              + f"; cpu tier needs {format_bytes(need)} + {format_bytes(side)} for its "
              "presence filter and journal")
    size = (need + side) * 1.1 + total - avail
    grow = (f"grow it to {format_bytes(size)}: mount -o remount,size={mount_size(size)} "
            f"{shm} (docker: --shm-size; Kubernetes: mount the host's /dev/shm or an emptyDir "
            "with medium: Memory and a sizeLimit), or lower cpu.bytes (kvtier plan)")
    if total < need:
        return Check("shm size", Verdict.FAIL, detail + " -> smaller than the cpu tier", grow)
    if room < need:
        return Check("shm size", Verdict.FAIL, detail + " -> not enough free", grow)
    if room < need + side:
        return Check("shm size", Verdict.WARN, detail + " -> no room for the presence filter "
                     "and journal: the daemon would serve without them (every lookup asked, "
                     "no warm restart)", f"free space in {shm}, or {grow}")
    if fstype not in ("tmpfs", "?"):
        return Check("shm size", Verdict.WARN, detail + f" -> {fstype} is not memory: the "
                     "arena would page to disk", "set cpu.shm_dir to a tmpfs (/dev/shm)")
    return Check("shm size", Verdict.OK, detail)


def _probe_o_direct(directory: str) -> str | None:
    """Write one aligned page with O_DIRECT in ``directory``; None when it works, else
    why not (a file that cannot be made there too)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return "this OS has no O_DIRECT"
    try:
        fd, name = tempfile.mkstemp(prefix=".kvtier-odirect-", dir=directory)
    except OSError as exc:
        return f"cannot create a probe file: {exc.strerror or exc}"
    os.close(fd)
    buf = mmap.mmap(-1, 4096)   # page-aligned
    try:
        fd = os.open(name, os.O_WRONLY | flag)
        try:
            os.pwrite(fd, buf, 0)
        finally:
            os.close(fd)
        return None
    except OSError as exc:
        return f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}"
    finally:
        buf.close()
        with contextlib.suppress(OSError):
            os.unlink(name)


_NOT_FOR_FILES = ("proc", "sysfs", "cgroup", "cgroup2", "devpts", "debugfs", "securityfs",
                  "tracefs", "configfs", "bpf", "mqueue", "pstore")
"""Kernel file systems where no directory of files can be made."""


def _refused_dirs(cfg: Config) -> list[Check]:
    """The data directory and the nvme directory as a start checks their paths first
    (kvtier.daemon.preflight.dir_path_problem): a symbolic link loop, a symbolic link to
    nothing, or a file where a directory must be, at them or above them."""
    paths = [(cfg.daemon.data_dir, "daemon.data_dir", "--data-dir")]
    if cfg.nvme.enabled and cfg.nvme.bytes > 0 and cfg.nvme.path is not None:
        paths.append((cfg.nvme.path, "nvme.path", "--nvme-path"))
    out = []
    for path, setting, flag in paths:
        found = dir_path_problem(path)
        if found is not None:
            where, problem = found
            out.append(Check("data dir", Verdict.FAIL,
                             f"{path} ({setting}): {where} {problem}; kvtier serve refuses "
                             "to start", f"fix that path or set {setting} ({flag}) to a "
                             "directory of yours"))
    return out


def check_data_dir(cfg: Config, host: Host) -> list[Check]:
    """The nvme tier's directory: free space, file system type, O_DIRECT (probed inside
    the data directory only: doctor writes nowhere else)."""
    refused = _refused_dirs(cfg)
    if refused:
        return refused
    if not cfg.nvme.enabled or cfg.nvme.bytes <= 0:
        return [Check("data dir", Verdict.SKIP, "nvme tier disabled")]
    path = cfg.nvme_path
    where = _existing(path, host)
    note = "" if where == path else f" (not created yet; checked {where})"
    total, avail = host.statvfs(str(where))
    used = 0
    for name in host.listdir(str(path)):
        with contextlib.suppress(OSError):
            used += host.stat(str(path / name)).st_size
    need = cfg.nvme.bytes
    detail = (f"{path}{note}: {format_bytes(avail)} free of {format_bytes(total)}"
              + (f", {format_bytes(used)} already in the tier" if used else "")
              + f"; nvme tier needs {format_bytes(need)}")
    out = []
    if avail + used < need:
        out.append(Check("data dir space", Verdict.FAIL, detail,
                         f"free {format_bytes(need - avail - used)} there, point nvme.path at "
                         "a larger drive, or lower nvme.bytes"))
    else:
        out.append(Check("data dir space", Verdict.OK, detail))
    out.append(check_dir_owner(path, host))
    m = mount_of(str(where), host.mountinfo())
    fstype = m.fstype if m else "?"
    if fstype in _NOT_FOR_FILES:
        out.append(Check("data dir filesystem", Verdict.FAIL,
                         f"{where} is on {fstype}, a kernel file system: the daemon cannot "
                         "keep its files there", "point daemon.data_dir (or nvme.path) at "
                         "a file system on the NVMe drive"))
    elif fstype == "overlay":
        out.append(Check("data dir filesystem", Verdict.WARN,
                         f"{where} is on overlayfs (the container's own layer): no O_DIRECT, "
                         "copy-up costs, and the tier is lost with the container",
                         "mount a host directory on the NVMe drive at nvme.path (Kubernetes "
                         "hostPath / local PV, docker -v)"))
    elif fstype in ("tmpfs", "ramfs"):
        out.append(Check("data dir filesystem", Verdict.WARN,
                         f"{where} is on {fstype}: the 'nvme' tier is RAM (counted twice "
                         "against memory) and does not survive a reboot",
                         "point nvme.path at a file system on the NVMe drive"))
    else:
        out.append(Check("data dir filesystem", Verdict.OK,
                         f"{where} is on {fstype}" + (f" ({m.source})" if m else "")))
    out.append(_check_o_direct(cfg, host))
    return out


def _probe_dir(cfg: Config, host: Host) -> Path | None:
    """Where the O_DIRECT probe may write: the nvme directory, else the data directory
    when the nvme directory is to be made in it; None when neither exists yet."""
    path = cfg.nvme_path
    if host.exists(str(path)):
        return path
    data = cfg.daemon.data_dir
    if path.parent == data and host.exists(str(data)):
        return data
    return None


def _check_o_direct(cfg: Config, host: Host) -> Check:
    where = _probe_dir(cfg, host)
    if where is None:
        return Check("data dir O_DIRECT", Verdict.SKIP,
                     f"{cfg.nvme_path} does not exist yet: O_DIRECT not probed (doctor writes "
                     "only inside the data directory); run doctor again after the daemon's "
                     "first start")
    probe = host.o_direct or _probe_o_direct
    err = probe(str(where))
    mode = cfg.nvme.direct
    if err is None:
        return Check("data dir O_DIRECT", Verdict.OK, f"O_DIRECT works in {where}")
    if mode == "off":
        return Check("data dir O_DIRECT", Verdict.OK,
                     f"O_DIRECT fails here ({err}); nvme.direct = off does not use it")
    verdict = Verdict.FAIL if mode == "on" else Verdict.WARN
    why = ("nvme.direct = on: the tier cannot open" if mode == "on" else
           "nvme.direct = auto falls back to buffered I/O: the page cache holds a second "
           "copy of every block")
    return Check("data dir O_DIRECT", verdict, f"O_DIRECT fails in {where} ({err}); " + why,
                 "put nvme.path on ext4/xfs on the NVMe drive (not tmpfs, overlayfs or a "
                 "network file system)")


def check_dir_owner(path: Path, host: Host) -> Check:
    """The nvme directory must be the daemon user's alone, as a start checks
    (kvtier.daemon.preflight): whoever can add files there can plant frames it serves."""
    if not host.exists(str(path)):
        return Check("data dir owner", Verdict.OK, f"{path} does not exist yet: the daemon "
                     "creates it 0700")
    problem = owned_dir_problem(host.stat(str(path)), host.uid())
    if problem is None:
        return Check("data dir owner", Verdict.OK, f"{path} is the daemon user's alone")
    return Check("data dir owner", Verdict.FAIL,
                 f"{path} {problem}: another user could plant frames the daemon serves as "
                 "KV, and the daemon refuses to start",
                 f"chmod go-w {path} (and chown it to the daemon's user)")


def check_socket_dir(cfg: Config, host: Host) -> Check:
    """The socket's directory, with the rules a start applies (kvtier.socket_path,
    kvtier.trust): every directory on its path root's or the daemon user's and not
    writable by others unless sticky (as /tmp), the daemon's user able to create the
    socket there, and the default directory private (0700). Doctor failed a sticky /tmp
    the start accepts and told root to chmod it (found by review)."""
    sock = str(cfg.daemon.socket)
    d = os.path.dirname(sock)
    refused = _refused_socket(cfg.daemon.socket, host.uid())
    if refused is not None:
        return refused
    if not host.exists(d):
        return Check("socket dir", Verdict.OK, f"{d} does not exist yet: the daemon creates "
                     "it 0700")
    st = host.stat(d)
    uid = host.uid()
    mode = stat_mod.S_IMODE(st.st_mode)
    detail = f"{d}: owner uid {st.st_uid}, mode {mode:04o}; the daemon runs as uid {uid}"
    if Path(d) == default_runtime_dir(uid=uid):
        lst = os.lstat(d)
        problem = private_dir_problem(lst, uid)
        if problem is not None:
            ours = stat_mod.S_ISDIR(lst.st_mode) and lst.st_uid == uid
            return Check("socket dir", Verdict.FAIL, f"{detail} -> the default socket "
                         f"directory {problem}: kvtier serve refuses to start (someone else "
                         "may have made it to take the socket over)",
                         f"chmod 0700 {d}" if ours else f"rm -r {d} (the daemon creates it "
                         "0700), or set daemon.socket (--socket) to a path in a directory "
                         "of yours")
    elif not os.access(d, os.W_OK | os.X_OK):
        return Check("socket dir", Verdict.FAIL, f"{detail} -> not writable by the daemon's "
                     "user: kvtier serve cannot create the socket there",
                     "set daemon.socket (--socket) to a path in a directory of yours "
                     "(created 0700), or run doctor as the daemon's user")
    if host.exists(sock):
        smode = stat_mod.S_IMODE(host.stat(sock).st_mode)
        if smode & 0o077:
            return Check("socket dir", Verdict.FAIL, detail + f"; socket mode {smode:04o}",
                         f"chmod 0600 {sock} (the daemon creates it 0600: restart it)")
    if mode & stat_mod.S_ISVTX and mode & 0o022:
        detail += (" -> shared, with the sticky bit: others cannot replace the socket "
                   "(born 0600)")
    return Check("socket dir", Verdict.OK, detail)


def _socket_dir_fix(where: Path, problem: str, uid: int) -> str:
    """The fix for a directory on the socket's path that a start refuses: chmod only a
    directory of the daemon's (non-root) user; a shared or root's directory (/tmp, /run)
    is never chmod-ed or chown-ed, the socket moves instead."""
    move = "set daemon.socket (--socket) to a path in a directory of yours (created 0700)"
    if "writable by" not in problem or uid == 0:
        return move
    try:
        mine = os.stat(where).st_uid == uid
    except OSError:
        mine = False
    return f"chmod go-w {where}, or {move}" if mine else move


def _refused_socket(socket_path: Path, uid: int) -> Check | None:
    """What a start refuses about the socket's path, with the checks it uses (kvtier.trust,
    kvtier.daemon.preflight): longer than a Unix socket allows, a directory that cannot be
    one (a regular file, a symbolic link loop), or a directory on its path that another
    user could change (kvtier.socket_path.socket_dir_problem; what is not there yet, the
    start creates 0700). None when none applies."""
    too_long = socket_path_problem(socket_path)
    if too_long is not None:
        return Check("socket dir", Verdict.FAIL, f"{too_long} (kvtier serve refuses to "
                     "start)", "set daemon.socket (--socket) to a shorter path")
    directory = socket_path.parent
    found = dir_path_problem(directory)
    if found is None:
        nearest = directory
        while not os.path.lexists(nearest) and nearest != nearest.parent:
            nearest = nearest.parent   # the start creates the rest 0700
        try:
            found = socket_dir_problem(nearest, uid)
        except OSError as exc:
            found = (Path(exc.filename or nearest), exc.strerror or str(exc))
    if found is None:
        return None
    where, problem = found
    risk = (", so another user could replace the socket"
            if "owned by" in problem or "writable by" in problem else "")
    return Check("socket dir", Verdict.FAIL,
                 f"{directory} (daemon.socket's directory): {where} {problem}{risk}; "
                 "kvtier serve refuses to start", _socket_dir_fix(where, problem, uid))
