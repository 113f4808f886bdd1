"""deploy/ through real tools: `systemd-analyze verify` on the unit, and the Containerfile's
install step replayed without a container (a wheel built from exactly what it copies).

No base image can be pulled here, so the image itself is not built; what could break it
(a COPY list that misses a package, a pyproject that needs more files) is what the wheel
build checks.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "kvtier.service"
SYSTEMD_ANALYZE = "/usr/bin/systemd-analyze"


def verify(unit: Path) -> subprocess.CompletedProcess[str]:
    if not Path(SYSTEMD_ANALYZE).exists():
        pytest.skip("systemd-analyze is not installed here")
    return subprocess.run([SYSTEMD_ANALYZE, "verify", str(unit)], capture_output=True,
                          text=True, timeout=60)


def installed_unit(tmp_path: Path, text: str) -> Path:
    """The unit as installed: ExecStart* pointing at this checkout's kvtier executable."""
    kvtier = Path(sys.executable).parent / "kvtier"
    assert kvtier.exists(), "the test environment has no kvtier entry point"
    unit = tmp_path / "kvtier.service"
    unit.write_text(text.replace("/opt/kvtier/.venv/bin/kvtier", str(kvtier)))
    return unit


def test_systemd_unit_verifies_clean(tmp_path: Path) -> None:
    out = verify(installed_unit(tmp_path, UNIT.read_text()))
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


def test_systemd_verify_reports_a_misspelt_key(tmp_path: Path) -> None:
    bad = UNIT.read_text().replace("ProtectSystem=strict", "ProtectSystm=strict")
    out = verify(installed_unit(tmp_path, bad))
    assert "Unknown key" in out.stdout + out.stderr


def test_the_units_exec_lines_parse_as_kvtier_commands() -> None:
    from kvtier.cli import build_parser

    for line in UNIT.read_text().splitlines():
        m = re.match(r"^ExecStart(?:Pre)?=-?/opt/kvtier/\.venv/bin/kvtier (.*)$", line)
        if m:
            args = build_parser().parse_args(m.group(1).split())
            assert args.func is not None


def test_containerfile_copies_everything_the_install_needs(tmp_path: Path) -> None:
    text = (ROOT / "deploy" / "Containerfile").read_text()
    src = tmp_path / "src"
    src.mkdir()
    for line in text.splitlines():
        if not line.startswith("COPY "):
            continue
        *paths, dest = line.split()[1:]
        for p in paths:
            target = src / (Path(p).name if dest.endswith("/") else dest.removeprefix("/src/"))
            if (ROOT / p).is_dir():
                shutil.copytree(ROOT / p, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(ROOT / p, target)
    # as `pip install /src` in the image: an isolated build of the copied tree
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                          str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    wheel = next((tmp_path / "dist").glob("kvtier-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("kvtier/cli.py", "kvtier/daemon/service.py", "kvtier/explain.py",
                   "kvtier/doctor/env.py", "kvtier/connectors/vllm/__init__.py"):
        assert needed in names, needed
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kvtier = kvtier.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
