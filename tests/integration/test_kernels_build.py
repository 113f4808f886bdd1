"""Every CUDA source compiles with nvcc (-arch=sm_90 -cubin): no GPU needed, only nvcc."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtier.kernels.build import compile_source, cuda_sources, find_nvcc, main

NVCC = find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH (no CUDA toolkit)")


def test_sources_are_shipped():
    names = {p.name for p in cuda_sources()}
    assert "gather_scatter.cu" in names


@needs_nvcc
@pytest.mark.parametrize("source", cuda_sources(), ids=lambda p: p.name)
def test_source_compiles_to_cubin(source: Path, tmp_path: Path):
    res = compile_source(source, tmp_path, "sm_90", NVCC or "nvcc")
    assert res.returncode == 0, res.stderr
    cubin = tmp_path / f"{source.stem}.cubin"
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF"
    for direction in ("gather", "scatter"):
        for vec in (16, 8, 4, 2, 1):
            assert f"kvtier_{direction}_v{vec}".encode() in data


@needs_nvcc
def test_syntax_error_fails_the_check(tmp_path: Path):
    bad = tmp_path / "bad.cu"
    bad.write_text("extern \"C\" __global__ void k(int* p) { p[0] = }\n")
    assert compile_source(bad, tmp_path, "sm_90", NVCC or "nvcc").returncode != 0


@needs_nvcc
def test_cli_reports_success(capsys):
    assert main(["--arch", "sm_90"]) == 0
    assert "ok   gather_scatter.cu" in capsys.readouterr().out
