"""Compile every CUDA source in this package with nvcc, to catch errors without a GPU.

``python -m kvtier.kernels.build [--arch sm_90] [--out DIR]`` runs
``nvcc -arch=<arch> -cubin`` on each ``*.cu`` here and exits non-zero on the first
failure. CI runs it (``make kernels-check``) so a syntax error fails the build even on
machines that never run a kernel; at runtime the same sources are compiled by NVRTC
through cupy instead.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
DEFAULT_ARCH = "sm_90"


def cuda_sources() -> list[Path]:
    """All ``.cu`` files shipped with the package, sorted by name."""
    return sorted(KERNEL_DIR.glob("*.cu"))


def find_nvcc() -> str | None:
    """Path of nvcc on PATH, or None when the CUDA toolkit is absent."""
    return shutil.which("nvcc")


def compile_source(source: Path, out_dir: Path, arch: str = DEFAULT_ARCH,
                   nvcc: str = "nvcc") -> subprocess.CompletedProcess[str]:
    """Compile one source to ``<out_dir>/<name>.cubin``; returns nvcc's result."""
    target = out_dir / f"{source.stem}.cubin"
    cmd = [nvcc, f"-arch={arch}", "-cubin", "-std=c++17", "-Werror", "all-warnings",
           "-o", str(target), str(source)]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def main(argv: list[str] | None = None) -> int:
    """Compile all sources; print one line per file; 0 when all compiled."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=DEFAULT_ARCH)
    parser.add_argument("--out", type=Path, default=None, help="keep cubins here")
    args = parser.parse_args(argv)
    nvcc = find_nvcc()
    if nvcc is None:
        print("nvcc not found on PATH: install the CUDA toolkit to check kernels",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.out or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        failed = 0
        for source in cuda_sources():
            res = compile_source(source, out_dir, args.arch, nvcc)
            print(f"{'ok  ' if res.returncode == 0 else 'FAIL'} {source.name} ({args.arch})")
            if res.returncode != 0:
                failed += 1
                print(res.stderr, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
