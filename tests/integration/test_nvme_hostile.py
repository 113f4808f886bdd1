"""A real daemon against hostile or odd nvme directories (issue: nvme audit).

Another local user must not get KV served from frames they planted, nor a file of theirs
truncated through a symlink: the data and nvme directories and every slot file must be ours
alone, else the start is refused with one line naming the path and the fix. Two daemons on
one nvme directory are refused too. Blocks dropped for good stay dropped across restarts,
a lowered ``nvme.bytes`` keeps chain heads, and a frame kvtier never writes (encoded, or
shorter than its block) is a counted miss, never bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import connect
from kvtier.frame import Codec, make_header
from kvtier.keys import Namespace, block_keys
from tests.support.chains import LAYOUT, content
from tests.support.daemon import DaemonProcess
from tests.support.serve import one_line_error, run_serve, serving

WAIT = {"KVTIER_POLICY_PREFETCH_WAIT": "wait"}   # a get waits for nvme -> cpu
SLOT_FILE = f"slots-{LAYOUT.block_bytes}.dat"      # the size class of LAYOUT's blocks
PAGE = 4096


def chain(ns: object, n: int, first: int = 0) -> list[bytes]:
    tokens = np.arange(first, first + LAYOUT.tokens_per_block * n)
    return [bytes(k) for k in block_keys(ns, tokens)]   # type: ignore[arg-type]


def get(d: DaemonProcess, keys: list[bytes]) -> tuple[int, list[int]]:
    """Blocks a get returns for ``keys`` and the indices among them with wrong bytes."""
    with connect(d.socket) as c:
        ns = c.register_layout(LAYOUT, "m")
        outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
        n = c.get(ns, keys, outs)
    return n, [i for i in range(n) if not np.array_equal(outs[i], content(keys[i]))]


def put(d: DaemonProcess, keys: list[bytes]) -> int:
    with connect(d.socket) as c:
        ns = c.register_layout(LAYOUT, "m")
        return c.put(ns, keys, [content(k) for k in keys], durable=True)


def frame_page_and_payload(payload: bytes, **header: object) -> bytes:
    """A slot as the nvme tier writes it, for the first block of namespace ``m``."""
    ns = Namespace("m", LAYOUT)
    h = make_header(ns.digest, chain(ns, 1)[0], LAYOUT.fingerprint, payload, seq=1,
                    chain=(None,), **header)   # type: ignore[arg-type]
    return h.pack().ljust(PAGE, b"\0") + payload


def serve_args(root: Path, *extra: str) -> list[str]:
    return ["--data-dir", str(root / "data"), "--socket", str(root / "kvtier.sock"),
            "--http-port", "0", "--cpu-bytes", "8MiB", "--nvme-bytes", "8MiB", *extra]


# -- slot files: ours alone, never followed ---------------------------------------------------
def _symlink(slot: Path, victim: Path) -> None:
    slot.symlink_to(victim)


def _world_writable(slot: Path, victim: Path) -> None:
    slot.write_bytes(frame_page_and_payload(b"A" * LAYOUT.block_bytes))
    os.chmod(slot, 0o666)


def _other_users(slot: Path, victim: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another uid")
    slot.write_bytes(frame_page_and_payload(b"A" * LAYOUT.block_bytes))
    os.chmod(slot, 0o600)
    os.chown(slot, 65534, 65534)


def _hard_link(slot: Path, victim: Path) -> None:
    os.chmod(victim, 0o600)
    os.link(victim, slot)


def _directory(slot: Path, victim: Path) -> None:
    slot.mkdir()


def _fifo(slot: Path, victim: Path) -> None:
    os.mkfifo(slot, 0o600)


@pytest.mark.parametrize(("plant", "problem"), [
    pytest.param(_symlink, "is a symbolic link", id="symlink"),
    pytest.param(_world_writable, "is writable by group and others (mode 0666)", id="0666"),
    pytest.param(_other_users, "is owned by uid 65534", id="other-uid"),
    pytest.param(_hard_link, "has 2 hard links", id="hard-link"),
    pytest.param(_directory, "is not a regular file", id="directory"),
    pytest.param(_fifo, "is not a regular file", id="fifo"),
])
def test_slot_file_that_is_not_ours_alone_is_refused(
        tmp_path: Path, plant: Callable[[Path, Path], None], problem: str) -> None:
    """Opened with O_NOFOLLOW and checked on the descriptor before a byte is read, written
    or truncated: the symlink's target keeps every byte."""
    nvme = tmp_path / "data" / "nvme"
    nvme.mkdir(parents=True, mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious data that is not a kvtier frame\n" * 100)
    slot = nvme / SLOT_FILE
    plant(slot, victim)
    line = one_line_error(run_serve(serve_args(tmp_path), timeout=30))
    assert f"nvme slot file {slot} {problem}" in line
    assert f"rm {slot}" in line and "--nvme-path" in line
    assert victim.read_bytes() == b"precious data that is not a kvtier frame\n" * 100


# -- data and nvme directories: ours alone ----------------------------------------------------
def test_world_writable_dirs_with_a_planted_frame_are_refused(tmp_path: Path) -> None:
    """The audit's case: 0777 data and nvme directories, a 0666 slot file holding a frame
    for a key anyone can compute. The data directory is named (the first on the way)."""
    data = tmp_path / "data"
    nvme = data / "nvme"
    nvme.mkdir(parents=True)
    (nvme / SLOT_FILE).write_bytes(frame_page_and_payload(b"A" * LAYOUT.block_bytes))
    for p, mode in ((data, 0o777), (nvme, 0o777), (nvme / SLOT_FILE, 0o666)):
        os.chmod(p, mode)
    line = one_line_error(run_serve(serve_args(tmp_path), timeout=30))
    assert (f"data directory {data} is not safe: {data} is writable by group and others "
            "(mode 0777)") in line
    assert f"chmod go-w {data}" in line and "--data-dir" in line


@pytest.mark.parametrize(("mode", "problem"), [
    pytest.param(0o777, "is writable by group and others (mode 0777)", id="0777"),
    pytest.param(0o770, "is writable by its group (mode 0770)", id="0770"),
    pytest.param(0o1777, "is writable by group and others (mode 1777)", id="sticky"),
])
def test_nvme_dir_others_can_write_is_refused(tmp_path: Path, mode: int, problem: str) -> None:
    """The sticky bit does not help the nvme directory itself: others could still add slot
    files (or the lock) in it."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    os.chmod(nvme, mode)
    line = one_line_error(run_serve(serve_args(tmp_path, "--nvme-path", str(nvme)),
                                    timeout=30))
    assert f"nvme directory {nvme} is not safe: {nvme} {problem}" in line
    assert f"chmod go-w {nvme}" in line and "--nvme-path" in line


def test_nvme_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    nvme = tmp_path / "nvme"
    nvme.mkdir(mode=0o700)
    os.chown(nvme, 65534, 65534)
    line = one_line_error(run_serve(serve_args(tmp_path, "--nvme-path", str(nvme)),
                                    timeout=30))
    assert f"nvme directory {nvme} is not safe: {nvme} is owned by uid 65534" in line


def test_a_sticky_parent_like_tmp_is_accepted(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with serving(serve_args(shared)) as (_proc, socket_path), connect(socket_path) as c:
        c.ping()
    assert (shared / "data").stat().st_mode & 0o777 == 0o700


# -- one daemon per nvme directory ------------------------------------------------------------
def test_a_second_daemon_on_the_same_nvme_path_is_refused(tmp_path: Path) -> None:
    nvme = tmp_path / "shared-nvme"
    first = DaemonProcess(tmp_path / "a", cpu_bytes="8MiB", nvme_bytes="8MiB",
                          extra_args=["--nvme-path", str(nvme)])
    try:
        first.start()
        assert first.proc is not None
        refused = run_serve(serve_args(tmp_path / "b", "--nvme-path", str(nvme)), timeout=30)
        line = one_line_error(refused)
        assert "drain" not in refused.stderr   # it never served: nothing to drain or log
        assert (f"nvme directory {nvme} is in use by another kvtier daemon (pid "
                f"{first.proc.pid} holds the lock {nvme / 'kvtier.lock'})") in line
        assert "--nvme-path" in line
        first.kill()     # SIGKILL: the kernel drops the lock with the process
        with serving(serve_args(tmp_path / "b", "--nvme-path", str(nvme))) as (_p, sock), \
                connect(sock) as c:
            c.ping()
    finally:
        first.kill()


# -- dropped for good stays dropped; a lowered capacity keeps heads ---------------------------
def test_a_deleted_block_does_not_come_back_after_a_restart(tmp_path: Path) -> None:
    """Deleting H orphans X (its frame was kept on disk, unerased); H and X are stored again
    (in other slots: A's delete freed a lower one) and X deleted: after a restart the
    orphan's old frame came back under H."""
    d = DaemonProcess(tmp_path / "kvd", cpu_bytes="8MiB", nvme_bytes="64MiB", env=WAIT)
    try:
        d.start()
        with connect(d.socket) as c:
            ns = c.register_layout(LAYOUT, "m")
            a = chain(ns, 1, first=10**7)
            h, x = chain(ns, 2)
            assert put(d, a) == 1 and put(d, [h, x]) == 2     # nvme slots 0, 1, 2
            assert c.delete(ns, a) == 1
            assert c.delete(ns, [h]) == 1                      # X, in slot 2, is an orphan
            assert c.lookup(ns, [h, x], prefetch=False).hits == 0
            assert put(d, [h, x]) == 2
            assert c.delete(ns, [x]) == 1
            assert c.lookup(ns, [h, x], prefetch=False).hits == 1
        d.crash()
        d.start()
        with connect(d.socket) as c:
            ns = c.register_layout(LAYOUT, "m")
            assert c.lookup(ns, [h, x], prefetch=False).hits == 1
        assert get(d, [h]) == (1, [])
    finally:
        d.kill()


def test_lower_nvme_bytes_keeps_the_chain_prefix(tmp_path: Path) -> None:
    """8 MiB -> 2 MiB: the start kept the newest frames, the chain's tail, all orphans; now
    it keeps the prefix that fits and cuts the file to the capacity."""
    d = DaemonProcess(tmp_path / "kvd", cpu_bytes="8MiB", nvme_bytes="8MiB", env=WAIT)
    try:
        d.start()
        with connect(d.socket) as c:
            keys = chain(c.register_layout(LAYOUT, "m"), 100)
        assert put(d, keys) == 100
        d.kill()
        d.nvme_bytes = "2MiB"
        d.start()
        nvme = d.stats()["tiers"]["nvme"]
        fits = 2 * 2**20 // (PAGE + LAYOUT.block_bytes)
        assert nvme["blocks"] == fits and nvme["used_bytes"] <= 2 * 2**20
        assert (d.data_dir / "nvme" / SLOT_FILE).stat().st_size <= 2 * 2**20
        assert get(d, keys) == (fits, [])
    finally:
        d.kill()


# -- frames kvtier never writes ----------------------------------------------------------------
@pytest.mark.parametrize("header", [
    pytest.param({"codec": Codec.LZ4}, id="encoded"),
    pytest.param({"raw_len": LAYOUT.block_bytes}, id="short"),
])
def test_a_frame_kvtier_never_writes_is_a_counted_miss(tmp_path: Path,
                                                        header: dict[str, object]) -> None:
    """A valid frame with a codec, or a payload shorter than its block: promoting it put
    encoded or partial bytes in the arena and served them as the block."""
    d = DaemonProcess(tmp_path / "kvd", cpu_bytes="8MiB", nvme_bytes="8MiB", env=WAIT)
    nvme = d.data_dir / "nvme"
    nvme.mkdir(parents=True, mode=0o700)
    os.chmod(d.data_dir, 0o700)
    body = b"A" * (LAYOUT.block_bytes if "codec" in header else 100)
    (nvme / SLOT_FILE).write_bytes(frame_page_and_payload(body, **header))
    os.chmod(nvme / SLOT_FILE, 0o600)
    try:
        d.start()
        key = chain(Namespace("m", LAYOUT), 1)
        assert get(d, key)[0] == 0
        assert d.stats()["tiers"]["nvme"]["checksum_failures"] >= 1
    finally:
        d.kill()
