"""Startup failures (issue 14, item 5): one line naming the path and the fix, exit 2.

Each case runs a real ``kvtier serve`` that must refuse to start: a read-only or
unwritable data directory (empty or holding an nvme tier), a socket directory that is not
ours or is unusable, a busy HTTP port, an arena larger than the free shared memory, and
other OSErrors. No traceback unless ``--debug``. A read-only file system is a read-only
bind mount in a private mount namespace (``unshare -m``), so nothing outside the test
sees it; an unwritable directory needs a second uid (root writes anywhere).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import connect
from kvtier.daemon.preflight import shm_free_bytes
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess
from tests.support.serve import one_line_error, run_serve, serve_env, serving, small_args
from tests.support.users import other_user, private_dir_of, python_for, user_env

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32",
                  tokens_per_block=16, kv_format="vllm_cpu")
OTHER = "kvtier-victim"


def _args(root: Path, *extra: str) -> list[str]:
    return [*small_args(root), "--socket", str(root / "run" / "kvtier.sock"), *extra]


def _read_only(directory: Path) -> list[str]:
    """A command prefix that runs the rest with ``directory`` mounted read-only (private)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a read-only mount needs root and unshare(1)")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a private mount namespace: {probe.stderr.strip()}")
    script = ('mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"')
    return ["unshare", "-m", "sh", "-c", script, str(directory)]


# -- data directory ----------------------------------------------------------------------------
def test_read_only_empty_data_dir(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    line = one_line_error(run_serve(_args(tmp_path), prefix=_read_only(data)))
    assert f"data directory {data} is unusable" in line
    assert "read-only file system" in line and "--data-dir" in line


def test_read_only_data_dir_holding_an_nvme_tier(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "kvd", cpu_bytes="16MiB", nvme_bytes="32MiB").start()
    try:
        with connect(d.socket) as client:
            ns = client.register_layout(LAYOUT, "startup/model")
            keys = block_keys(ns, list(range(2 * LAYOUT.tokens_per_block)))
            blocks = [np.full(LAYOUT.block_bytes, i, np.uint8) for i in range(len(keys))]
            assert client.put(ns, keys, blocks, durable=True) == len(keys)
    finally:
        assert d.terminate() == 0
    assert any((d.data_dir / "nvme").iterdir())                 # an existing tier
    args = ["--data-dir", str(d.data_dir), "--socket", str(d.socket), "--http-port", "0",
            "--cpu-bytes", "16MiB", "--nvme-bytes", "32MiB"]
    line = one_line_error(run_serve(args, prefix=_read_only(d.data_dir)))
    assert f"data directory {d.data_dir} is unusable" in line
    assert "read-only file system" in line


def test_nvme_path_on_a_read_only_file_system(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    args = _args(tmp_path)
    args[args.index("--nvme-bytes") + 1] = "32MiB"
    line = one_line_error(run_serve([*args, "--nvme-path", str(nvme)],
                                    prefix=_read_only(nvme)))
    assert f"nvme directory {nvme} is unusable" in line and "--nvme-path" in line


def test_data_dir_another_user_cannot_write(tmp_path: Path) -> None:
    """EACCES: the daemon runs as a second uid; the data directory is root's (0755)."""
    user = other_user(OTHER)
    python = python_for(user.name)
    root = private_dir_of(user, Path("/tmp"), "kvtier-startup-")
    data = Path("/tmp") / f"{root.name}-data"
    try:
        data.mkdir(mode=0o755)
        args = ["--data-dir", str(data), "--socket", str(root / "kvtier.sock"),
                "--http-port", "0", "--cpu-bytes", "16MiB", "--nvme-bytes", "0"]
        p = run_serve(args, env=user_env(), user=user.name, python=python)
        line = one_line_error(p)
        assert f"data directory {data} is unusable: Permission denied" in line
        assert f"uid {user.uid}" in line and f"chown -R {user.name} {data}" in line
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)


def test_data_dir_below_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    data = tmp_path / "file" / "data"
    args = _args(tmp_path)
    args[args.index("--data-dir") + 1] = str(data)
    line = one_line_error(run_serve(args))
    assert f"data directory {data} is unusable" in line and "--data-dir" in line


@pytest.mark.parametrize("under", [False, True], ids=["loop", "under-loop"])
@pytest.mark.parametrize("warm", ["--cpu-warm-restart", "--no-cpu-warm-restart"])
def test_data_dir_that_is_a_symlink_loop(tmp_path: Path, under: bool, warm: str) -> None:
    """Path.resolve() in the arena's name raised a 50-line traceback (warm restart on), and
    mkdir said "is unusable: File exists" (off): one line naming daemon.data_dir now."""
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    data = tmp_path / "loop1" / "kv" if under else tmp_path / "loop1"
    args = _args(tmp_path, warm)
    args[args.index("--data-dir") + 1] = str(data)
    line = one_line_error(run_serve(args))
    assert f"data directory {data} is unusable: " in line and "daemon.data_dir" in line
    assert "symbolic link loop" in line and "--data-dir" in line
    assert "File exists" not in line


# -- socket directory --------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "expect"), [
    pytest.param(0o777, "is writable by group and others (mode 0777)", id="0777"),
    pytest.param(0o770, "is writable by its group (mode 0770)", id="0770"),
])
def test_socket_dir_others_can_write(tmp_path: Path, mode: int, expect: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, mode)
    line = one_line_error(run_serve(_args(tmp_path)))
    assert f"socket directory {run} is not safe: {run} {expect}" in line
    assert f"chmod go-w {run}" in line


def test_socket_dir_below_a_writable_dir_reached_by_symlink(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    (shared / "run").mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(shared / "run")             # --socket tmp/run/kvtier.sock
    line = one_line_error(run_serve(_args(tmp_path)))
    assert f"{shared} is writable by group and others" in line


def test_socket_dir_of_another_user(tmp_path: Path) -> None:
    user = other_user(OTHER)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.chown(run, user.uid, user.gid)
    line = one_line_error(run_serve(_args(tmp_path)))
    assert f"{run} is owned by uid {user.uid}" in line


def test_socket_dir_the_daemon_cannot_write() -> None:
    """A root-owned 0755 directory is safe but unusable for a daemon of another uid."""
    user = other_user(OTHER)
    python = python_for(user.name)
    root = private_dir_of(user, Path("/tmp"), "kvtier-startup-")
    run = Path("/tmp") / f"{root.name}-run"
    try:
        run.mkdir(mode=0o755)
        args = ["--data-dir", str(root / "data"), "--socket", str(run / "kvtier.sock"),
                "--http-port", "0", "--cpu-bytes", "16MiB", "--nvme-bytes", "0"]
        line = one_line_error(run_serve(args, env=user_env(), user=user.name, python=python))
        assert (f"socket directory {run} is not usable: {run} is not writable by uid "
                f"{user.uid}") in line and "--socket" in line
        assert "use a directory of yours" in line and "chmod" not in line   # (it is safe)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)


def test_sticky_shared_socket_dir_is_accepted(tmp_path: Path) -> None:
    """Like /tmp: world-writable with the sticky bit, nobody can replace our socket."""
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o1777)
    with serving(_args(tmp_path)) as (_proc, socket_path), connect(socket_path) as client:
        client.ping()


def test_missing_socket_dir_is_created_private(tmp_path: Path) -> None:
    with serving(_args(tmp_path)) as (_proc, socket_path):
        assert Path(socket_path).parent.stat().st_mode & 0o777 == 0o700


def test_socket_dir_is_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("not a directory")
    line = one_line_error(run_serve(_args(tmp_path)))
    assert f"socket directory {tmp_path / 'run'}" in line and "--socket" in line


def test_socket_path_too_long(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    args = [*small_args(tmp_path), "--socket", str(deep / "kvtier.sock")]
    line = one_line_error(run_serve(args))
    assert "longer than the 107 a Unix socket allows" in line and "--socket" in line


def test_a_file_at_the_socket_path_is_never_removed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "kvtier.sock").write_text("precious")
    line = one_line_error(run_serve(_args(tmp_path)))
    assert f"{run / 'kvtier.sock'} exists and is not a socket" in line
    assert (run / "kvtier.sock").read_text() == "precious"


# -- HTTP port, shared memory, other OSErrors ---------------------------------------------------
def test_http_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        args = _args(tmp_path)
        args[args.index("--http-port") + 1] = str(port)
        line = one_line_error(run_serve(args))
    assert f"cannot listen for HTTP on 127.0.0.1:{port}" in line
    assert "Address already in use" in line and "--http-port" in line
    assert not (tmp_path / "run" / "kvtier.sock").exists()     # failed before serving


def test_arena_larger_than_free_shared_memory(tmp_path: Path) -> None:
    # A start short of room first reclaims the stale arenas of its shm directory. In
    # /dev/shm itself those are other tests' warm restarts in waiting (another pytest-xdist
    # worker's daemon between crash() and start()): this start took them away, and that
    # test restarted cold. So the arena is asked for in a private directory on the same
    # tmpfs (the same free space), where nothing else lives.
    shm = Path(tempfile.mkdtemp(prefix="kvtier-test-shm-", dir="/dev/shm"))
    try:
        too_big = shm_free_bytes(shm) + 2**30
        args = _args(tmp_path, "--nvme-bytes", "64MiB", "--cpu-shm-dir", str(shm))
        args[args.index("--cpu-bytes") + 1] = str(too_big)
        line = one_line_error(run_serve(args))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert f"but {shm} has only" in line and "--cpu-bytes" in line
    assert not (tmp_path / "data").exists()    # a refused start leaves no directories


def test_shm_dir_missing(tmp_path: Path) -> None:
    env = serve_env({"KVTIER_CPU_SHM_DIR": str(tmp_path / "no-shm")})
    line = one_line_error(run_serve(_args(tmp_path), env=env))
    assert f"{tmp_path / 'no-shm'} does not exist" in line


def test_shm_dir_that_is_a_regular_file(tmp_path: Path) -> None:
    """It was reported as "does not exist"."""
    (tmp_path / "shm").write_text("x")
    env = serve_env({"KVTIER_CPU_SHM_DIR": str(tmp_path / "shm")})
    line = one_line_error(run_serve(_args(tmp_path), env=env))
    assert f"{tmp_path / 'shm'} (cpu.shm_dir) is unusable: it is not a directory" in line
    assert "does not exist" not in line


def test_a_socket_held_by_something_else_is_not_called_a_kvtier_daemon(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(str(run / "kvtier.sock"))
        other.listen(1)
        line = one_line_error(run_serve(_args(tmp_path)))
    assert f"something is listening on {run / 'kvtier.sock'} and does not answer as " \
           "kvtier" in line and "--socket" in line
    assert "kvtier daemon is already serving" not in line


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_shm_dir_others_can_write_without_the_sticky_bit(tmp_path: Path, mode: int) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(mode)
    env = serve_env({"KVTIER_CPU_SHM_DIR": str(shm)})
    line = one_line_error(run_serve(_args(tmp_path), env=env))
    assert f"shared-memory directory {shm} is writable by" in line and "sticky" in line
    shm.chmod(mode | 0o1000)   # as /dev/shm: others may add files, not replace ours
    with serving(_args(tmp_path), env=env) as (_proc, socket_path), connect(socket_path):
        pass


def test_config_file_that_is_a_directory(tmp_path: Path) -> None:
    line = one_line_error(run_serve([*_args(tmp_path), "--config", str(tmp_path)]))
    assert str(tmp_path) in line and "is not a regular file" in line


def test_config_file_that_is_a_fifo_or_a_device(tmp_path: Path) -> None:
    """A FIFO blocked the start for ever, /dev/zero read until memory ran out."""
    fifo = tmp_path / "kvtier.toml"
    os.mkfifo(fifo)
    for config in (fifo, Path("/dev/zero")):
        line = one_line_error(run_serve([*_args(tmp_path), "--config", str(config)],
                                        timeout=30))
        assert f"config file {config} is not a regular file" in line


@pytest.mark.parametrize(("how", "expect"), [
    ({"toml": "[daemon]\nsocket = 5\n"}, "daemon.socket: invalid value 5 (must be a path"),
    ({"toml": '[daemon]\ndata_dir = "/x\\u0000b"\n'}, "must not contain a NUL byte"),
    ({"env": {"KVTIER_DATA_DIR": ""}}, "daemon.data_dir: invalid value '' (must not be empty"),
    ({"env": {"KVTIER_HTTP_HOST": " "}}, "http.host is empty, which would listen on every"),
    ({"args": ["--data-dir", "~kvtier-no-such-user/kv"]}, "daemon.data_dir: invalid value"),
    ({"args": ["--redis-url", "redis://h:99999/0"]}, "redis.url 'redis://h:99999/0' is "
                                                     "malformed (Port out of range"),
    ({"args": ["--redis-connect-timeout-s", "1e308"]}, "redis.connect_timeout_s: invalid"),
])
def test_settings_that_ended_in_a_traceback_are_one_line(
        tmp_path: Path, how: dict[str, object], expect: str) -> None:
    args = _args(tmp_path)
    if "toml" in how:
        (tmp_path / "kvtier.toml").write_text(str(how["toml"]))
        args += ["--config", str(tmp_path / "kvtier.toml")]
    args += list(how.get("args", []))  # type: ignore[call-overload]
    env = serve_env(dict(how.get("env", {})))  # type: ignore[call-overload]
    assert expect in one_line_error(run_serve(args, env=env))


def test_two_daemons_started_at_once_on_one_socket(tmp_path: Path) -> None:
    """Both passed the socket checks before either listened (the listener replaces a
    socket file), so both served and the one that stopped first took the other's socket
    away. The socket's lock lets one start; the other refuses in one line."""
    sock = tmp_path / "run" / "kvtier.sock"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "serve", "--data-dir", str(tmp_path / f"d{i}"),
         "--socket", str(sock), "--http-port", "0", "--cpu-bytes", "128MiB",
         "--nvme-bytes", "0"],
        env=serve_env(), cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    try:
        deadline = time.monotonic() + 60
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2)   # had both passed, the second would be serving by now too
        exited = [p for p in procs if p.poll() is not None]
        assert len(exited) == 1, [p.returncode for p in procs]
        (loser,) = exited
        assert loser.stderr is not None
        err = loser.stderr.read()
        assert loser.returncode == 2 and "Traceback" not in err, err
        assert f"another kvtier daemon is already serving (or starting on) {sock}" in err \
            or f"another kvtier daemon is already serving {sock}" in err, err
        with connect(sock) as client:   # the winner still owns the socket
            client.ping()
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(30)


def test_a_uid_without_a_home_is_told_to_pass_a_data_dir() -> None:
    """A container's arbitrary uid: HOME unset, no passwd entry, no --data-dir. The start
    ended in a RuntimeError traceback ("Could not determine home directory")."""
    python = python_for(other_user("kvtier-victim").name)
    uid = 54321
    try:
        import pwd
        pwd.getpwuid(uid)
        pytest.skip(f"uid {uid} has a passwd entry here")
    except KeyError:
        pass
    p = subprocess.run([python, "-m", "kvtier.cli", "serve", "--http-port", "0",
                        "--cpu-bytes", "16MiB", "--nvme-bytes", "0",
                        "--socket", "/tmp/kvtier-nohome-test.sock"],
                       user=uid, env=user_env(), cwd="/", capture_output=True, text=True,
                       timeout=90)
    line = one_line_error(p)
    assert f"no home directory for uid {uid}" in line and "--data-dir" in line
