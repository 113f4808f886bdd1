"""GPU data-path bandwidth: kvtier kernels and transfers against the plain baseline.

Rows (each a ratio against the baseline next to it):

- gather / scatter (paged cache <-> contiguous device blocks) vs a device-to-device
  copy of the same bytes;
- gather straight into cudaHostRegister'd host memory (the arena, zero-copy) vs gather
  to device + cudaMemcpy D2H into pinned memory; H2D from registered memory vs from
  pinned memory;
- kvikio (GDS or its compat mode) read of a file into device memory vs POSIX read
  into host memory + H2D copy (page cache warm for both; say so when reading numbers);
- the vLLM connector's worker side (issue 11) against a real daemon: a save (gather on the
  save stream into the registered arena, put lease committed) vs a plain cudaMemcpyAsync
  D2H of the same bytes into pinned memory, and a layer-pipelined load (scatter on the
  load stream from the arena) vs a cudaMemcpyAsync H2D of the same bytes. The arena's
  cudaHostRegister time is printed too.

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
                view, done = host_np.data, 0
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


def connector_rows(n_blocks: int, repeat: int = 5) -> list[Row]:
    """The connector's worker side, timed by wall clock (what a step would wait for)."""
    import numpy as np
    import torch

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, repo)
    from kvtier.connectors.vllm.config import ConnectorConfig
    from kvtier.connectors.vllm.metadata import KVTierConnectorMetadata, TransferSpec
    from kvtier.connectors.vllm.worker import WorkerSide

    from kvtier.layout import KVLayout
    from tests.support.daemon import DaemonProcess

    layers, heads, dim, page, tpb = 32, 8, 128, 16, 256   # Llama-3-8B-like, fp16
    per_block = tpb // page
    num_pages = 2 * n_blocks * per_block + 1
    caches = {f"layers.{i}": torch.randn(2, num_pages, page, heads, dim, dtype=torch.float16,
                                         device="cuda") for i in range(layers)}
    layout = KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype="float16",
                      tokens_per_block=tpb)
    nbytes = n_blocks * layout.block_bytes
    arena = max(4 * GIB, 2 * (repeat + 1) * nbytes)
    work = tempfile.mkdtemp(prefix="kvtier-bench-connector-")
    daemon = DaemonProcess(__import__("pathlib").Path(work), cpu_bytes=str(arena),
                           nvme_bytes="0").start()
    try:
        cfg = ConnectorConfig.from_extra({"socket_path": str(daemon.socket),
                                          "tokens_per_block": tpb, "model_id": "bench",
                                          "max_inflight_save_bytes": 2 * nbytes},
                                         block_size=page, default_model_id="bench")
        w = WorkerSide(cfg, layout, page, 0, 1)
        w.register_kv_caches(caches)
        pages = [list(range(1 + j * per_block, 1 + (j + 1) * per_block))
                 for j in range(n_blocks)]
        dst = [[p + n_blocks * per_block for p in row] for row in pages]

        def tokens(i: int) -> np.ndarray:
            return np.random.default_rng(i).integers(1, 30000, n_blocks * tpb, dtype=np.uint32)

        def save(i: int) -> float:
            spec = TransferSpec(f"s{i}", None, tokens(i), 0, pages, save_id=i)
            t0 = time.perf_counter()
            w.save(KVTierConnectorMetadata(saves=[spec]))
            sending, _ = w.get_finished({spec.req_id})
            while spec.req_id not in sending:
                sending, _ = w.get_finished(set())
            return time.perf_counter() - t0

        def load(i: int) -> float:
            spec = TransferSpec(f"l{i}", None, tokens(i), 0, dst)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            w.start_load_kv(KVTierConnectorMetadata(loads=[spec]))
            for name in caches:
                w.wait_for_layer_load(name)
            errors = w.take_load_errors()
            torch.cuda.synchronize()
            assert not errors, f"load failed for {len(errors)} pages"
            return time.perf_counter() - t0

        save(0)
        load(0)   # warm-up: connections, registration, kernel compilation
        save_s = min(save(i) for i in range(1, repeat + 1))
        load_s = min(load(i) for i in range(1, repeat + 1))
        for reg in w.arenas.registrations.values():
            print(f"arena cudaHostRegister: {reg.nbytes / GIB:.2f} GiB in {reg.seconds:.3f} s "
                  f"({reg.seconds_per_8gib:.2f} s per 8 GiB, ok={reg.ok})")
        w.shutdown()
    finally:
        daemon.kill()
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    d2h = time_gpu(lambda: pinned.copy_(device, non_blocking=True), nbytes)
    h2d = time_gpu(lambda: device.copy_(pinned, non_blocking=True), nbytes)
    return [Row("connector save (gather -> arena, commit)", nbytes, nbytes / save_s / 1e9,
                "cudaMemcpyAsync D2H", d2h),
            Row("connector load (arena -> scatter, layers)", nbytes, nbytes / load_s / 1e9,
                "cudaMemcpyAsync H2D", h2d)]


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
    rows += connector_rows(args.blocks)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) | {"ratio": r.ratio} for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
