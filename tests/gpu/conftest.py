"""GPU test gate: every test here is marked ``gpu`` and skipped, with the reason, when
torch cannot see a CUDA device or cupy is missing or sees no device."""

from __future__ import annotations

import pytest


def gpu_skip_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when they can (never raises)."""
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install
        return f"torch not importable: {exc}"
    try:
        if not torch.cuda.is_available():
            return f"torch {torch.__version__} sees no CUDA device"
    except Exception as exc:
        return f"torch.cuda failed: {exc}"
    try:
        import cupy

        if int(cupy.cuda.runtime.getDeviceCount()) <= 0:
            return "cupy sees no CUDA device"
    except Exception as exc:
        return f"cupy not usable: {exc}"
    return None


SKIP_REASON = gpu_skip_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark everything under tests/gpu as ``gpu`` and skip it when no GPU is usable."""
    for item in items:
        if "tests/gpu" not in str(item.path).replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.gpu)
        if SKIP_REASON is not None:
            item.add_marker(pytest.mark.skip(reason=f"no GPU: {SKIP_REASON}"))
