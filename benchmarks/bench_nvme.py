"""NVMe tier throughput vs plain os.pwrite/os.pread of the same bytes, side by side.

Both sides write and read the same frames (a 4 KiB header page + the payload per slot, at
the same offsets) with the same open flags (the tier's O_DIRECT choice), from the same
page-aligned buffers, on the same file system, at the same concurrency (1, and the tier's
io_threads). The tier side goes through ``NvmeTier.write``/``read_into`` from an asyncio loop
(thread pool hop, payload checksum verification on read); the plain side calls the OS from
threads directly: one os.pwrite/os.preadv of the whole frame per request, at the same queue
depth. The tier may split a frame internally (a lone read is issued as several concurrent
page-aligned pieces, see kvtier.tiers.nvme.split); the baseline never does, so the ratio compares
the tier's whole path with the simplest honest use of the same syscalls. Rounds alternate
which side runs first; the median round is reported.

Usage: python benchmarks/bench_nvme.py [--root DIR] [--n 64] [--rounds 3] [--json]
The root must be on the disk you want to measure (not tmpfs); the default is /var/tmp.
Importable: ``run_nvme_bench(root)`` returns the rows as dicts (for ``kvtier bench``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from kvtier.frame import HEADER_SIZE, make_header
from kvtier.tiers.aligned import PAGE, aligned_buffer
from kvtier.tiers.nvme import NvmeSlot, NvmeTier

NS = b"bench-namespace!"
LAYOUT_FP = 0xBE7C4
T = TypeVar("T")


def fs_type(path: Path) -> str:
    """The file system type of ``path`` from /proc/self/mounts ("?" when unknown)."""
    best, kind = "", "?"
    target = str(path.resolve())
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                _dev, mnt, typ, *_ = line.split()
                if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and (
                        len(mnt) > len(best)):
                    best, kind = mnt, typ
    except OSError:
        pass
    return kind


def _sources(size: int, count: int) -> list[memoryview]:
    """``count`` aligned arena-like slots of random bytes (reused round-robin)."""
    out = []
    for _ in range(count):
        buf = aligned_buffer(size)
        buf[:] = os.urandom(size)
        out.append(buf)
    return out


async def _tier_round(root: Path, size: int, n: int, qd: int, io_threads: int, direct: str,
                      srcs: list[memoryview]) -> tuple[float, float, str]:
    """Seconds to write then read ``n`` frames through NvmeTier at ``qd`` in flight."""
    tier = NvmeTier(root, n * (PAGE + size), direct=direct, io_threads=io_threads)
    tier.open()
    headers = [make_header(NS, i.to_bytes(16, "little"), LAYOUT_FP, srcs[i % len(srcs)],
                           seq=i + 1) for i in range(n)]
    slots: list[NvmeSlot] = []
    for _ in range(n):
        slot = tier.alloc(size)
        assert slot is not None
        slots.append(slot)
    outs: asyncio.Queue[memoryview] = asyncio.Queue()
    for _ in range(qd):
        outs.put_nowait(aligned_buffer(size))
    gate = asyncio.Semaphore(qd)

    async def put(i: int) -> None:
        async with gate:
            await tier.write(slots[i], headers[i], srcs[i % len(srcs)])

    async def get(i: int) -> None:
        out = await outs.get()
        try:
            await tier.read_into(slots[i], out, namespace=NS, key=headers[i].key,
                                 layout_fp=LAYOUT_FP)
        finally:
            outs.put_nowait(out)

    t0 = time.perf_counter()
    await asyncio.gather(*(put(i) for i in range(n)))
    t1 = time.perf_counter()
    await asyncio.gather(*(get(i) for i in range(n)))
    t2 = time.perf_counter()
    backend = tier.backend
    assert tier.counters.checksum_failures == 0
    tier.close()
    return t1 - t0, t2 - t1, backend


def _plain_round(path: Path, size: int, n: int, qd: int, direct: bool,
                 srcs: list[memoryview]) -> tuple[float, float]:
    """Seconds to os.pwrite then os.pread the same frames with the same flags."""
    stride = PAGE + size
    frames = []
    for i, src in enumerate(srcs):   # header page + payload, contiguous and aligned
        frame = aligned_buffer(stride)
        frame[:HEADER_SIZE] = make_header(NS, i.to_bytes(16, "little"), LAYOUT_FP, src).pack()
        frame[PAGE:] = src
        frames.append(frame)
    outs = [aligned_buffer(stride) for _ in range(qd)]
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        def write(i: int) -> None:
            if os.pwrite(fd, frames[i % len(frames)], i * stride) != stride:
                raise OSError("short write")

        def read(i: int) -> None:
            if os.preadv(fd, [outs[i % qd]], i * stride) != stride:
                raise OSError("short read")

        def timed(fn: Callable[[int], None]) -> float:
            t0 = time.perf_counter()
            if qd == 1:
                for i in range(n):
                    fn(i)
            else:   # i % qd strided work keeps each out buffer on one thread
                def worker(w: int) -> None:
                    for i in range(w, n, qd):
                        fn(i)

                with ThreadPoolExecutor(qd) as pool:
                    for _ in pool.map(worker, range(qd)):   # (re-raises a worker's error)
                        pass
            return time.perf_counter() - t0

        return timed(write), timed(read)
    finally:
        os.close(fd)


def _event_loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def _run_async(coro: Coroutine[object, object, T]) -> T:
    """Run on the loop the daemon uses: uvloop when installed, else asyncio's default."""
    if _event_loop_name() == "uvloop":
        import uvloop
        return uvloop.run(coro)
    return asyncio.run(coro)


def _measure(work: Path, size: int, n: int, qd: int, rounds: int, io_threads: int,
             direct: str, use_direct: bool, srcs: list[memoryview]) -> dict[str, list[float]]:
    """Per-round seconds: tier write/read (tw, tr) and plain write/read (pw, pr)."""
    times: dict[str, list[float]] = {k: [] for k in ("tw", "tr", "pw", "pr")}
    for r in range(rounds):
        for side in ("plain", "tier") if r % 2 else ("tier", "plain"):
            if side == "tier":
                d = work / f"tier-{r}"
                tw, tr, _ = _run_async(_tier_round(d, size, n, qd, io_threads, direct, srcs))
                times["tw"].append(tw)
                times["tr"].append(tr)
                shutil.rmtree(d)
            else:
                p = work / f"plain-{r}.dat"
                pw, pr = _plain_round(p, size, n, qd, use_direct, srcs)
                times["pw"].append(pw)
                times["pr"].append(pr)
                p.unlink()
    return times


def run_nvme_bench(root: Path, sizes: Sequence[int] = (1 << 20, 4 << 20), n: int = 64, *,
                   rounds: int = 3, io_threads: int = 4, direct: str = "auto",
                   ) -> list[dict[str, object]]:
    """Measure tier vs plain write/read MB/s per size and queue depth; one dict per row.

    Keys: op, size, qd, tier_mb_s, plain_mb_s, ratio, backend, fs, loop. MB/s count payload bytes
    (10**6 per MB); the ratio is tier / plain (target >= 0.7).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-nvme-", dir=root))
    fs = fs_type(work)
    rows: list[dict[str, object]] = []
    try:
        probe = NvmeTier(work / "probe", 0, direct=direct)
        probe.open()
        backend = probe.backend
        probe.close()
        shutil.rmtree(work / "probe")
        for size in sizes:
            srcs = _sources(size, min(n, 8))
            for qd in sorted({1, io_threads}):
                times = _measure(work, size, n, qd, rounds, io_threads, direct,
                                 backend == "posix+odirect", srcs)
                mb = size * n / 1e6
                for op, tk, pk in (("write", "tw", "pw"), ("read", "tr", "pr")):
                    tier_mb_s = mb / statistics.median(times[tk])
                    plain_mb_s = mb / statistics.median(times[pk])
                    rows.append({"op": op, "size": size, "qd": qd,
                                 "tier_mb_s": round(tier_mb_s, 1),
                                 "plain_mb_s": round(plain_mb_s, 1),
                                 "ratio": round(tier_mb_s / plain_mb_s, 3),
                                 "backend": backend, "fs": fs,
                                 "loop": _event_loop_name()})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def format_table(rows: Sequence[dict[str, object]]) -> str:
    """The rows as an aligned text table."""
    lines = [f"{'op':<6} {'size':>7} {'qd':>3} {'tier MB/s':>10} {'plain MB/s':>11} "
             f"{'ratio':>6}"]
    for row in rows:
        size = int(row["size"])  # type: ignore[call-overload]
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        lines.append(f"{row['op']:<6} {label:>7} {row['qd']:>3} {row['tier_mb_s']:>10} "
                     f"{row['plain_mb_s']:>11} {row['ratio']:>6}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/var/tmp"))
    parser.add_argument("--n", type=int, default=64, help="frames per size and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--direct", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--sizes", default="1048576,4194304", help="payload sizes in bytes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if fs_type(args.root) in ("tmpfs", "ramfs"):
        print(f"warning: {args.root} is {fs_type(args.root)}, not a disk", file=sys.stderr)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = run_nvme_bench(args.root, sizes, args.n, rounds=args.rounds,
                          io_threads=args.io_threads, direct=args.direct)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    first = rows[0]
    print(f"nvme tier vs os.pwrite/os.pread, same bytes and flags: backend {first['backend']}, "
          f"{first['fs']} under {args.root}, {first['loop']} loop, n={args.n}, "
          f"median of {args.rounds} rounds; MB/s of payload")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
