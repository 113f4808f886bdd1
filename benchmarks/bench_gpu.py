"""GPU data-path bandwidth: kvtier kernels and transfers against the plain baseline.

Rows (each a ratio against the baseline next to it):

- gather / scatter (paged cache <-> contiguous device blocks) vs a device-to-device
  copy of the same bytes;
- gather straight into cudaHostRegister'd host memory (the arena, zero-copy) vs gather
  to device + cudaMemcpy D2H into pinned memory; H2D from registered memory vs from
  pinned memory;
- kvikio (GDS or its compat mode) read of a file into device memory vs POSIX read
  into host memory + H2D copy (page cache warm for both; say so when reading numbers).

Usage: ``python benchmarks/bench_gpu.py [--blocks 16] [--json out.json]``. Exits 2
with a message when no GPU (torch CUDA + cupy) is available.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class Row:
    """One comparison: kvtier path vs baseline, both in GB/s over the same bytes."""

    name: str
    nbytes: int
    kvtier_gbps: float
    baseline_name: str
    baseline_gbps: float

    @property
    def ratio(self) -> float:
        return self.kvtier_gbps / self.baseline_gbps if self.baseline_gbps else float("nan")


def gpu_or_exit() -> None:
    """Exit 2 with the reason when torch CUDA or cupy cannot be used."""
    try:
        import cupy
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
        if cupy.cuda.runtime.getDeviceCount() <= 0:
            raise RuntimeError("cupy sees no CUDA device")
    except Exception as exc:
        print(f"bench_gpu: no GPU available ({exc}); nothing measured", file=sys.stderr)
        sys.exit(2)


def time_gpu(fn: Callable[[], object], nbytes: int, repeat: int = 10) -> float:
    """GB/s of ``fn`` timed with CUDA events on the current stream (after a warm-up)."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000 / repeat
    return nbytes / seconds / 1e9


def time_wall(fn: Callable[[], object], nbytes: int, repeat: int = 3) -> float:
    """GB/s of a host-side call by wall clock (fn must be synchronous)."""
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return nbytes * repeat / (time.perf_counter() - t0) / 1e9


def kernel_rows(n_blocks: int) -> list[Row]:
    """gather/scatter vs D2D; zero-copy into registered host memory vs D2H from pinned."""
    import cupy
    import numpy as np
    import torch
    from kvtier.kernels import PagedLayout, block_bytes, gather_blocks, scatter_blocks

    layers, heads, dim, page, tpb = 32, 8, 128, 16, 256  # Llama-3-8B-like, fp16
    per_block = tpb // page
    num_pages = n_blocks * per_block + 1
    caches = [torch.randn(2, num_pages, page, heads, dim, dtype=torch.float16, device="cuda")
              for _ in range(layers)]
    gen = torch.Generator().manual_seed(0)
    page_ids = (torch.randperm(num_pages - 1, generator=gen) + 1).view(n_blocks, per_block)
    nbytes_block = block_bytes(caches, PagedLayout.NHD, tpb)
    nbytes = n_blocks * nbytes_block
    out = torch.empty((n_blocks, nbytes_block), dtype=torch.uint8, device="cuda")
    src = torch.empty_like(out)
    rows = []

    d2d = time_gpu(lambda: src.copy_(out), nbytes)
    rows.append(Row("gather NHD->blocks (device)", nbytes,
                    time_gpu(lambda: gather_blocks(caches, PagedLayout.NHD, page_ids, out),
                             nbytes), "D2D copy", d2d))
    rows.append(Row("scatter blocks->NHD (device)", nbytes,
                    time_gpu(lambda: scatter_blocks(caches, PagedLayout.NHD, page_ids, out),
                             nbytes), "D2D copy", d2d))
    hnd = [c.transpose(2, 3).contiguous() for c in caches]
    rows.append(Row("gather HND->blocks (device)", nbytes,
                    time_gpu(lambda: gather_blocks(hnd, PagedLayout.HND, page_ids, out),
                             nbytes), "D2D copy", d2d))

    host = np.empty(nbytes, dtype=np.uint8)  # stands in for the shared-memory arena
    host[::4096] = 0  # fault the pages in before registering
    cupy.cuda.runtime.hostRegister(host.ctypes.data, host.nbytes, 0)
    try:
        registered = torch.from_numpy(host).view(n_blocks, nbytes_block)
        pinned = torch.empty((n_blocks, nbytes_block), dtype=torch.uint8).pin_memory()

        def gather_then_d2h() -> None:
            gather_blocks(caches, PagedLayout.NHD, page_ids, out)
            pinned.copy_(out, non_blocking=True)

        rows.append(Row("gather -> registered host (zero-copy)", nbytes,
                        time_gpu(lambda: gather_blocks(caches, PagedLayout.NHD, page_ids,
                                                       registered), nbytes),
                        "gather + D2H pinned", time_gpu(gather_then_d2h, nbytes)))
        rows.append(Row("D2H into registered host", nbytes,
                        time_gpu(lambda: registered.copy_(out, non_blocking=True), nbytes),
                        "D2H into pinned", time_gpu(lambda: pinned.copy_(out, non_blocking=True),
                                                    nbytes)))
        rows.append(Row("H2D from registered host", nbytes,
                        time_gpu(lambda: out.copy_(registered, non_blocking=True), nbytes),
                        "H2D from pinned", time_gpu(lambda: out.copy_(pinned, non_blocking=True),
                                                    nbytes)))
        rows.append(Row("scatter <- registered host (zero-copy)", nbytes,
                        time_gpu(lambda: scatter_blocks(caches, PagedLayout.NHD, page_ids,
                                                        registered), nbytes),
                        "H2D pinned + scatter",
                        time_gpu(lambda: (out.copy_(pinned, non_blocking=True),
                                          scatter_blocks(caches, PagedLayout.NHD, page_ids,
                                                         out)), nbytes)))
    finally:
        torch.cuda.synchronize()
        cupy.cuda.runtime.hostUnregister(host.ctypes.data)
    return rows


def file_rows(nbytes: int, directory: str) -> list[Row]:
    """kvikio read into device memory vs POSIX pread into host memory + H2D copy."""
    import numpy as np
    import torch

    try:
        import kvikio
    except Exception as exc:
        print(f"bench_gpu: kvikio not importable ({exc}); skipping file rows", file=sys.stderr)
        return []
    fd, path = tempfile.mkstemp(dir=directory, suffix=".kvtier-bench")
    try:
        with os.fdopen(fd, "wb") as f:
            chunk = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
            for _ in range(nbytes // chunk.nbytes):
                f.write(chunk.tobytes())
        size = os.path.getsize(path)
        dev = torch.empty(size, dtype=torch.uint8, device="cuda")
        host = torch.empty(size, dtype=torch.uint8).pin_memory()
        host_np = host.numpy()

        def posix_read() -> None:
            with open(path, "rb", buffering=0) as f:
                view, done = memoryview(host_np), 0
                while done < size:
                    done += f.readinto(view[done:])
            dev.copy_(host)
            torch.cuda.synchronize()

        def kvikio_read() -> None:
            with kvikio.CuFile(path, "r") as f:
                f.read(dev)
            torch.cuda.synchronize()

        mode = "compat" if _kvikio_compat(kvikio) else "GDS"
        return [Row(f"kvikio read -> device ({mode})", size, time_wall(kvikio_read, size),
                    "POSIX read + H2D", time_wall(posix_read, size))]
    finally:
        os.unlink(path)


def _kvikio_compat(kvikio: object) -> bool:
    """Whether kvikio will use its POSIX compat mode (API differs across versions)."""
    defaults = kvikio.defaults  # type: ignore[attr-defined]
    for name in ("is_compat_mode_preferred", "compat_mode"):
        fn = getattr(defaults, name, None)
        if fn is not None:
            return bool(fn())
    return True


def print_table(rows: list[Row]) -> None:
    """Side-by-side table: kvtier path, baseline, GB/s each, ratio."""
    print(f"{'kvtier path':42} {'GB/s':>8}  {'baseline':24} {'GB/s':>8}  {'ratio':>6}")
    for r in rows:
        print(f"{r.name:42} {r.kvtier_gbps:8.1f}  {r.baseline_name:24} "
              f"{r.baseline_gbps:8.1f}  {r.ratio:6.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvtier GPU data-path bandwidth")
    parser.add_argument("--blocks", type=int, default=16, help="kvtier blocks per call")
    parser.add_argument("--file-gib", type=float, default=1.0)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the file goes")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    gpu_or_exit()
    import torch

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    rows = kernel_rows(args.blocks)
    rows += file_rows(int(args.file_gib * GIB), args.dir)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) | {"ratio": r.ratio} for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
