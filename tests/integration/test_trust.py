"""Socket and arena trust (issue 14, item 1): no other user can hijack a client's daemon.

Reproduces the attack of the issue with real processes: another local user (created with
useradd; skipped with the reason where it cannot be) pre-creates the default socket
directory, runs a fake daemon on the client's socket path, or hands out an arena file it
can read and write. The daemon refuses such a directory (exit 2, one line); the client
refuses a daemon of another uid before sending a byte, and never maps an arena that is not
a private regular file of the daemon's user.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import KVTierClient, connect, connect_async
from kvtier.errors import (
    DaemonUnavailable,
    RequestTimeout,
    TrustError,
    UntrustedArena,
    UntrustedDaemon,
)
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from kvtier.protocol import LENGTH, pack, unpack_body
from tests.support.daemon import DaemonProcess
from tests.support.fake_daemon import LISTENER_SOURCE, FakeDaemon
from tests.support.serve import one_line_error, run_serve, serve_env, serving, small_args
from tests.support.users import OtherUser, other_user, private_dir_of, python_for, user_env

ATTACKER = "kvtier-attacker"
VICTIM = "kvtier-victim"
ARENA_SIZE = 1 << 20
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32",
                  tokens_per_block=16, kv_format="vllm_cpu")


@pytest.fixture(scope="module")
def attacker() -> OtherUser:
    return other_user(ATTACKER)


@pytest.fixture(scope="module")
def victim() -> OtherUser:
    return other_user(VICTIM)


@pytest.fixture
def xdg() -> Iterator[Path]:
    """A private XDG_RUNTIME_DIR (root, 0700) in /tmp, where an attacker's socket can be
    moved in (pytest's own tmp dirs may sit on another path than /tmp)."""
    path = Path(tempfile.mkdtemp(prefix="kvtier-xdg-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- the daemon never uses a socket directory someone else could control ---------------------
@pytest.mark.parametrize(("owner", "mode", "expect"), [
    pytest.param("attacker", 0o777, "owned by uid", id="other-uid-0777"),
    pytest.param("attacker", 0o700, "owned by uid", id="other-uid-0700"),
    pytest.param("self", 0o777, "has mode 0777, not 0700", id="ours-0777"),
    pytest.param("self", 0o755, "has mode 0755, not 0700", id="ours-0755"),
    pytest.param("symlink", 0o700, "is a symbolic link", id="symlink"),
])
def test_daemon_refuses_a_precreated_default_socket_dir(
        request: pytest.FixtureRequest, tmp_path: Path, xdg: Path, owner: str, mode: int,
        expect: str) -> None:
    run_dir = xdg / "kvtier"
    if owner == "symlink":
        target = tmp_path / "elsewhere"
        target.mkdir(mode=0o700)
        run_dir.symlink_to(target)
    else:
        run_dir.mkdir()
        os.chmod(run_dir, mode)
        if owner == "attacker":
            user = request.getfixturevalue("attacker")
            os.chown(run_dir, user.uid, user.gid)
    p = run_serve(small_args(tmp_path), env=serve_env({"XDG_RUNTIME_DIR": str(xdg)}))
    line = one_line_error(p)
    assert f"socket directory {run_dir} " in line and expect in line
    assert "--socket" in line                                   # the way out
    assert not os.path.lexists(run_dir / "kvtier.sock")
    if owner != "symlink":
        assert stat.S_IMODE(os.lstat(run_dir).st_mode) == mode  # left as it was found


def test_daemon_creates_the_default_socket_dir_private_and_clients_find_it(
        tmp_path: Path, xdg: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(small_args(tmp_path), env=serve_env({"XDG_RUNTIME_DIR": str(xdg)})) as (
            _proc, socket_path):
        assert socket_path == str(xdg / "kvtier" / "kvtier.sock")
        st = os.lstat(xdg / "kvtier")
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == os.getuid()
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
        monkeypatch.delenv("KVTIER_SOCKET", raising=False)
        with connect() as client:                          # the default path, same rules
            client.ping()
            assert client._ops.arena is not None and client._ops.arena.source == "fd"


@pytest.mark.parametrize("mode", [0o777, 0o700], ids=["0777", "0700"])
def test_victim_daemon_refuses_the_tmp_dir_another_user_created(
        attacker: OtherUser, victim: OtherUser, mode: int) -> None:
    """The issue's reproduction: without XDG_RUNTIME_DIR a non-root daemon's default is
    /tmp/kvtier-UID; another user who creates it first must not get the socket."""
    python = python_for(victim.name)
    run_dir = Path(f"/tmp/kvtier-{victim.uid}")
    shutil.rmtree(run_dir, ignore_errors=True)                 # an earlier run's
    data = private_dir_of(victim, Path("/tmp"), "kvtier-victim-data-")
    try:
        run_dir.mkdir()
        os.chown(run_dir, attacker.uid, attacker.gid)
        os.chmod(run_dir, mode)
        p = run_serve(small_args(data), env=user_env(), user=victim.name, python=python)
        line = one_line_error(p)
        assert f"socket directory {run_dir} is owned by uid {attacker.uid}" in line
        assert not os.path.lexists(run_dir / "kvtier.sock")

        shutil.rmtree(run_dir)                                  # now nobody got there first
        with serving(small_args(data), env=user_env(), user=victim.name, python=python) as (
                _proc, socket_path):
            assert socket_path == str(run_dir / "kvtier.sock")
            st = os.lstat(run_dir)
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (victim.uid, 0o700)
            assert os.lstat(socket_path).st_uid == victim.uid
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)
        # the daemon kept its arena for a warm restart that never comes (a fresh data dir
        # each run names a new one): the test takes it away
        for leftover in Path("/dev/shm").glob(f"kvtier-{victim.uid}-*"):
            leftover.unlink(missing_ok=True)


def test_another_users_process_is_told_why_the_daemon_refuses_it(
        victim: OtherUser, attacker: OtherUser) -> None:
    """A daemon serves only its own user. A process of another uid that can reach it (root
    trusting it) got "connection dropped during the hello"; one that cannot (the socket is
    0600) got "no kvtier daemon ... start one" though one runs. Both are told now."""
    python = python_for(victim.name)
    data = private_dir_of(victim, Path("/tmp"), "kvtier-victim-data-")
    sock_dir = private_dir_of(victim, Path("/tmp"), "kvtier-victim-sock-")
    os.chmod(sock_dir, 0o755)                      # others may reach the socket's mode
    args = [*small_args(data), "--socket", str(sock_dir / "kvtier.sock")]
    try:
        with serving(args, env=user_env(), user=victim.name, python=python) as (_p, path):
            with pytest.raises(TrustError, match=f"serves only that user's processes, not "
                                                 f"uid {os.getuid()}"):
                connect(path, timeout=5.0, trusted_uids=[victim.uid])
            probe = ("import sys\nfrom kvtier.client import connect\n"
                     "from kvtier.errors import DaemonUnavailable\n"
                     "try:\n    connect(sys.argv[1], timeout=5.0)\n"
                     "except DaemonUnavailable as exc:\n    print(exc)\n")
            out = subprocess.run([python_for(attacker.name), "-c", probe, path],
                                 user=attacker.name, env=user_env(), cwd="/",
                                 capture_output=True, text=True, timeout=60)
            assert "permission denied" in out.stdout and "kvtier serve" in out.stdout, (
                out.stdout + out.stderr)
    finally:
        shutil.rmtree(data, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)
        for leftover in Path("/dev/shm").glob(f"kvtier-{victim.uid}-*"):
            leftover.unlink(missing_ok=True)


# -- the client checks who listens before it sends anything ----------------------------------
class ForeignListener:
    """``LISTENER_SOURCE`` run as ``user``: reports how many bytes a client sent."""

    def __init__(self, user: OtherUser) -> None:
        self.dir = private_dir_of(user, Path("/tmp"), "kvtier-attack-", mode=0o755)
        self.path = self.dir / "kvtier.sock"
        self.proc = subprocess.Popen(
            [python_for(user.name), "-c", LISTENER_SOURCE, str(self.path), "20"],
            user=user.name, env=user_env(), cwd="/", stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"

    def received(self) -> int:
        out, _ = self.proc.communicate(timeout=30)
        return int(out.strip().removeprefix("received "))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def foreign(attacker: OtherUser) -> Iterator[ForeignListener]:
    listener = ForeignListener(attacker)
    try:
        yield listener
    finally:
        listener.close()


def _connect_either(mode: str, path: Path | None, **kwargs: object) -> None:
    if mode == "sync":
        connect(path, timeout=1.0, **kwargs).close()  # type: ignore[arg-type]
        return

    async def go() -> None:
        client = await connect_async(path, timeout=1.0, **kwargs)  # type: ignore[arg-type]
        await client.close()

    asyncio.run(go())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_client_refuses_a_foreign_daemon_on_the_default_path_before_sending(
        foreign: ForeignListener, attacker: OtherUser, xdg: Path, mode: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The attacker's directory and its fake daemon at the victim's default socket path."""
    run_dir = xdg / "kvtier"
    run_dir.mkdir()
    os.chown(run_dir, attacker.uid, attacker.gid)
    os.chmod(run_dir, 0o777)
    os.rename(foreign.path, run_dir / "kvtier.sock")       # the socket keeps its listener
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    monkeypatch.delenv("KVTIER_SOCKET", raising=False)
    monkeypatch.delenv("KVTIER_TRUSTED_UIDS", raising=False)
    with pytest.raises(UntrustedDaemon) as err:
        _connect_either(mode, None)
    msg = str(err.value)
    assert f"runs as uid {attacker.uid}" in msg and "kvtier serve" in msg
    assert str(run_dir / "kvtier.sock") in msg
    assert foreign.received() == 0                          # not even the hello


def test_client_refuses_a_foreign_daemon_on_an_explicit_path(
        foreign: ForeignListener, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_TRUSTED_UIDS", raising=False)
    with pytest.raises(UntrustedDaemon):
        connect(foreign.path, timeout=1.0)
    assert foreign.received() == 0


@pytest.mark.parametrize("how", ["argument", "env"])
def test_a_trusted_uid_is_talked_to(foreign: ForeignListener, attacker: OtherUser, how: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """KVTIER_TRUSTED_UIDS (names or uids) or ``trusted_uids=``: the hello goes out."""
    kwargs: dict[str, object] = {}
    if how == "env":
        monkeypatch.setenv("KVTIER_TRUSTED_UIDS", f"12345, {attacker.name}")
    else:
        kwargs["trusted_uids"] = [attacker.uid]
    with pytest.raises(RequestTimeout):                     # the fake never answers
        connect(foreign.path, timeout=1.0, **kwargs)  # type: ignore[arg-type]
    assert foreign.received() > 0


# -- the client maps only a private arena file of the daemon's user ---------------------------
def _arena_file(tmp_path: Path, mode: int = 0o600, size: int = ARENA_SIZE) -> Path:
    path = tmp_path / "fake.arena"
    with open(path, "wb") as f:
        f.truncate(size)
    os.chmod(path, mode)
    return path


def _bad_arena(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    if kind == "world_writable":
        return _arena_file(tmp_path, 0o666)
    if kind == "group_readable":
        return _arena_file(tmp_path, 0o640)
    if kind == "other_owner":
        user = request.getfixturevalue("attacker")
        path = _arena_file(tmp_path, 0o600)
        os.chown(path, user.uid, user.gid)                  # root could open it anyway
        return path
    if kind == "symlink":
        link = tmp_path / "link.arena"
        link.symlink_to(_arena_file(tmp_path, 0o600))
        return link
    if kind == "too_small":
        return _arena_file(tmp_path, 0o600, size=ARENA_SIZE // 2)
    if kind == "fifo":
        path = tmp_path / "fifo.arena"
        os.mkfifo(path, 0o600)
        return path
    raise AssertionError(kind)


BAD_ARENAS = ["world_writable", "group_readable", "other_owner", "symlink", "too_small",
              "fifo"]


@pytest.mark.parametrize("kind", BAD_ARENAS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_client_refuses_an_arena_named_by_path_that_is_not_private(
        tmp_path: Path, request: pytest.FixtureRequest, kind: str, mode: str) -> None:
    arena = _bad_arena(kind, tmp_path, request)
    fake = FakeDaemon(tmp_path / "fake.sock", {"path": str(arena), "size": ARENA_SIZE})
    with fake, pytest.raises(UntrustedArena) as err:
        _connect_either(mode, fake.path)
    assert f"refusing to map the arena {arena}" in str(err.value)
    assert [sorted(h) for h in fake.hellos] == [["arena_fd", "client", "id", "key_scheme", "op",
                                                 "presence_fd", "version"]]   # only the hello


@pytest.mark.parametrize("kind", ["world_writable", "group_readable", "other_owner",
                                  "too_small"])
def test_client_refuses_an_arena_passed_by_fd_that_is_not_private(
        tmp_path: Path, request: pytest.FixtureRequest, kind: str) -> None:
    arena = _bad_arena(kind, tmp_path, request)
    (tmp_path / "ok").mkdir()
    good = _arena_file(tmp_path / "ok", 0o600)
    fd = os.open(arena, os.O_RDWR)
    try:
        # the hello names a good file: the descriptor, which is what gets mapped, decides
        fake = FakeDaemon(tmp_path / "fake.sock", {"path": str(good), "size": ARENA_SIZE},
                          pass_fd=fd)
        with fake, pytest.raises(UntrustedArena) as err:
            connect(fake.path, timeout=2.0)
    finally:
        os.close(fd)
    assert "(fd)" in str(err.value)


@pytest.mark.parametrize("by_fd", [False, True])
def test_client_maps_a_private_arena_of_its_daemon(tmp_path: Path, by_fd: bool) -> None:
    """The control: the same fake with a 0600 file of ours is accepted, both ways."""
    arena = _arena_file(tmp_path, 0o600)
    fd = os.open(arena, os.O_RDWR) if by_fd else None
    try:
        with FakeDaemon(tmp_path / "fake.sock", {"path": str(arena), "size": ARENA_SIZE},
                        pass_fd=fd) as fake, connect(fake.path, timeout=2.0) as client:
            assert client._ops.arena is not None
            assert client._ops.arena.source == ("fd" if by_fd else "path")
            assert client._ops.arena.size == ARENA_SIZE
    finally:
        if fd is not None:
            os.close(fd)


# -- the real daemon hands its arena over as a descriptor ------------------------------------
def test_real_daemon_passes_the_arena_by_fd_to_both_clients(daemon: DaemonProcess) -> None:
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 32000, size=4 * LAYOUT.tokens_per_block).tolist()
    with connect(daemon.socket) as client:
        assert client._ops.arena is not None and client._ops.arena.source == "fd"
        ns = client.register_layout(LAYOUT, "trust/model")
        keys = block_keys(ns, tokens)
        blocks = [rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8) for _ in keys]
        assert client.put(ns, keys, blocks) == len(keys)

    async def read_back() -> list[np.ndarray]:
        aclient = await connect_async(daemon.socket)
        try:
            assert aclient._ops.arena is not None and aclient._ops.arena.source == "fd"
            ans = await aclient.register_layout(LAYOUT, "trust/model")
            out = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
            assert await aclient.get(ans, keys, out) == len(keys)
            return out
        finally:
            await aclient.close()

    got = asyncio.run(read_back())
    assert all(np.array_equal(a, b) for a, b in zip(got, blocks, strict=True))


def test_a_hello_without_arena_fd_still_gets_the_path(daemon: DaemonProcess) -> None:
    """Older clients (no ``arena_fd`` in the hello) keep working: path only, no descriptor."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(str(daemon.socket))
        s.sendall(pack({"id": 1, "op": "hello", "version": 1}))
        data, anc, _flags, _ = s.recvmsg(LENGTH.size, socket.CMSG_SPACE(4))
        assert anc == [] and len(data) == LENGTH.size
        (n,) = LENGTH.unpack(data)
        body = b""
        while len(body) < n:
            body += s.recv(n - len(body))
        reply = unpack_body(body)
    finally:
        s.close()
    assert reply["ok"] is True and Path(reply["arena"]["path"]).exists()
    st = os.stat(reply["arena"]["path"])
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o600


def test_a_client_connects_only_after_the_checks(daemon: DaemonProcess) -> None:
    """The real daemon passes every check (own uid, private arena): sanity of the rules."""
    with connect(daemon.socket) as client:
        client.ping()
        assert client.stats()["daemon"]["rejected_peers"] == 0


def test_a_client_built_on_a_raw_socket_verifies_too(daemon: DaemonProcess) -> None:
    """``KVTierClient(sock, timeout)`` without ``connect``: same checks, same descriptor."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(daemon.socket))
    with KVTierClient(sock, 5.0) as client:
        client.ping()
        assert client._ops.arena is not None and client._ops.arena.source == "fd"


def test_an_unreachable_daemon_is_still_daemon_unavailable(tmp_path: Path) -> None:
    with pytest.raises(DaemonUnavailable):
        connect(tmp_path / "nobody.sock", timeout=1.0)


# -- admin endpoints: any bearer token is a 401, never a 500 ---------------------------------
def _status(url: str, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _raw_status(url: str, header: bytes) -> int:
    """A request whose Authorization header holds raw (UTF-8) bytes http.client refuses."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET /v1/admin/config HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Authorization: " + header + b"\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1])


def test_admin_bearer_tokens(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(env={"KVTIER_HTTP_ADMIN_TOKEN": "s3cret"}).start()
    url = d.http_url + "/v1/admin/config"
    assert _status(url, {"Authorization": "Bearer s3cret"}) == 200
    assert _status(url, {}) == 401
    assert _status(url, {"Authorization": "Bearer wrong"}) == 401
    assert _status(url, {"Authorization": "Basic czNjcmV0"}) == 401
    assert _status(url, {"Authorization": "Bearer t\u00f6k\u00e9n"}) == 401   # latin-1 on wire
    assert _raw_status(d.http_url, "Bearer 秘密".encode()) == 401
    assert _raw_status(d.http_url, b"Bearer \xff\xfe\x80") == 401            # not even UTF-8
    assert "Traceback" not in d.log()
    assert _status(d.http_url + "/healthz", {}) == 200


def test_admin_is_off_without_a_token(daemon: DaemonProcess) -> None:
    assert _status(daemon.http_url + "/v1/admin/config", {"Authorization": "Bearer x"}) == 403
