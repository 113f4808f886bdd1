"""Other local users for trust tests, and running Python (kvtier included) as them.

The tests run as root in CI; a second uid is created with ``useradd`` (a system user with
no home and no shell) and reused across runs. Where that is impossible (not root, no
useradd) the caller skips with the reason. Python for another user: this interpreter when
that user may run it, else a system ``python3.X`` of the same minor version with this
checkout and our site-packages on PYTHONPATH (the pyenv under /root is not readable by
other users).
"""

from __future__ import annotations

import functools
import os
import pwd
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class OtherUser:
    name: str
    uid: int
    gid: int


def other_user(name: str) -> OtherUser:
    """The local user ``name``, created if missing; pytest.skip when it cannot be."""
    try:
        pw = pwd.getpwnam(name)
        return OtherUser(name, pw.pw_uid, pw.pw_gid)
    except KeyError:
        pass
    if os.geteuid() != 0:
        pytest.skip("needs root to create a second user (useradd) for this trust test")
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed: cannot create a second user")
    last = ""
    for _ in range(20):   # other test runs may hold the passwd lock for a moment
        p = subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                            "/usr/sbin/nologin", "--user-group", name],
                           capture_output=True, text=True)
        try:
            pw = pwd.getpwnam(name)
            return OtherUser(name, pw.pw_uid, pw.pw_gid)
        except KeyError:
            last = p.stderr.strip()
            time.sleep(0.25)
    pytest.skip(f"cannot create a second user {name!r} with useradd: {last}")


def _site_dirs() -> list[str]:
    return [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]


def user_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A clean environment for a process of another user that can import kvtier."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), *_site_dirs()])}
    env.update(extra or {})
    return env


@functools.cache
def python_for(name: str) -> str:
    """An interpreter that user ``name`` can run and that imports kvtier; skip if none."""
    minor = f"python3.{sys.version_info.minor}"
    candidates = [sys.executable, shutil.which(minor) or "", f"/usr/bin/{minor}",
                  f"/usr/local/bin/{minor}"]
    for exe in dict.fromkeys(c for c in candidates if c):
        try:
            p = subprocess.run([exe, "-c", "import kvtier.cli, numpy, msgpack, aiohttp"],
                               user=name, env=user_env(), cwd="/", capture_output=True,
                               timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if p.returncode == 0:
            return exe
    pytest.skip(f"no Python that user {name} may run imports kvtier (tried "
                f"{', '.join(c for c in candidates if c)})")


def private_dir_of(user: OtherUser, parent: Path, prefix: str, mode: int = 0o700) -> Path:
    """A fresh directory owned by ``user`` (mode ``mode``) under ``parent``."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chown(path, user.uid, user.gid)
    os.chmod(path, mode)
    return path
