"""GPU presets: memory, HBM bandwidth and dense bf16 throughput from vendor datasheets.

Memory is in GiB as the datasheet's "80 GB" means (nvidia-smi reports MiB). Bandwidth
bounds decode (every step reads the weights and the KV of every running sequence);
FLOPs bound prefill. SXM variants where both exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.plan.errors import PlanError

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """One GPU model as the planner sees it."""

    name: str
    memory_bytes: int
    bandwidth_bytes_s: float
    bf16_flops: float  # dense, no sparsity


GPUS: dict[str, GPUSpec] = {
    "h100-80gb": GPUSpec("h100-80gb", 80 * GIB, 3.35e12, 989e12),
    "h200": GPUSpec("h200", 141 * GIB, 4.8e12, 989e12),
    "a100-80gb": GPUSpec("a100-80gb", 80 * GIB, 2.039e12, 312e12),
    "a100-40gb": GPUSpec("a100-40gb", 40 * GIB, 1.555e12, 312e12),
    "l40s": GPUSpec("l40s", 48 * GIB, 0.864e12, 362e12),
    "l4": GPUSpec("l4", 24 * GIB, 0.3e12, 121e12),
}


def find_gpu(name: str) -> GPUSpec:
    """The preset named ``name`` (case-insensitive); PlanError listing the known ones."""
    key = name.strip().lower()
    key = {"h100": "h100-80gb", "a100": "a100-80gb", "h200-141gb": "h200"}.get(key, key)
    try:
        return GPUS[key]
    except KeyError:
        raise PlanError(f"unknown GPU {name!r}; use one of {', '.join(GPUS)} "
                        "or give --gpu-mem-gb") from None
