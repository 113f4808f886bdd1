"""Run mypy on kvtier with the package names the installed package has.

``connectors/`` and ``kernels/`` are published as ``kvtier.connectors`` and
``kvtier.kernels`` through setuptools' ``package-dir``. mypy derives a module's name from
its directory and cannot follow the editable install's import hook, so ``mypy connectors``
checks a top-level ``connectors`` and every ``from kvtier.kernels ...`` import is "not
found". This driver takes mypy's own command line (``[tool.mypy]`` in pyproject.toml
applies as usual), renames the sources found under a ``package-dir`` folder to their
package name, and runs mypy's build on them, so errors keep their real file paths.

Usage: ``python scripts/typecheck.py kvtier connectors kernels`` (any mypy flags work).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from mypy import util
from mypy.fscache import FileSystemCache
from mypy.main import process_options, run_build
from mypy.modulefinder import BuildSource

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def package_dirs(pyproject: Path) -> dict[str, str]:
    """Top-level folder -> package name, from ``[tool.setuptools] package-dir``."""
    with pyproject.open("rb") as f:
        mapping: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {folder: package for package, folder in mapping.items() if folder != package}


def renamed(sources: list[BuildSource], folders: dict[str, str]) -> list[BuildSource]:
    """Sources whose module name starts with a mapped folder get the package's name."""
    out = []
    for src in sources:
        head, _, rest = src.module.partition(".")
        if head in folders:
            module = folders[head] + (f".{rest}" if rest else "")
            src = BuildSource(src.path, module, src.text, src.base_dir, src.followed)
        out.append(src)
    return out


def main(argv: list[str]) -> int:
    t0 = time.time()
    fscache = FileSystemCache()
    sources, options = process_options(argv, fscache=fscache)
    sources = renamed(sources, package_dirs(ROOT / "pyproject.toml"))
    _, messages, blockers = run_build(sources, options, fscache, t0, sys.stdout, sys.stderr)
    formatter = util.FancyFormatter(sys.stdout, sys.stderr, options.hide_error_codes)
    n_errors, _, n_files = util.count_stats(messages)
    if n_errors:
        print(formatter.format_error(n_errors, n_files, len(sources), blockers=blockers))
        return 2 if blockers else 1
    print(formatter.format_success(len(sources)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
