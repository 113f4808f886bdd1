"""``kvtier doctor --env``: every check's failing branch in a crafted environment.

Real files where the machine has them (a socket directory with the wrong mode, the real
O_DIRECT probe on tmpfs, the real mountinfo); crafted readers where a unit test cannot
change the machine (a tiny /dev/shm, overlayfs mount info, two NUMA nodes, a GPU).
tests/integration/test_doctor_env_cli.py runs the command on a real 1 MiB tmpfs and against
a real daemon.
"""

from __future__ import annotations

import dataclasses
import os
import re
import resource
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import Config, default_runtime_dir, load_config
from kvtier.daemon.preflight import shm_side_bytes
from kvtier.doctor import env_daemon, env_fs, env_host, env_redis
from kvtier.doctor.env import Check, Host, Verdict, exit_status, run_checks, to_json
from kvtier.errors import StartupError
from kvtier.keys import KEY_SCHEME
from kvtier.socket_path import prepare_socket_dir

GiB = 2**30
OVERLAY = (
    "22 1 0:21 / / rw,relatime shared:1 - overlay overlay rw,lowerdir=/l,upperdir=/u\n"
    "30 22 0:26 / /dev/shm rw,nosuid,nodev shared:5 - tmpfs shm rw,size=65536k\n"
    "31 22 0:27 / /tmp\\040dir rw shared:6 - tmpfs tmpfs rw\n"
)


def config(tmp_path: Path, **over: Any) -> Config:
    o = {"cpu": "1GiB", "shm": "/dev/shm", "nvme": "1GiB", "direct": "auto",
         "nvme_path": tmp_path / "nvme", **over}
    text = (f'[daemon]\ndata_dir = "{tmp_path / "data"}"\n'
            f'socket = "{tmp_path / "run" / "s.sock"}"\n'
            f'[cpu]\nbytes = "{o["cpu"]}"\nshm_dir = "{o["shm"]}"\n'
            f'[nvme]\nbytes = "{o["nvme"]}"\ndirect = "{o["direct"]}"\n'
            f'path = "{o["nvme_path"]}"\n')
    (tmp_path / "k.toml").write_text(text)
    return load_config(tmp_path / "k.toml", env={})


def host(**readers: Any) -> Host:
    """The real host with some readers replaced; no GPU unless a test gives one."""
    base: dict[str, Any] = {"gpu": lambda: (False, "no driver"), "kvikio_mode": lambda: None,
                            "o_direct": lambda d: None}
    return dataclasses.replace(Host(), **{**base, **readers})


def by_name(checks: list[Check], name: str) -> Check:
    return next(c for c in checks if c.name == name)


# -- /dev/shm --------------------------------------------------------------------------------
def test_shm_smaller_than_the_cpu_tier_fails(tmp_path: Path) -> None:
    h = host(statvfs=lambda p: (64 * 2**20, 60 * 2**20), mountinfo=lambda: OVERLAY)
    c = env_fs.check_shm(config(tmp_path, cpu="1GiB"), h)
    assert c.verdict is Verdict.FAIL and "smaller than the cpu tier" in c.detail
    assert "--shm-size" in c.fix and "remount,size=" in c.fix


def test_shm_grow_fix_is_a_size_mount_accepts_and_enough(tmp_path: Path) -> None:
    """It said ``size=70.9 GiB`` (a space and a decimal: mount refuses it)."""
    total, avail = 64 * 2**20, 60 * 2**20
    cfg = config(tmp_path, cpu="1GiB")
    h = host(statvfs=lambda p: (total, avail), mountinfo=lambda: OVERLAY)
    c = env_fs.check_shm(cfg, h)
    m = re.search(r"mount -o remount,size=(\S+) /dev/shm ", c.fix)
    assert m is not None, c.fix
    value = re.fullmatch(r"(\d+)m", m.group(1))
    assert value is not None, m.group(1)
    wanted = (cfg.cpu.bytes + shm_side_bytes(warm_restart=cfg.cpu.warm_restart)) * 1.1 \
        + total - avail
    assert (int(value.group(1)) - 1) * 2**20 < wanted <= int(value.group(1)) * 2**20
    assert env_fs.mount_size(3 * GiB) == "3072m" and env_fs.mount_size(GiB + 1) == "1025m"


def test_shm_without_enough_free_fails_but_counts_our_arenas(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    arena = shm / f"kvtier-{os.getuid()}-123-abc.arena"
    arena.write_bytes(b"")
    os.truncate(arena, 600 * 2**20)   # a running daemon's arena (sparse)
    cfg = config(tmp_path, cpu="1GiB", shm=shm)
    tmpfs = f"1 0 0:9 / {shm} rw - tmpfs tmpfs rw\n"
    tight = host(statvfs=lambda p: (2 * GiB, 500 * 2**20), mountinfo=lambda: tmpfs)
    assert env_fs.check_shm(cfg, tight).verdict is Verdict.OK        # 500 MiB + 600 MiB
    arena.unlink()
    c = env_fs.check_shm(cfg, tight)
    assert c.verdict is Verdict.FAIL and "not enough free" in c.detail


def test_shm_dir_that_is_not_memory_warns(tmp_path: Path) -> None:
    cfg = config(tmp_path, cpu="1MiB", shm=tmp_path)
    h = host(statvfs=lambda p: (10 * GiB, 10 * GiB),
             mountinfo=lambda: "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n")
    assert env_fs.check_shm(cfg, h).verdict is Verdict.WARN


def test_missing_shm_dir_fails(tmp_path: Path) -> None:
    c = env_fs.check_shm(config(tmp_path, shm=tmp_path / "nope"), host())
    assert c.verdict is Verdict.FAIL


# -- data dir --------------------------------------------------------------------------------
def test_data_dir_on_overlayfs_warns_and_short_space_fails(tmp_path: Path) -> None:
    h = host(statvfs=lambda p: (100 * GiB, 10 * GiB), mountinfo=lambda: OVERLAY)
    checks = env_fs.check_data_dir(config(tmp_path, nvme="64GiB",
                                          nvme_path="/var/lib/kvtier/nvme"), h)
    assert by_name(checks, "data dir space").verdict is Verdict.FAIL
    fs = by_name(checks, "data dir filesystem")
    assert fs.verdict is Verdict.WARN and "overlayfs" in fs.detail and "hostPath" in fs.fix


def test_data_dir_on_tmpfs_warns(tmp_path: Path) -> None:
    h = host(statvfs=lambda p: (100 * GiB, 90 * GiB), mountinfo=lambda: OVERLAY)
    checks = env_fs.check_data_dir(config(tmp_path, nvme_path="/dev/shm/kv"), h)
    assert by_name(checks, "data dir filesystem").verdict is Verdict.WARN


def test_o_direct_refused_warns_in_auto_fails_in_on(tmp_path: Path) -> None:
    """Older kernels' tmpfs, overlayfs and some network file systems refuse O_DIRECT."""
    h = host(o_direct=lambda d: "EINVAL: Invalid argument")
    (tmp_path / "nvme").mkdir()   # probed only inside the tier's own directory
    verdicts = {}
    for mode in ("auto", "on", "off"):
        checks = env_fs.check_data_dir(config(tmp_path, nvme="1MiB", direct=mode), h)
        verdicts[mode] = by_name(checks, "data dir O_DIRECT").verdict
    assert verdicts == {"auto": Verdict.WARN, "on": Verdict.FAIL, "off": Verdict.OK}


def test_the_real_o_direct_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    err = env_fs._probe_o_direct(str(tmp_path))
    assert err is None or "EINVAL" in err   # this machine's file system decides
    assert list(tmp_path.iterdir()) == []


def test_the_probe_writes_only_inside_the_data_dir(tmp_path: Path) -> None:
    """With the default nvme path (<data_dir>/nvme) and no data dir yet, the probe wrote
    a file in the data dir's parent (~/.local/share); now it says so and writes nothing."""
    probed: list[str] = []
    h = host(o_direct=lambda d: probed.append(d))
    (tmp_path / "k.toml").write_text(f'[daemon]\ndata_dir = "{tmp_path / "data"}"\n'
                                     '[nvme]\nbytes = "1MiB"\n')
    cfg = load_config(tmp_path / "k.toml", env={})
    c = by_name(env_fs.check_data_dir(cfg, h), "data dir O_DIRECT")
    assert c.verdict is Verdict.SKIP and "not probed" in c.detail and probed == []
    (tmp_path / "data").mkdir(mode=0o700)             # the data dir: the probe goes there
    c = by_name(env_fs.check_data_dir(cfg, h), "data dir O_DIRECT")
    assert c.verdict is Verdict.OK and probed == [str(tmp_path / "data")]
    (tmp_path / "data" / "nvme").mkdir(mode=0o700)
    env_fs.check_data_dir(cfg, h)
    assert probed[-1] == str(tmp_path / "data" / "nvme")


@pytest.mark.parametrize("how", ["file", "below a file", "loop", "under a loop", "dangling"])
def test_a_data_dir_serve_refuses_fails_without_a_traceback(tmp_path: Path, how: str) -> None:
    """A data dir that is a file, under a file, or a symbolic link loop: the O_DIRECT probe
    raised NotADirectoryError (mkstemp in a file), a loop passed as 'not created yet'."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    data = {"file": tmp_path / "file", "below a file": tmp_path / "file" / "kv",
            "loop": tmp_path / "loop1", "under a loop": tmp_path / "loop1" / "kv",
            "dangling": tmp_path / "dangling"}[how]
    (tmp_path / "k.toml").write_text(f'[daemon]\ndata_dir = "{data}"\n[nvme]\nbytes = "1MiB"\n')
    cfg = load_config(tmp_path / "k.toml", env={})
    checks = env_fs.check_data_dir(cfg, Host(gpu=lambda: (False, "")))   # the real probe
    assert [c.verdict for c in checks] == [Verdict.FAIL], checks
    assert "daemon.data_dir" in checks[0].detail and "refuses to start" in checks[0].detail
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "file", "k.toml",
                                                          "loop1", "loop2"]   # no probe


def test_a_data_dir_on_proc_fails_without_a_traceback(tmp_path: Path) -> None:
    """/proc/1/kvt: the probe's mkstemp in /proc raised FileNotFoundError."""
    (tmp_path / "k.toml").write_text('[daemon]\ndata_dir = "/proc/1/kvt"\n'
                                     '[nvme]\nbytes = "1MiB"\n')
    checks = env_fs.check_data_dir(load_config(tmp_path / "k.toml", env={}), Host())
    assert by_name(checks, "data dir filesystem").verdict is Verdict.FAIL
    assert by_name(checks, "data dir O_DIRECT").verdict is Verdict.SKIP


def test_what_serve_refuses_about_the_socket_and_shm_fails(tmp_path: Path) -> None:
    """A socket path over the Unix limit, a socket directory that is a regular file, a
    cpu.shm_dir that is a regular file: a start refuses each, doctor passed or warned."""
    (tmp_path / "file").write_text("x")
    cfg = config(tmp_path)
    cfg.daemon.socket = tmp_path / "file" / "kvtier.sock"
    c = env_fs.check_socket_dir(cfg, host())
    assert c.verdict is Verdict.FAIL and "is not a directory" in c.detail
    cfg.daemon.socket = tmp_path / ("d" * 60) / ("e" * 60) / "kvtier.sock"
    c = env_fs.check_socket_dir(cfg, host())
    assert c.verdict is Verdict.FAIL and "longer than the 107" in c.detail
    c = env_fs.check_shm(config(tmp_path, shm=tmp_path / "file"), host())
    assert c.verdict is Verdict.FAIL and "is not a directory" in c.detail
    assert "cpu.shm_dir" in c.detail


def test_mountinfo_parsing() -> None:
    shm, tmp, lib = (env_fs.mount_of(p, OVERLAY) for p in ("/dev/shm/x", "/tmp dir/a",
                                                            "/var/lib"))
    assert shm is not None and shm.fstype == "tmpfs"
    assert tmp is not None and tmp.point == "/tmp dir"
    assert lib is not None and lib.fstype == "overlay"
    assert env_fs.parse_mountinfo("garbage\n") == []


# -- socket dir ------------------------------------------------------------------------------
def test_socket_dir_with_the_wrong_mode_fails(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    run = cfg.daemon.socket.parent
    run.mkdir()
    run.chmod(0o777)
    c = env_fs.check_socket_dir(cfg, host())
    assert c.verdict is Verdict.FAIL and "replace the socket" in c.detail and "0700" in c.fix
    assert "kvtier serve refuses to start" in c.detail
    run.chmod(0o755)   # a start accepts it: only writers could replace the socket
    assert env_fs.check_socket_dir(cfg, host()).verdict is Verdict.OK
    run.chmod(0o700)
    assert env_fs.check_socket_dir(cfg, host()).verdict is Verdict.OK
    cfg.daemon.socket.write_bytes(b"")
    cfg.daemon.socket.chmod(0o666)
    assert env_fs.check_socket_dir(cfg, host()).verdict is Verdict.FAIL


def _owned_by_another(path: Path, daemon_uid: int) -> None:
    """Make ``path`` another user's than ``daemon_uid`` (and not root's): chown it when
    this test runs as root, else it is the test's own uid, which is not ``daemon_uid``."""
    if os.getuid() == 0:
        os.chown(path, daemon_uid + 1, -1)


def test_socket_dir_owned_by_another_user_fails(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    cfg.daemon.socket.parent.mkdir(mode=0o700)
    daemon_uid = os.getuid() + 4242
    _owned_by_another(cfg.daemon.socket.parent, daemon_uid)
    c = env_fs.check_socket_dir(cfg, host(uid=lambda: daemon_uid))
    assert c.verdict is Verdict.FAIL and f"only root or uid {daemon_uid}" in c.detail
    assert "chown" not in c.fix and "chmod" not in c.fix and "daemon.socket" in c.fix


@pytest.mark.parametrize("daemon_uid", [os.getuid(), 65534 if os.getuid() != 65534 else 1])
def test_socket_in_sticky_tmp_is_accepted_as_the_start_accepts_it(
        tmp_path: Path, daemon_uid: int) -> None:
    """/tmp (root's, 1777): doctor warned 'chmod 0700 /tmp' to root and failed with
    'chown 65534 /tmp && chmod 0700 /tmp' for another uid; kvtier serve accepts it."""
    cfg = config(tmp_path)
    cfg.daemon.socket = Path(tempfile.gettempdir()) / f"kvtier-doctor-{os.getpid()}.sock"
    assert os.stat(cfg.daemon.socket.parent).st_mode & stat.S_ISVTX
    c = env_fs.check_socket_dir(cfg, host(uid=lambda: daemon_uid))
    assert c.verdict is Verdict.OK, c
    assert "sticky" in c.detail and c.fix == ""
    prepare_socket_dir(cfg.daemon.socket, default_dir=None)   # the start's own check


def test_a_sticky_dir_of_another_user_fails_without_a_chmod_fix(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    cfg = config(tmp_path)
    cfg.daemon.socket = shared / "kvtier.sock"
    daemon_uid = os.getuid() + 4242
    assert env_fs.check_socket_dir(cfg, host(uid=lambda: os.getuid())).verdict is Verdict.OK
    _owned_by_another(shared, daemon_uid)
    c = env_fs.check_socket_dir(cfg, host(uid=lambda: daemon_uid))
    assert c.verdict is Verdict.FAIL and "owned by uid" in c.detail
    assert "chmod" not in c.fix and "chown" not in c.fix


@pytest.mark.parametrize("mode", [0o700, 0o755, 0o775, 0o777, 0o1777, 0o1700])
def test_doctor_fails_the_socket_dir_exactly_when_the_start_refuses_it(
        tmp_path: Path, mode: int) -> None:
    """The start's own function (kvtier.socket_path.prepare_socket_dir) is the rule."""
    cfg = config(tmp_path)
    run = cfg.daemon.socket.parent
    run.mkdir()
    run.chmod(mode)
    try:
        prepare_socket_dir(cfg.daemon.socket, default_dir=None)
        start_ok = True
    except StartupError:
        start_ok = False
    c = env_fs.check_socket_dir(cfg, host())
    assert (c.verdict is not Verdict.FAIL) == start_ok, c


def test_default_socket_dir_must_be_private_as_the_start_requires(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    cfg = config(tmp_path)
    cfg.daemon.socket = default_runtime_dir() / "kvtier.sock"
    cfg.daemon.socket.parent.mkdir(mode=0o755)
    cfg.daemon.socket.parent.chmod(0o755)
    c = env_fs.check_socket_dir(cfg, host())
    assert c.verdict is Verdict.FAIL and "not 0700" in c.detail
    assert c.fix == f"chmod 0700 {cfg.daemon.socket.parent}"
    cfg.daemon.socket.parent.chmod(0o700)
    assert env_fs.check_socket_dir(cfg, host()).verdict is Verdict.OK


# -- memlock, huge pages, numa, gpu ----------------------------------------------------------
def test_memlock_below_the_arena_fails_only_with_a_gpu(tmp_path: Path) -> None:
    cfg = config(tmp_path, cpu="1GiB")
    low = (64 * 2**20, 64 * 2**20)
    c = env_host.check_memlock(cfg, host(memlock=lambda: low, gpu=lambda: (True, "1 GPU")))
    assert c.verdict is Verdict.FAIL and "LimitMEMLOCK=infinity" in c.fix
    assert env_host.check_memlock(cfg, host(memlock=lambda: low)).verdict is Verdict.OK
    inf = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    assert env_host.check_memlock(cfg, host(memlock=lambda: inf, gpu=lambda: (True, "x"))
                                  ).verdict is Verdict.OK


def test_huge_pages_off_warns() -> None:
    files = {f"{env_host.THP}/enabled": "always madvise [never]\n",
             f"{env_host.THP}/shmem_enabled": "always within_size advise [never] deny force\n"}
    c = env_host.check_thp(host(read_text=files.get))
    assert c.verdict is Verdict.WARN and "madvise" in c.fix
    files[f"{env_host.THP}/enabled"] = "always [madvise] never\n"
    assert env_host.check_thp(host(read_text=files.get)).verdict is Verdict.OK


def test_arena_spread_over_numa_nodes_warns() -> None:
    maps = ("7f00 bind:0 file=/dev/shm/kvtier-0-9-x.arena dirty=10 N0=300 N1=212\n"
            "7f10 default file=/usr/lib/libc.so N0=5\n")
    h = host(listdir=lambda p: ["node0", "node1", "possible"],
             read_text=lambda p: maps if p == "/proc/99/numa_maps" else None)
    c = env_host.check_numa(h, {"daemon": {"pid": 99}})
    assert c.verdict is Verdict.WARN and "N0=300, N1=212" in c.detail and "numactl" in c.fix
    one = maps.replace(" N1=212", "")
    h1 = dataclasses.replace(h, read_text=lambda p: one if p.endswith("numa_maps") else None)
    assert env_host.check_numa(h1, {"daemon": {"pid": 99}}).verdict is Verdict.OK
    assert env_host.check_numa(h, None).verdict is Verdict.WARN   # placement unknown


def test_gds_in_compat_mode_warns_and_dead_driver_fails(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    nv = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15\n"
    h = host(read_text=lambda p: nv if p == env_host.NV_PROC else None,
             gpu=lambda: (True, "8 CUDA device(s) visible"), kvikio_mode=lambda: "compat",
             exists=lambda p: False if p == env_host.GDS_PROC else os.path.exists(p))
    gpu, gds = env_host.check_gpu(cfg, h)
    assert gpu.verdict is Verdict.OK and "550.54.15" in gpu.detail
    assert gds.verdict is Verdict.WARN and "compat" in gds.detail and "nvidia-fs" in gds.fix
    dead = dataclasses.replace(h, gpu=lambda: (False, "cuInit failed: CUDA_ERROR_NO_DEVICE"))
    assert env_host.check_gpu(cfg, dead)[0].verdict is Verdict.FAIL
    ok = dataclasses.replace(h, kvikio_mode=lambda: "gds", exists=lambda p: True)
    assert env_host.check_gpu(cfg, ok)[1].verdict is Verdict.OK
    assert [c.verdict for c in env_host.check_gpu(cfg, host())] == [Verdict.SKIP]


# -- key scheme ------------------------------------------------------------------------------
def test_key_scheme_mismatch_fails() -> None:
    c = env_daemon.check_key_scheme(
        {"daemon": {"key_schemes": {KEY_SCHEME: 2, "sha256-chain/0": 1}}}, "")
    assert c.verdict is Verdict.FAIL and "sha256-chain/0" in c.detail
    old = env_daemon.check_key_scheme({"daemon": {"key_schemes": {"unknown": 1}}}, "")
    assert old.verdict is Verdict.WARN
    same = env_daemon.check_key_scheme({"daemon": {"key_schemes": {KEY_SCHEME: 3}}}, "")
    assert same.verdict is Verdict.OK
    assert env_daemon.check_key_scheme(None, "no daemon").verdict is Verdict.SKIP


# -- redis ----------------------------------------------------------------------------------
def redis_config(tmp_path: Path, url: str, **more: Any) -> Config:
    config(tmp_path)
    return load_config(tmp_path / "k.toml", env={},
                       overrides={"redis.enabled": True, "redis.url": url, **more})


def test_redis_without_a_password_warns(tmp_path: Path) -> None:
    c = env_redis.check_redis_auth(redis_config(tmp_path, "redis://127.0.0.1:6379/0"), host())
    assert c.verdict is Verdict.WARN and "127.0.0.1:6379" in c.detail
    assert "ACL SETUSER kvtier" in c.fix
    assert env_redis.check_redis_auth(config(tmp_path), host()).verdict is Verdict.SKIP


def test_redis_with_credentials_is_fine(tmp_path: Path) -> None:
    in_url = redis_config(tmp_path, "rediss://kvtier:s3cret@10.0.0.5:6380/0")
    c = env_redis.check_redis_auth(in_url, host())
    assert c.verdict is Verdict.OK and "'kvtier'" in c.detail and "TLS" in c.detail
    assert "s3cret" not in c.detail
    in_fields = redis_config(tmp_path, "redis://10.0.0.5:6379/0", **{"redis.password": "pw"})
    assert env_redis.check_redis_auth(in_fields, host()).verdict is Verdict.OK


def test_redis_unix_socket_open_to_others_warns(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    sock.touch()
    cfg = redis_config(tmp_path, f"unix://{sock}?db=0")
    os.chmod(sock, 0o777)
    c = env_redis.check_redis_auth(cfg, host())
    assert c.verdict is Verdict.WARN and "0777" in c.detail and "unixsocketperm" in c.fix
    os.chmod(sock, 0o700)
    assert env_redis.check_redis_auth(cfg, host()).verdict is Verdict.OK
    missing = redis_config(tmp_path, f"unix://{tmp_path / 'none.sock'}")
    assert env_redis.check_redis_auth(missing, host()).verdict is Verdict.WARN


# -- the whole run ---------------------------------------------------------------------------
def test_run_checks_exit_status_and_json(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    cfg = config(tmp_path, cpu="1MiB", nvme="1MiB", shm=tmp_path / "shm")
    h = host(statvfs=lambda p: (64 * 2**20, 1 * 2**20 // 2), mountinfo=lambda: OVERLAY,
             fetch_stats=lambda url: {"daemon": {"key_schemes": {KEY_SCHEME: 1}}})
    checks = run_checks(cfg, h, daemon_url="http://127.0.0.1:1")
    names = [c.name for c in checks]
    assert names == ["shm size", "data dir space", "data dir owner", "data dir filesystem",
                     "data dir O_DIRECT", "socket dir", "memlock", "huge pages", "numa", "gpu",
                     "key scheme", "redis server", "redis auth"]
    assert by_name(checks, "shm size").verdict is Verdict.FAIL
    assert exit_status(checks) == 1
    doc = to_json(checks, 1)
    assert doc["status"] == "findings" and doc["checks"][0]["verdict"] == "fail"
    assert all(c.fix for c in checks if c.verdict in (Verdict.FAIL, Verdict.WARN))
    calm = [Check("a", Verdict.OK, ""), Check("b", Verdict.WARN, "", "x")]
    assert (exit_status(calm), exit_status(calm, strict=True)) == (0, 1)


def test_a_data_dir_others_can_write_fails_as_the_daemon_would(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir(mode=0o700)
    checks = env_fs.check_data_dir(config(tmp_path, nvme="1MiB"), host())
    assert by_name(checks, "data dir owner").verdict is Verdict.OK
    nvme.chmod(0o777)
    owner = by_name(env_fs.check_data_dir(config(tmp_path, nvme="1MiB"), host()),
                    "data dir owner")
    assert owner.verdict is Verdict.FAIL and "writable by group and others" in owner.detail
    assert "chmod go-w" in owner.fix
