"""scripts/typecheck.py checks connectors/ and kernels/ under their installed names."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("typecheck_script",
                                                  ROOT / "scripts" / "typecheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_folders_come_from_setuptools_package_dir() -> None:
    folders = _script().package_dirs(ROOT / "pyproject.toml")
    assert folders == {"connectors": "kvtier.connectors", "kernels": "kvtier.kernels"}


def test_sources_under_a_mapped_folder_get_the_package_name() -> None:
    script = _script()
    sources = [
        BuildSource("connectors/__init__.py", "connectors", base_dir="."),
        BuildSource("connectors/vllm/link.py", "connectors.vllm.link", base_dir="."),
        BuildSource("kernels/api.py", "kernels.api", base_dir="."),
        BuildSource("kvtier/codec.py", "kvtier.codec", base_dir="."),
        BuildSource("connectorsx/a.py", "connectorsx.a", base_dir="."),
    ]
    out = script.renamed(sources, {"connectors": "kvtier.connectors",
                                   "kernels": "kvtier.kernels"})
    assert [s.module for s in out] == [
        "kvtier.connectors", "kvtier.connectors.vllm.link", "kvtier.kernels.api",
        "kvtier.codec", "connectorsx.a",
    ]
    assert [s.path for s in out] == [s.path for s in sources]   # errors keep real paths
