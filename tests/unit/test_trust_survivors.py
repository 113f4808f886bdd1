# ruff: noqa: F811  (the fixtures of tests/support/store.py are imported by name)
"""Survivors of the trust-boundary mutation round (``kvtier.trust`` and the modules that
apply its rules): each test pins a check that no test noticed when it was broken. Pure
rules on synthetic stat results, the same-uid file and directory checks on real files; no
process is started. Each docstring names the mutant that survived."""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import secrets
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.client import KVTierClient, connect
from kvtier.daemon import preflight
from kvtier.daemon.greeting import Greeter
from kvtier.daemon.ops import Connection
from kvtier.daemon.preflight import (
    check_owned_dir,
    check_shm_space,
)
from kvtier.errors import (
    HandshakeError,
    ProtocolError,
    StartupError,
    TrustError,
    UntrustedArena,
    UntrustedDaemon,
)
from kvtier.handshake import MAX_HELLO_REPLY, open_verified, recv_hello, wait_until
from kvtier.presence import HEADER_BYTES, PresenceFilter, PresenceView, _unlink_if_same
from kvtier.protocol import (
    LENGTH,
    PROTOCOL_VERSION,
    REQUEST_MAX_ITEMS,
    pack,
    unpack_body,
)
from kvtier.socket_path import (
    SUN_PATH_MAX,
    claim_socket_path,
    socket_path_problem,
)
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.journal_files import write_file
from kvtier.tiers.journal_format import RECORD, open_private
from kvtier.tiers.journal_run import RUN_BYTES, RUN_FILE, begin_run, last_run
from kvtier.tiers.nvme import probe
from kvtier.tiers.nvme.probe import choose_direct
from kvtier.trust import (
    PeerCred,
    arena_problem,
    data_dir_problem,
    dirs_on_path,
    hold_flock,
    open_owned_file,
    owned_dir_problem,
    owned_file_problem,
    private_dir_problem,
)
from tests.support.control import server
from tests.support.store import arena, clock, nvme, store  # noqa: F401 - fixtures

ME = os.getuid()
USER = 1000 if ME == 0 else ME   # a daemon's uid that is not root's


def st(kind: int, mode: int, uid: int, size: int = 0, nlink: int = 1) -> os.stat_result:
    """A stat result: ``kind`` (stat.S_IFDIR, ...) | ``mode``, owned by ``uid``."""
    return os.stat_result((kind | mode, 1, 1, nlink, uid, 0, size, 0, 0, 0))


@pytest.fixture
def no_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


# -- pure rules --------------------------------------------------------------------------------
def test_a_root_owned_directory_is_not_a_users_private_socket_dir() -> None:
    """The default socket directory must be the daemon's own: one of root's (mode 0700) is
    not, for a daemon that is not root. Mutant that survived: root was accepted as its
    owner (the tests run as root, where the two are the same uid)."""
    got = private_dir_problem(st(stat.S_IFDIR, 0o700, 0), USER)
    assert got is not None and got.startswith(f"is owned by uid 0, not by uid {USER}")
    assert private_dir_problem(st(stat.S_IFDIR, 0o700, USER), USER) is None


def test_root_owned_data_files_and_dirs_are_not_a_users_own() -> None:
    """A daemon's data directory and files must be its user's alone: root's are not (only
    the directories above a data directory may be root's). Mutant that survived: root was
    accepted as their owner."""
    for rule, kind, mode in ((owned_file_problem, stat.S_IFREG, 0o600),
                             (owned_dir_problem, stat.S_IFDIR, 0o700)):
        got = rule(st(kind, mode, 0), USER)
        assert got is not None and got.startswith(f"is owned by uid 0, not by uid {USER}")
        assert rule(st(kind, mode, USER), USER) is None


@pytest.mark.parametrize("mode", [0o602, 0o606, 0o642], ids=lambda m: f"{m:04o}")
def test_a_data_file_others_may_write_is_refused(mode: int) -> None:
    """Write permission for others alone (not the group) makes a slot file or a lock
    another user's to forge. Mutant that survived: only the group's write bit was looked
    at (the tests had 0660 and 0666, which set both)."""
    got = owned_file_problem(st(stat.S_IFREG, mode, USER), USER)
    assert got == f"is writable by others (mode {mode:04o})"
    got = owned_dir_problem(st(stat.S_IFDIR, mode | 0o100, USER), USER)
    assert got == f"is writable by others (mode {mode | 0o100:04o})"


def test_a_data_dir_that_is_a_file_is_refused() -> None:
    """``owned_dir_problem`` names what is not a directory, whatever its owner and mode.
    Mutant that survived: a regular file of ours passed as a data directory."""
    assert owned_dir_problem(st(stat.S_IFREG, 0o600, USER), USER) == "is not a directory"


@pytest.mark.parametrize("mode", [0o610, 0o601, 0o700, 0o711], ids=lambda m: f"{m:04o}")
def test_an_arena_with_any_group_or_other_bit_is_refused(mode: int) -> None:
    """The arena must have no group or other permission bit at all, execute included, as
    the rule says (the daemon creates it 0600: any other bit means someone else made or
    changed it). Mutant that survived: execute bits for group and others passed."""
    got = arena_problem(st(stat.S_IFREG, mode, USER, size=4096), 4096, USER)
    if mode & 0o077:
        assert got == f"has mode {mode:04o}: group or others may read or write it"
    else:
        assert got is None


# -- dirs_on_path: the kernel's own limit on symbolic links ------------------------------------
def _chain(tmp_path: Path, links: int) -> Path:
    """A path that reaches ``tmp_path/real`` through ``links`` symbolic links."""
    (tmp_path / "real").mkdir(exist_ok=True)
    target = tmp_path / "real"
    for i in range(links):
        link = tmp_path / f"l{links}-{i}"
        link.symlink_to(target)
        target = link
    return target


def test_dirs_on_path_gives_up_where_the_kernel_does(tmp_path: Path) -> None:
    """40 symbolic links on the way are resolved, as the kernel does; 41 raise ELOOP, as
    the kernel's own lookup of that path does. Mutant that survived: the bound was a
    million hops (only a loop was tested, which fails at any bound, just later)."""
    ok = _chain(tmp_path, 40)
    assert dirs_on_path(ok)[-1] == tmp_path / "real"
    os.stat(ok)                                     # the kernel agrees
    too_many = _chain(tmp_path, 41)
    with pytest.raises(OSError) as kernel:
        os.stat(too_many)
    assert kernel.value.errno == errno.ELOOP
    with pytest.raises(OSError) as ours:
        dirs_on_path(too_many)
    assert ours.value.errno == errno.ELOOP


# -- data directories: the leaf and the directories above it -----------------------------------
def test_a_data_dir_reached_through_a_symlink_gets_the_owned_rule(tmp_path: Path) -> None:
    """The data directory is judged as the directory the path resolves to, however it is
    named: a sticky 1777 directory behind a symbolic link is still one others can add files
    to, and refused. Mutant that survived: the leaf was compared unresolved, so behind a
    link it got the lenient rule of the directories above it (sticky is fine)."""
    real = tmp_path / "real"
    real.mkdir()
    os.chmod(real, 0o1777)
    (tmp_path / "link").symlink_to(real)
    found = data_dir_problem(tmp_path / "link", ME)
    assert found == (real, "is writable by group and others (mode 1777)")


def test_a_data_dir_under_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    """A private data directory is not safe under a parent that others may write without
    the sticky bit (they could rename it away and put theirs in its place): the parent is
    named. Mutant that survived: only the data directory itself was checked (the test of a
    0777 parent also had a 0777 data directory)."""
    parent = tmp_path / "shared"
    data = parent / "data"
    data.mkdir(parents=True)
    os.chmod(data, 0o700)
    os.chmod(parent, 0o777)
    assert data_dir_problem(data, ME) == (
        parent, "is writable by group and others (mode 0777) without the sticky bit")
    os.chmod(parent, 0o1777)
    assert data_dir_problem(data, ME) is None


# -- open_owned_file ---------------------------------------------------------------------------
def test_a_data_file_is_created_private_whatever_the_umask(tmp_path: Path,
                                                           no_umask: None) -> None:
    """A slot file or lock the daemon creates is 0600 (its KV bytes are no one else's to
    read, even in a directory others may traverse), not what the umask leaves. Mutant that
    survived: it was created 0644, which the owned-file check accepts (it refuses only
    others' write bits)."""
    fd = open_owned_file(tmp_path / "slots", os.O_RDWR | os.O_CREAT, "nvme slot file",
                         "--nvme-path")
    try:
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
    finally:
        os.close(fd)


# -- the socket path ---------------------------------------------------------------------------
def test_the_socket_path_limit_is_exactly_what_bind_takes(tmp_path: Path) -> None:
    """A path of SUN_PATH_MAX (107) bytes is accepted and binds; one byte more is refused
    with the one line, before bind fails with a bare error. Mutants that survived: the
    comparison off by one either way (the test had a 120-byte path only)."""
    base = str(tmp_path) + "/"
    exact = Path(base + "x" * (SUN_PATH_MAX - len(base)))
    assert len(os.fsencode(exact)) == SUN_PATH_MAX
    assert socket_path_problem(exact) is None
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(exact))                          # the kernel takes it
    longer = Path(str(exact) + "y")
    got = socket_path_problem(longer)
    assert got is not None and f"is {SUN_PATH_MAX + 1} bytes, longer than the" in got
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(OSError):
        s.bind(str(longer))                         # the kernel does not


def test_another_users_stale_socket_is_not_removed(tmp_path: Path) -> None:
    """A dead socket of another uid on the path is theirs to remove, not the daemon's.
    Mutant that survived: it was unlinked like a stale socket of ours."""
    if ME != 0:
        pytest.skip("a socket of another uid needs root")
    stale = tmp_path / "theirs.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))                          # never listened: dead
    os.chown(stale, 4242, 4242)
    with pytest.raises(StartupError, match=f"stale socket {stale} belongs to uid 4242"):
        claim_socket_path(stale)
    assert stale.is_socket()


def test_a_symlink_to_a_stale_socket_is_not_claimed(tmp_path: Path) -> None:
    """Only a socket itself is ever removed from the path: a symbolic link there (to a
    dead socket of ours) is "not a socket", and stays. Mutant that survived: the path was
    stat'ed through the link, so the link was taken for a stale socket and unlinked."""
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))
    link = tmp_path / "kvtier.sock"
    link.symlink_to(stale)
    with pytest.raises(StartupError, match="is not a socket"):
        claim_socket_path(link)
    assert link.is_symlink()


# -- the client's hello (kvtier.handshake) -----------------------------------------------------
def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _send_reply(daemon: socket.socket, reply: dict[str, Any], fds: list[int],
                later_fds: list[int] | None = None) -> None:
    """The hello reply frame, ``fds`` riding on its first byte as a daemon passes them, and
    ``later_fds`` (what no kvtier daemon sends) on the rest of it."""
    data = pack(reply)
    sent = daemon.sendmsg([data[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                        array.array("i", fds))] if fds else [])
    assert sent == 1
    if later_fds:
        sent = daemon.sendmsg([data[1:]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                            array.array("i", later_fds))])
        assert sent == len(data) - 1
    else:
        daemon.sendall(data[1:])


def test_hello_descriptors_are_close_on_exec_and_extra_ones_closed(tmp_path: Path) -> None:
    """The arena's and the presence filter's descriptors arrive close-on-exec (a child the
    engine spawns must not inherit a mapping of the KV), both are handed back, and one
    more, passed with a later part of the frame (no kvtier daemon does), is closed rather
    than leaked. Mutants that survived: recvmsg without MSG_CMSG_CLOEXEC; the extra
    descriptors left open; the presence filter's dropped."""
    files = [os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(3)]
    client, daemon = socket.socketpair()
    try:
        before = _open_fds()
        _send_reply(daemon, {"id": 1, "ok": True, "version": 1}, files[:2], files[2:])
        reply, got = recv_hello(client, time.monotonic() + 5)
        assert reply["ok"] and len(got) == 2
        assert [os.fstat(fd).st_ino for fd in got] == [os.fstat(fd).st_ino for fd in files[:2]]
        for fd in got:
            assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        assert _open_fds() == before + 2                # the third was closed
        for fd in got:
            os.close(fd)
    finally:
        client.close()
        daemon.close()
        for fd in files:
            os.close(fd)


def test_an_error_hello_raises_its_error_and_closes_what_came_with_it(tmp_path: Path) -> None:
    """A hello the daemon refuses raises the typed error it names, and the descriptors
    passed with it are closed. Mutants that survived: an error reply taken for a
    greeting; the descriptors of a failed hello left open."""
    fd = os.open(tmp_path / "arena", os.O_RDWR | os.O_CREAT, 0o600)
    client, daemon = socket.socketpair()
    try:
        before = _open_fds()
        _send_reply(daemon, {"id": 1, "ok": False, "code": HandshakeError.code,
                             "error": "protocol version 9 not supported"}, [fd])
        with pytest.raises(HandshakeError, match="protocol version 9 not supported"):
            recv_hello(client, time.monotonic() + 5)
        assert _open_fds() == before
    finally:
        client.close()
        daemon.close()
        os.close(fd)


def test_a_hello_reply_longer_than_the_bound_is_refused_unread() -> None:
    """A frame header announcing more than MAX_HELLO_REPLY bytes is a ProtocolError at
    once, before any of it is read. Mutant that survived: the bound was 4 GiB."""
    client, daemon = socket.socketpair()
    try:
        daemon.sendall(LENGTH.pack(MAX_HELLO_REPLY + 1))
        daemon.shutdown(socket.SHUT_WR)
        with pytest.raises(ProtocolError, match="too large"):
            recv_hello(client, time.monotonic() + 5)
    finally:
        client.close()
        daemon.close()



def test_a_hello_reply_is_decoded_within_a_requests_bounds() -> None:
    """A hello reply holds a few dozen entries: one with more than a request may have
    (4097 in one array) is a ProtocolError, not millions of decoded objects. Mutant that
    survived: the reply was decoded without the item and entry bounds."""
    client, daemon = socket.socketpair()
    try:
        daemon.sendall(pack({"id": 1, "ok": True, "version": 1,
                             "extra": [0] * (REQUEST_MAX_ITEMS + 1)}))
        with pytest.raises(ProtocolError):
            recv_hello(client, time.monotonic() + 5)
    finally:
        client.close()
        daemon.close()


def test_a_hello_deadline_just_passed_is_a_timeout() -> None:
    """``wait_until`` raises TimeoutError as soon as the deadline has passed, not a
    ValueError from a negative socket timeout. Mutant that survived: a deadline passed by
    less than a second went on to ``settimeout`` with a negative value."""
    client, daemon = socket.socketpair()
    try:
        with pytest.raises(TimeoutError):
            wait_until(client, time.monotonic() - 0.5)
        wait_until(client, time.monotonic() + 5)
        left = client.gettimeout()
        assert left is not None and 0 < left <= 5
    finally:
        client.close()
        daemon.close()

@contextlib.contextmanager
def _silent_listener(path: Path) -> Iterator[None]:
    """A listener at ``path`` that accepts and never answers (a fake daemon)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    try:
        yield
    finally:
        srv.close()


@pytest.fixture
def foreign_peer(monkeypatch: pytest.MonkeyPatch) -> int:
    """Every Unix socket peer reports another uid (SO_PEERCRED as a foreign daemon's)."""
    uid = ME + 4242
    monkeypatch.setattr("kvtier.trust.peer_credentials",
                        lambda sock: PeerCred(os.getpid(), uid, uid))
    monkeypatch.delenv("KVTIER_TRUSTED_UIDS", raising=False)
    return uid


def test_every_way_to_connect_refuses_an_untrusted_uid(tmp_path: Path, foreign_peer: int) -> None:
    """``connect`` (trusted uids from the environment or the argument) and a client built
    on a socket the caller connected refuse a daemon of an untrusted uid before the hello,
    not by waiting for its reply. Mutants that survived: a client built on a raw socket
    trusted any uid; so did ``connect`` and ``open_verified`` (the integration tests catch
    those two with a real second user)."""
    path = tmp_path / "kvtier.sock"
    with _silent_listener(path):
        with pytest.raises(UntrustedDaemon, match=f"runs as uid {foreign_peer}"):
            connect(path, timeout=2.0)
        with pytest.raises(UntrustedDaemon, match=f"runs as uid {foreign_peer}"):
            connect(path, timeout=2.0, trusted_uids=[foreign_peer + 1])
        with pytest.raises(UntrustedDaemon, match=f"runs as uid {foreign_peer}"):
            open_verified(str(path), 2.0, frozenset())
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            raw.connect(str(path))
            with pytest.raises(UntrustedDaemon, match=f"runs as uid {foreign_peer}"):
                KVTierClient(raw, 2.0)
        finally:
            raw.close()


# -- the daemon's hello (kvtier.daemon.greeting) -----------------------------------------------
def _arena_file(tmp_path: Path) -> Path:
    arena = tmp_path / "arena"
    arena.write_bytes(bytes(4096))
    os.chmod(arena, 0o600)
    return arena


def test_the_greeter_never_passes_an_arena_reached_through_a_symlink(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Opening the arena by its path to pass it, the daemon does not follow a symbolic
    link there (whoever put it there chose what every client maps): no descriptor is
    passed, and that is logged. Mutant that survived: the open followed links."""
    link = tmp_path / "arena.link"
    link.symlink_to(_arena_file(tmp_path))
    greeter = Greeter(arena={"path": str(link), "size": 4096})
    with caplog.at_level(logging.WARNING, "kvtier.control"):
        assert greeter._descriptors({"arena_fd": True}, {}) == []
    assert "cannot open the arena" in caplog.text


def test_the_presence_filter_goes_only_to_a_client_that_asks(tmp_path: Path) -> None:
    """The presence filter's descriptor (and its announcement) go only with a hello that
    asks for it, after the arena's: a client that did not ask would take it for nothing,
    or for the arena. Mutant that survived: it was passed to every client."""
    presence = tmp_path / "presence"
    presence.write_bytes(b"")
    announced = {"counters_log2": 12, "hashes": 3, "exact": True}
    greeter = Greeter(arena={"path": str(_arena_file(tmp_path)), "size": 4096},
                      presence=(announced, lambda: os.open(presence, os.O_RDONLY)))
    reply: dict[str, Any] = {}
    fds = greeter._descriptors({"arena_fd": True}, reply)
    try:
        assert len(fds) == 1 and "presence" not in reply
    finally:
        for fd in fds:
            os.close(fd)
    fds = greeter._descriptors({"arena_fd": True, "presence_fd": True}, reply)
    try:
        assert len(fds) == 2 and reply["presence"] == announced
    finally:
        for fd in fds:
            os.close(fd)


def test_a_presence_filter_that_cannot_be_opened_is_not_announced(tmp_path: Path) -> None:
    """When the filter's descriptor cannot be opened, the hello does not announce it (the
    client would take the arena's descriptor for it, or none): it gets the arena alone.
    Mutant that survived: the announcement was made before the open."""
    def broken() -> int:
        raise PermissionError("presence filter was replaced under the daemon")

    greeter = Greeter(arena={"path": str(_arena_file(tmp_path)), "size": 4096},
                      presence=({"counters_log2": 12, "hashes": 3, "exact": True}, broken))
    reply: dict[str, Any] = {}
    fds = greeter._descriptors({"arena_fd": True, "presence_fd": True}, reply)
    try:
        assert len(fds) == 1 and "presence" not in reply
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("version", [True, 1.0, "1"], ids=["bool", "float", "str"])
def test_a_hello_version_must_be_an_int(version: object) -> None:
    """The hello's version is an int of the supported ones: ``True`` (which equals 1) and
    other look-alikes are refused. Mutant that survived: ``True`` was taken for 1."""
    async def read() -> dict[str, Any]:
        return {"op": "hello", "version": version, "id": 1}

    greeter = Greeter(arena={"path": "/nonexistent", "size": 4096})
    with pytest.raises(HandshakeError, match="not supported"):
        asyncio.run(greeter.greet(Connection(1, os.getpid(), ME), read,
                                  None))  # type: ignore[arg-type]


def test_the_first_request_must_be_a_hello() -> None:
    """Any other first request is a HandshakeError: nothing is served before the hello.
    Mutant that survived: any op was greeted as a hello."""
    async def read() -> dict[str, Any]:
        return {"op": "stats", "version": PROTOCOL_VERSION, "id": 1}

    greeter = Greeter(arena={"path": "/nonexistent", "size": 4096})
    with pytest.raises(HandshakeError, match="first request must be 'hello'"):
        asyncio.run(greeter.greet(Connection(1, os.getpid(), ME), read,
                                  None))  # type: ignore[arg-type]


def test_a_busy_lock_closes_its_descriptor(tmp_path: Path) -> None:
    """``hold_flock`` closes the descriptor it was given when another holds the lock (a
    daemon refused at start does not keep the lock file open). Mutant that survived: the
    descriptor was left open."""
    path = tmp_path / "lock"
    holder = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        hold_flock(holder, lambda: "unused")
        fd = os.open(path, os.O_RDWR)
        with pytest.raises(StartupError, match="held elsewhere"):
            hold_flock(fd, lambda: "held elsewhere")
        with pytest.raises(OSError) as err:
            os.fstat(fd)
        assert err.value.errno == errno.EBADF
    finally:
        os.close(holder)


# -- the presence filter (kvtier.presence) -----------------------------------------------------
LOG2 = 12


@pytest.mark.parametrize("swap", ["file", "symlink"])
def test_a_client_never_gets_a_filter_swapped_under_the_daemon(tmp_path: Path,
                                                               swap: str) -> None:
    """The descriptor passed to a client is the daemon's own filter: a file put at its
    name since (another file, or a link to the daemon's own file) is refused. Mutants that
    survived: the inode comparison dropped; the open followed a link."""
    f = PresenceFilter.create(tmp_path / "p", counters_log2=LOG2)
    try:
        os.rename(f.path, tmp_path / "kept")
        if swap == "file":
            (tmp_path / "p").write_bytes(bytes(HEADER_BYTES + (1 << LOG2)))
        else:
            (tmp_path / "p").symlink_to(tmp_path / "kept")
        with pytest.raises(OSError):
            f.open_for_client()
    finally:
        f.close()


def test_a_client_gets_a_read_only_descriptor(tmp_path: Path) -> None:
    """The filter's descriptor for a client is opened read-only: the counters are the
    daemon's to change. Mutant that survived: it was opened read-write (the client maps it
    read-only, but the descriptor let it write)."""
    f = PresenceFilter.create(tmp_path / "p", counters_log2=LOG2)
    fd = f.open_for_client()
    try:
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        with pytest.raises(OSError):
            os.write(fd, b"x")
    finally:
        os.close(fd)
        f.close()


def test_a_view_checks_the_filters_owner_and_whole_header(tmp_path: Path) -> None:
    """A client maps the filter only when it is owned by the daemon's verified uid (not
    its own), and its header matches the whole announcement (hashes included, not only
    the magic). Mutants that survived: the owner compared with the client's uid; only the
    magic compared."""
    f = PresenceFilter.create(tmp_path / "p", counters_log2=LOG2)
    try:
        with pytest.raises(UntrustedArena, match=f"not by the daemon's uid {ME + 4242}"):
            PresenceView(f.open_for_client(), f.announce(True), ME + 4242)
        with pytest.raises(UntrustedArena, match="header does not match"):
            PresenceView(f.open_for_client(), {**f.announce(True), "hashes": 2}, ME)
        view = PresenceView(f.open_for_client(), f.announce(True), ME)
        view.close()
    finally:
        f.close()


def test_a_filter_without_hashes_is_malformed(tmp_path: Path) -> None:
    """A filter needs at least one counter per key: zero hashes (under which every key
    would read as present) is a ValueError, for the daemon and for a client's view.
    Mutant that survived: zero hashes were accepted."""
    with pytest.raises(ValueError, match="0 hashes"):
        PresenceFilter.create(tmp_path / "p", counters_log2=LOG2, hashes=0)
    f = PresenceFilter.create(tmp_path / "q", counters_log2=LOG2)
    try:
        with pytest.raises(ValueError, match="0 hashes"):
            PresenceView(f.open_for_client(), {**f.announce(True), "hashes": 0}, ME)
    finally:
        f.close()


def test_keys_that_are_not_block_keys_get_no_bound(tmp_path: Path) -> None:
    """Only 16-byte block keys are looked up in the filter: keys of another length give no
    bound (every one may be there), never one read from misaligned bytes. Mutant that
    survived: the length guard dropped (a 17-byte key was read as the first 16 bytes of
    it, and ruled out)."""
    f = PresenceFilter.create(tmp_path / "p", counters_log2=LOG2)
    view = view_of_filter(f)
    try:
        assert view.leading_bound([b"\1" * 17]) == 1
        assert view.leading_bound([b"\1" * 16, b"\2" * 17]) == 2
    finally:
        view.close()
        f.close()


def view_of_filter(f: PresenceFilter) -> PresenceView:
    return PresenceView(f.open_for_client(), f.announce(True), ME)


def test_a_half_made_filter_removes_only_its_own_file(tmp_path: Path) -> None:
    """The cleanup of a filter that could not be made removes the path only while it is
    still the file the daemon opened, never what another put there since. Mutant that
    survived: whatever was at the path was removed."""
    path = tmp_path / "p"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.rename(path, tmp_path / "ours")
        path.write_bytes(b"someone else's")
        _unlink_if_same(path, fd)
        assert path.read_bytes() == b"someone else's"
        os.rename(tmp_path / "ours", tmp_path / "back")
        _unlink_if_same(tmp_path / "back", fd)
        assert not (tmp_path / "back").exists()
    finally:
        os.close(fd)


# -- the arena mapping (kvtier.tiers.arena_mapping) --------------------------------------------
def test_mappings_of_one_file_at_two_sizes_are_not_shared(tmp_path: Path) -> None:
    """A process shares one mapping per arena file and size: a client told a larger size
    for the same file gets a mapping of that size, not the smaller one another client
    made (whose buffer would end short of the slots it is lent). Mutant that survived: the
    size was not part of the key."""
    arena = tmp_path / "arena"
    arena.write_bytes(bytes(8192))
    os.chmod(arena, 0o600)
    small = ArenaMapping(str(arena), 4096)
    large = ArenaMapping(str(arena), 8192)
    try:
        assert len(small.buf) == 4096 and len(large.buf) == 8192
        assert large.view(4096, 4096, writable=True).size == 4096
    finally:
        small.close()
        large.close()


@pytest.mark.parametrize(("offset", "nbytes"), [(-1, 1), (4096 - 10, 11), (4096, 1)])
def test_a_view_outside_the_arena_is_refused(tmp_path: Path, offset: int, nbytes: int) -> None:
    """A slot that starts before the arena or ends past it is a ProtocolError, not a
    shorter slice (or one counted from the end). Mutants that survived: a negative offset
    passed; the end compared one byte late."""
    arena = tmp_path / "arena"
    arena.write_bytes(bytes(4096))
    os.chmod(arena, 0o600)
    m = ArenaMapping(str(arena), 4096)
    try:
        with pytest.raises(ProtocolError, match="outside the arena"):
            m.view(offset, nbytes, writable=False)
        assert m.view(4096 - 10, 10, writable=False).size == 10
    finally:
        m.close()


@pytest.mark.parametrize("offset", [1.0, "0", None], ids=["float", "str", "none"])
def test_a_view_at_an_offset_that_is_not_an_int_is_refused(tmp_path: Path,
                                                           offset: object) -> None:
    """A slot offset from a reply must be an int: anything else is a ProtocolError, not a
    TypeError from the slice (or a slice of another meaning). Mutant that survived: the
    offset's type was not checked."""
    arena = tmp_path / "arena"
    arena.write_bytes(bytes(4096))
    os.chmod(arena, 0o600)
    m = ArenaMapping(str(arena), 4096)
    try:
        with pytest.raises(ProtocolError, match="outside the arena"):
            m.view(offset, 16, writable=False)  # type: ignore[arg-type]
    finally:
        m.close()


# -- the arena journal's files -----------------------------------------------------------------
def test_a_journal_file_is_new_and_private(tmp_path: Path, no_umask: None) -> None:
    """A compaction's journal file is created fresh (O_EXCL: never a file someone put at
    its name) and 0600 whatever the umask (its records name every cached key). Mutants
    that survived: O_EXCL dropped; the file created 0644."""
    tmp = tmp_path / "arena.journal.tmp"
    fd = write_file(tmp, [b"r" * RECORD], 4)
    try:
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
        assert os.fstat(fd).st_size == 4 * RECORD
    finally:
        os.close(fd)
    tmp.unlink()
    tmp.write_bytes(b"planted")
    with pytest.raises(FileExistsError):
        write_file(tmp, [b"r" * RECORD], 4)
    assert tmp.read_bytes() == b"planted"


def test_a_journal_file_that_cannot_be_written_is_removed(tmp_path: Path) -> None:
    """A journal file that fails while being written (a file system too small) is not left
    behind. Mutant that survived: the half-made file stayed."""
    tmp = tmp_path / "arena.journal.tmp"
    with pytest.raises(OSError):
        write_file(tmp, [], 1 << 50)
    assert not tmp.exists()


def test_a_run_file_is_private_whatever_the_umask(tmp_path: Path, no_umask: None) -> None:
    """``begin_run`` writes the run file 0600 whatever the umask, so the next start can
    read it back (``last_run`` refuses a file others may write). Mutant that survived: it
    was created 0666 less the umask, which with umask 0 made every start a cold one."""
    run = begin_run(tmp_path)
    assert stat.S_IMODE((tmp_path / RUN_FILE).stat().st_mode) == 0o600
    assert last_run(tmp_path) == run


@pytest.mark.parametrize("plant", ["symlink", "world-writable", "hard-link", "short", "long"])
def test_a_run_file_not_ours_alone_or_not_an_id_means_no_run(tmp_path: Path,
                                                              plant: str) -> None:
    """``last_run`` names a run only from a private regular file of ours holding exactly a
    16-byte id: a symbolic link (to a valid id of ours), a file others may write, one with
    a second name, an id too short or too long all mean no run (a cold start). Mutants
    that survived: the open followed links; the file was not checked; a short id passed;
    a long one was cut to 16 bytes."""
    run = begin_run(tmp_path)
    assert last_run(tmp_path) == run
    path = tmp_path / RUN_FILE
    if plant == "symlink":
        os.rename(path, tmp_path / "elsewhere")
        path.symlink_to(tmp_path / "elsewhere")
    elif plant == "world-writable":
        os.chmod(path, 0o666)
    elif plant == "hard-link":
        os.link(path, tmp_path / "second-name")
    else:
        path.write_text(("ab" * (RUN_BYTES - 1) if plant == "short" else "ab" * (RUN_BYTES + 1))
                        + "\n")
    assert last_run(tmp_path) is None


@pytest.mark.parametrize("plant", ["fifo", "symlink", "other-uid", "group-readable"])
def test_open_private_refuses_what_is_not_a_private_file_of_ours(tmp_path: Path,
                                                                 plant: str) -> None:
    """The arena journal is opened only as a regular file of this uid with no group or
    other permission bit, never through a symbolic link; a FIFO at its name does not pass
    (opened read-write here, which never blocks on a FIFO). Mutants that survived: each
    of those checks dropped in turn."""
    path = tmp_path / "arena.journal"
    good = tmp_path / "good"
    good.write_bytes(bytes(RECORD))
    os.chmod(good, 0o600)
    os.close(open_private(good, os.O_RDWR))
    if plant == "fifo":
        os.mkfifo(path, 0o600)
    elif plant == "symlink":
        path.symlink_to(good)
    elif plant == "other-uid":
        if ME != 0:
            pytest.skip("a file of another uid needs root")
        path.write_bytes(bytes(RECORD))
        os.chmod(path, 0o600)
        os.chown(path, 4242, 4242)
    else:
        path.write_bytes(bytes(RECORD))
        os.chmod(path, 0o640)
    with pytest.raises(OSError):
        os.close(open_private(path, os.O_RDWR))


def test_open_private_hands_back_a_blocking_descriptor(tmp_path: Path) -> None:
    """The journal's descriptor is opened O_NONBLOCK (a planted FIFO) but handed back
    blocking, as its readers and writers expect. Mutant that survived: it stayed
    non-blocking."""
    path = tmp_path / "arena.journal"
    path.write_bytes(bytes(RECORD))
    os.chmod(path, 0o600)
    fd = open_private(path, os.O_RDWR)
    try:
        assert os.get_blocking(fd)
    finally:
        os.close(fd)


class _FullDiskOs:
    """``os`` for the probe's module, whose ``open`` finds the file system full."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def open(*args: Any, **kwargs: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_disk_too_full_to_create_the_probe_gives_no_verdict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC (or EDQUOT) creating the O_DIRECT probe file says nothing about O_DIRECT, as
    when writing it: ``auto`` keeps O_DIRECT, ``on`` names the full disk. Mutant that
    survived: a full disk at the open was taken for a file system without O_DIRECT (the
    test filled the disk after the open, at the write)."""
    monkeypatch.setattr(probe, "os", _FullDiskOs())
    assert choose_direct(tmp_path, "auto") is True
    with pytest.raises(StartupError, match=r"nvme\.direct=on .* file system is full"):
        choose_direct(tmp_path, "on")


class _FixedNames:
    """``secrets`` for the probe's module, whose random names are all one (as if guessed)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(secrets, name)

    @staticmethod
    def token_hex(nbytes: int | None = None) -> str:
        return "0" * 16


def test_the_probe_never_writes_a_file_already_at_its_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The O_DIRECT probe creates its file (O_EXCL): a file already at the name, even a
    regular one of ours that O_NOFOLLOW lets through, is neither written nor removed.
    Mutant that survived: O_EXCL dropped (the name is random, so no test could plant it)."""
    monkeypatch.setattr(probe, "secrets", _FixedNames())
    planted = tmp_path / f".odirect-probe-{os.getpid()}-{'0' * 16}"
    planted.write_bytes(b"precious" * 512)
    assert probe.probe_direct(tmp_path) is not None
    assert planted.read_bytes() == b"precious" * 512


# -- the daemon's peer check (kvtier.daemon.control) -------------------------------------------
class _PeerCredOf:
    """Stands in for control's SO_PEERCRED struct: every peer reports ``uid``, or the
    getsockopt fails (``uid`` None)."""

    size = 12

    def __init__(self, uid: int | None) -> None:
        self.uid = uid

    def unpack(self, raw: bytes) -> tuple[int, int, int]:
        if self.uid is None:
            raise OSError(errno.EOPNOTSUPP, "SO_PEERCRED unavailable")
        return os.getpid(), self.uid, self.uid


@pytest.mark.parametrize("uid", [ME + 4242, None], ids=["other-uid", "unknown-uid"])
async def test_a_peer_not_of_the_daemons_uid_is_told_and_dropped(
        store: TieredStore, arena: Arena, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        uid: int | None) -> None:
    """A connection from another uid, or one whose uid cannot be read, gets one TrustError
    reply and is closed: counted, never registered as a connection, nothing served after.
    Mutants that survived: a peer whose SO_PEERCRED failed was taken for the daemon's own
    user; a refused peer went on to be served after its TrustError; the refusal was not
    counted."""
    monkeypatch.setattr("kvtier.daemon.control._PEERCRED", _PeerCredOf(uid))
    srv = server(store, arena, tmp_path)
    await srv.start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(srv.socket_path))
        writer.write(pack({"op": "hello", "version": PROTOCOL_VERSION, "id": 1}))
        await writer.drain()
        (n,) = LENGTH.unpack(await asyncio.wait_for(reader.readexactly(LENGTH.size), 5))
        reply = unpack_body(await reader.readexactly(n), n)
        assert reply["ok"] is False and reply["code"] == TrustError.code
        assert f"not uid {-1 if uid is None else uid}" in reply["error"]
        assert await asyncio.wait_for(reader.read(), 5) == b""
        await asyncio.sleep(0.2)                      # what a served peer would get to
        assert srv.connections == {} and srv.rejected_peers == 1
        writer.close()
    finally:
        await srv.stop_accepting()
        await srv.close_connections(1.0)


# -- the daemon's start checks (kvtier.daemon.preflight) ---------------------------------------
def test_another_users_files_at_the_arenas_names_are_not_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only this daemon's own stale arena and side files count as shared memory it may
    reuse: files of another uid at those names (which it will not take over) do not.
    Mutant that survived: any regular file there counted."""
    if ME != 0:
        pytest.skip("files of another uid need root")
    arena = tmp_path / "kvtier-0-dabc.arena"
    arena.write_bytes(b"\1" * 8 * 2**20)
    os.chown(arena, 4242, 4242)
    monkeypatch.setattr(preflight, "shm_free_bytes", lambda d: 4 * 2**20)
    with pytest.raises(StartupError, match=r"needs .* of shared memory but"):
        check_shm_space(tmp_path, 6 * 2**20, reusable=arena)
    os.chown(arena, ME, os.getgid())
    check_shm_space(tmp_path, 6 * 2**20, reusable=arena)


def test_an_arena_one_page_larger_than_the_free_space_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The arena must fit in the free shared memory to the byte: one page more than there
    is free is refused, exactly as much is not. Mutant that survived: a page of slack."""
    monkeypatch.setattr(preflight, "shm_free_bytes", lambda d: 64 * 2**20)
    check_shm_space(tmp_path, 64 * 2**20)
    with pytest.raises(StartupError, match=r"needs .* of shared memory but"):
        check_shm_space(tmp_path, 64 * 2**20 + 4096)


def test_a_data_dir_under_another_users_directory_is_not_told_to_chown(
        tmp_path: Path) -> None:
    """When the unsafe directory is one above the data directory (another user's), the fix
    is another directory, not a chown of theirs. Mutant that survived: every ownership
    problem was told to chown."""
    if ME != 0:
        pytest.skip("a directory of another uid needs root")
    parent = tmp_path / "theirs"
    data = parent / "data"
    data.mkdir(parents=True)
    os.chmod(data, 0o700)
    os.chown(parent, 4242, 4242)
    with pytest.raises(StartupError) as err:
        check_owned_dir(data, "data directory", "--data-dir")
    msg = str(err.value)
    assert f"{parent} is owned by uid 4242" in msg
    assert "use a directory owned by you or root" in msg and "chown" not in msg
