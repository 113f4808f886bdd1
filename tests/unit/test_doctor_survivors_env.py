"""``kvtier doctor --env`` at the edges its existing tests do not reach: mount lookup by
path component, whose arenas count as already in /dev/shm, an nvme tier's own files as
room, ramfs as RAM, and --no-daemon turning a Redis not up yet into a warning."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.config import load_config
from kvtier.doctor import env_fs
from kvtier.doctor.env import Verdict, run_checks
from tests.unit.test_doctor_env import GiB, by_name, config, host

SHM_TMPFS = "30 22 0:26 / /dev/shm rw - tmpfs shm rw\n"


def test_mount_of_matches_whole_path_components_and_the_latest_overmount() -> None:
    """/dev/shmX is not under /dev/shm; of two mounts on one point the later one (which
    hides the other) is what a path is on."""
    text = ("22 1 0:21 / / rw - ext4 /dev/sda1 rw\n" + SHM_TMPFS
            + "40 30 0:30 / /dev/shm rw - ramfs none rw\n")
    other = env_fs.mount_of("/dev/shmX/a", text)
    assert other is not None and other.fstype == "ext4"
    under = env_fs.mount_of("/dev/shm/a", text)
    assert under is not None and under.fstype == "ramfs"


def test_only_this_user_s_arenas_count_as_room(tmp_path: Path) -> None:
    """Another user's daemon arena in /dev/shm is not space this daemon gets back: counting
    it passed a /dev/shm with no room for our tier."""
    shm = tmp_path / "shm"
    shm.mkdir()
    theirs = shm / f"kvtier-{os.getuid() + 1}-1-x.arena"
    theirs.write_bytes(b"")
    os.truncate(theirs, 800 * 2**20)
    cfg = config(tmp_path, cpu="1GiB", shm=shm)
    tmpfs = f"1 0 0:9 / {shm} rw - tmpfs tmpfs rw\n"
    tight = host(statvfs=lambda p: (2 * GiB, 500 * 2**20), mountinfo=lambda: tmpfs)
    c = env_fs.check_shm(cfg, tight)
    assert c.verdict is Verdict.FAIL and "not enough free" in c.detail


def test_shm_on_an_unknown_mount_is_not_warned_as_disk(tmp_path: Path) -> None:
    """No mount information (a minimal container): "?" is not "not memory"."""
    cfg = config(tmp_path, cpu="1MiB", shm=tmp_path)
    h = host(statvfs=lambda p: (10 * GiB, 10 * GiB), mountinfo=lambda: "")
    assert env_fs.check_shm(cfg, h).verdict is Verdict.OK


def test_nvme_tier_s_own_files_count_as_room(tmp_path: Path) -> None:
    """A running tier's files (1 GiB) plus free space (100 MiB) hold a 1 GiB tier: failing
    it told an operator to free space the tier already has."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    frames = nvme / "frames.dat"
    frames.write_bytes(b"")
    os.truncate(frames, GiB)
    h = host(statvfs=lambda p: (100 * GiB, 100 * 2**20), mountinfo=lambda: "")
    checks = env_fs.check_data_dir(config(tmp_path, nvme="1GiB"), h)
    space = by_name(checks, "data dir space")
    assert space.verdict is Verdict.OK and "already in the tier" in space.detail


def test_nvme_path_on_ramfs_warns(tmp_path: Path) -> None:
    """ramfs is RAM as tmpfs is: an "nvme" tier there counts twice against memory."""
    text = f"1 0 0:9 / {tmp_path} rw - ramfs none rw\n"
    h = host(statvfs=lambda p: (100 * GiB, 90 * GiB), mountinfo=lambda: text)
    fs = by_name(env_fs.check_data_dir(config(tmp_path), h), "data dir filesystem")
    assert fs.verdict is Verdict.WARN and "ramfs" in fs.detail


def test_no_daemon_run_only_warns_about_a_redis_not_up_yet(tmp_path: Path) -> None:
    """--no-daemon (no daemon_url) is the preflight before a start: a refused Redis is a
    WARN there (the tier connects later), a FAIL when the daemon is asked too."""
    cfg = load_config(None, env={}, overrides={
        "redis.enabled": True, "redis.url": "redis://127.0.0.1:1/0",
        "daemon.data_dir": str(tmp_path / "d"), "daemon.socket": str(tmp_path / "r" / "s")})

    def refused(addr: object, opts: object) -> None:
        raise ConnectionRefusedError(111, "Connection refused")

    def no_daemon(url: str) -> dict[str, object]:
        raise OSError("no daemon")

    h = host(redis_ping=refused, fetch_stats=no_daemon)
    assert by_name(run_checks(cfg, h), "redis server").verdict is Verdict.WARN
    asked = run_checks(cfg, h, daemon_url="http://127.0.0.1:1")
    assert by_name(asked, "redis server").verdict is Verdict.FAIL


def test_o_direct_is_not_probed_on_another_drive_s_data_dir(tmp_path: Path) -> None:
    """nvme.path elsewhere and not made yet: probing the data directory would test another
    file system than the tier's, so the check is skipped (and nothing is written)."""
    (tmp_path / "data").mkdir()
    probed: list[str] = []

    def probe(d: str) -> None:
        probed.append(d)

    h = host(o_direct=probe, statvfs=lambda p: (100 * GiB, 90 * GiB), mountinfo=lambda: "")
    cfg = config(tmp_path, nvme_path=tmp_path / "other" / "nvme")
    c = by_name(env_fs.check_data_dir(cfg, h), "data dir O_DIRECT")
    assert c.verdict is Verdict.SKIP and probed == []


def test_a_group_writable_socket_fails(tmp_path: Path) -> None:
    """The daemon makes its socket 0600: 0660 lets the group connect (and take blocks), so
    any group or other bit fails, not only the others' ones."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    sock = run / "s.sock"
    sock.write_bytes(b"")
    sock.chmod(0o660)
    c = env_fs.check_socket_dir(config(tmp_path), host())
    assert c.verdict is Verdict.FAIL and "socket mode 0660" in c.detail
    sock.chmod(0o600)
    assert env_fs.check_socket_dir(config(tmp_path), host()).verdict is Verdict.OK


def test_memlock_equal_to_the_tier_is_enough_and_hbm_needs_it(tmp_path: Path) -> None:
    """A limit of exactly cpu.bytes covers the arena; with the hbm tier configured the
    arena is pinned even when this doctor sees no GPU, so a low limit fails."""
    from dataclasses import replace

    from kvtier.doctor import env_host

    cfg = config(tmp_path, cpu="1GiB")
    gpu = host(memlock=lambda: (GiB, GiB), gpu=lambda: (True, "1 GPU"))
    assert env_host.check_memlock(cfg, gpu).verdict is Verdict.OK
    hbm = replace(cfg, hbm=replace(cfg.hbm, enabled=True))
    low = host(memlock=lambda: (2**20, 2**20))
    assert env_host.check_memlock(hbm, low).verdict is Verdict.FAIL


@pytest.mark.skipif(os.getuid() != 0, reason="root's own directory needs root")
def test_root_is_never_told_to_chmod_a_shared_socket_dir(tmp_path: Path) -> None:
    """A directory others can write, seen by root: the fix moves the socket (chmod-ing
    root's or a shared directory breaks others), even for a directory root owns."""
    fix = env_fs._socket_dir_fix(tmp_path, "is writable by others", 0)
    assert "chmod" not in fix and "daemon.socket" in fix


def test_one_numa_node_is_nothing_to_place() -> None:
    from kvtier.doctor import env_host

    c = env_host.check_numa(host(listdir=lambda p: ["node0", "possible"]), None)
    assert c.verdict is Verdict.OK and "1 NUMA node" in c.detail


def test_gds_mode_without_nvidia_fs_warns(tmp_path: Path) -> None:
    """kvikio saying "gds" while nvidia-fs is not loaded runs in compat mode: not OK."""
    from kvtier.doctor import env_host

    h = host(gpu=lambda: (True, "1 GPU"), kvikio_mode=lambda: "gds",
             exists=lambda p: False, read_text=lambda p: "NVRM version: 550\n")
    gds = [c for c in env_host.check_gpu(config(tmp_path), h) if c.name == "gds"]
    assert gds and gds[0].verdict is Verdict.WARN and "not loaded" in gds[0].detail


def test_kvikio_backend_that_cannot_load_fails(tmp_path: Path) -> None:
    """nvme.backend = kvikio with no kvikio: the tier cannot run as configured."""
    from kvtier.doctor import env_host

    cfg = config(tmp_path)
    cfg.nvme.backend = "kvikio"  # type: ignore[assignment]
    h = host(gpu=lambda: (True, "1 GPU"), read_text=lambda p: "NVRM version: 550\n")
    gds = [c for c in env_host.check_gpu(cfg, h) if c.name == "gds"]
    assert gds and gds[0].verdict is Verdict.FAIL


def test_numa_pages_of_several_arena_mappings_add_up() -> None:
    from kvtier.doctor import env_host

    maps = ("7f00 default file=/dev/shm/kvtier-0-9-x.arena N0=300\n"
            "7f80 default file=/dev/shm/kvtier-0-9-x.arena N0=200\n")
    h = host(listdir=lambda p: ["node0", "node1"], read_text=lambda p: maps)
    c = env_host.check_numa(h, {"daemon": {"pid": 9}})
    assert c.verdict is Verdict.OK and "N0=500" in c.detail


def test_key_schemes_with_counts_that_are_not_numbers_warn() -> None:
    from kvtier.doctor import env_daemon

    c = env_daemon.check_key_scheme({"daemon": {"key_schemes": {"x": "2"}}}, "")
    assert c.verdict is Verdict.WARN and "unknown form" in c.detail


def test_redis_preflight_fails_unless_every_failure_is_not_up_yet(tmp_path: Path) -> None:
    """--no-daemon: refused is "not up yet" (WARN), a permission error (EACCES) or a
    timeout says something listens or the settings are wrong: FAIL, even beside a refusal."""
    import errno

    from kvtier.doctor import env_redis

    cfg = load_config(None, env={}, overrides={
        "redis.enabled": True, "redis.url": "redis+cluster://127.0.0.1:1,127.0.0.1:2/0",
        "daemon.data_dir": str(tmp_path / "d"), "daemon.socket": str(tmp_path / "r" / "s")})
    errors = [ConnectionRefusedError(errno.ECONNREFUSED, "refused"), TimeoutError("timed out")]

    def ping(addr: object, opts: object) -> None:
        raise errors.pop(0) if errors else ConnectionRefusedError(errno.ECONNREFUSED, "x")

    c = env_redis.check_redis_server(cfg, host(redis_ping=ping), before_start=True)
    assert c.verdict is Verdict.FAIL
    assert not env_redis._not_up_yet(OSError(errno.EACCES, "denied"))
    assert env_redis._not_up_yet(OSError(errno.EHOSTUNREACH, "no route"))


def test_redis_unix_socket_writable_by_its_group_warns(tmp_path: Path) -> None:
    from kvtier.doctor import env_redis

    sock = tmp_path / "redis.sock"
    sock.write_bytes(b"")
    sock.chmod(0o660)
    cfg = load_config(None, env={}, overrides={
        "redis.enabled": True, "redis.url": f"unix://{sock}",
        "daemon.data_dir": str(tmp_path / "d"), "daemon.socket": str(tmp_path / "r" / "s")})
    assert env_redis.check_redis_auth(cfg, host()).verdict is Verdict.WARN
    sock.chmod(0o600)
    assert env_redis.check_redis_auth(cfg, host()).verdict is Verdict.OK
