"""Background hashing against the event loop, side by side in one run.

The arena journal records each committed put block with its payload's xxh3-64; a put's
blocks are hashed on a worker thread after its commit is answered. This benchmark runs
that hashing (``--mib`` of blocks of each size, in the default executor, as the journal
does) while the event loop serves a stream of small requests, and compares two hashers:

- ``package``: the ``xxhash`` package per block (``kvtier.frame.payload_checksum``), the
  fastest hasher here, which holds the GIL for blocks of 64 KiB or less;
- ``background``: ``kvtier.checksum.checksums_in_background`` (the journal's): libxxhash
  through ctypes for those, the GIL released for each block; the package above 64 KiB,
  so the 256 KiB rows are the same code twice (a control).

An engine stands in as a second process that pings the loop over a socket pair every 0.2
ms (a byte the loop echoes at once, as a lookup arriving on the daemon's loop); a ping's
round trip is how long the loop took to serve it. Printed per block size: the hashing's
wall time and the median, p99 and worst round trip of the pings sent while it ran (and of
pings with the loop idle), the hashers taking turns per repetition.

Usage: python benchmarks/bench_hashing.py [--mib 64] [--reps 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import socket
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvtier.checksum import checksums_in_background, native
from kvtier.frame import payload_checksum

KiB = 1 << 10
SIZES = (16 * KiB, 64 * KiB, 256 * KiB)
PING_GAP_S = 0.0002


def package(views: list[Any]) -> list[int]:
    return [payload_checksum(v) for v in views]


def pinger(sock: socket.socket, out: Connection) -> None:
    """The engine: ping, wait for the echo, pause; (sent at, round trip) of each until the
    loop answers ``q``, then sent back through ``out``."""
    pings: list[tuple[float, float]] = []
    while True:
        t = time.perf_counter()
        try:
            sock.send(b"p")
            if sock.recv(1) != b"p":
                break
        except OSError:
            break
        pings.append((t, time.perf_counter() - t))
        time.sleep(PING_GAP_S)
    out.send(pings)


Hasher = Callable[[list[Any]], list[int]]
Spans = dict[str, list[tuple[float, float]]]


async def hash_runs(views: list[np.ndarray], hashers: dict[str, Hasher], reps: int
                    ) -> tuple[dict[str, list[float]], Spans]:
    """Each hasher ``reps`` times in turns; the wall time and the [start, end] of each run."""
    loop = asyncio.get_running_loop()
    walls: dict[str, list[float]] = {name: [] for name in hashers}
    spans: dict[str, list[tuple[float, float]]] = {name: [] for name in hashers}
    for rep in range(reps):
        order = list(hashers) if rep % 2 == 0 else list(reversed(hashers))
        for name in order:
            await asyncio.sleep(0.01)   # idle pings between runs
            t0 = time.perf_counter()
            await loop.run_in_executor(None, hashers[name], views)
            t1 = time.perf_counter()
            walls[name].append(t1 - t0)
            spans[name].append((t0, t1))
    return walls, spans


def _stats(rtts: list[float]) -> str:
    if not rtts:
        return f"{'-':>9} {'-':>9} {'-':>9} {0:>6}"
    rtts = sorted(rtts)
    p99 = rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))]
    return (f"{statistics.median(rtts) * 1e3:9.3f} {p99 * 1e3:9.3f} {rtts[-1] * 1e3:9.3f} "
            f"{len(rtts):>6}")


async def bench(mib: int, reps: int) -> None:
    loop = asyncio.get_running_loop()
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, mib << 20, np.uint8)
    await loop.run_in_executor(None, package, [buf[:KiB]])   # the worker thread exists
    hashers = {"package": package, "background": checksums_in_background}
    print(f"{mib} MiB hashed on a worker thread while a second process pings the loop every "
          f"{PING_GAP_S * 1e3:.1f} ms; {reps} repetitions, hashers taking turns; libxxhash "
          f"{'found' if native() else 'MISSING (both rows are the package)'}")
    print(f"{'block':>8} {'hasher':>13} {'hash ms':>8} {'ping p50':>9} {'ping p99':>9} "
          f"{'ping max':>9} {'pings':>6}")
    for size in SIZES:
        views = [buf[i: i + size] for i in range(0, buf.nbytes - size + 1, size)]
        ours, theirs = socket.socketpair()
        recv_end, send_end = mp.Pipe(duplex=False)
        child = mp.get_context("fork").Process(target=pinger, args=(theirs, send_end))
        child.start()
        theirs.close()
        ours.setblocking(False)

        answer = [b"p"]

        def echo(sock: socket.socket = ours, answer: list[bytes] = answer) -> None:
            with contextlib.suppress(BlockingIOError):
                if sock.recv(64):
                    sock.send(answer[0])

        loop.add_reader(ours.fileno(), echo)
        try:
            walls, spans = await hash_runs(views, hashers, reps)
        finally:
            answer[0] = b"q"   # the pinger stops at its next ping
        pings: list[tuple[float, float]] = await loop.run_in_executor(None, recv_end.recv)
        loop.remove_reader(ours.fileno())
        ours.close()
        child.join()
        assert checksums_in_background(views) == package(views)   # the same numbers
        busy = [span for runs in spans.values() for span in runs]
        idle = [rtt for t, rtt in pings if not any(a <= t < b for a, b in busy)]
        worst: dict[str, float] = {}
        for name in hashers:
            rtts = [rtt for t, rtt in pings if any(a <= t < b for a, b in spans[name])]
            worst[name] = max(rtts, default=0.0)
            print(f"{size // KiB:>6}Ki {name:>13} {statistics.median(walls[name]) * 1e3:8.2f} "
                  f"{_stats(rtts)}")
        print(f"{size // KiB:>6}Ki {'(loop idle)':>13} {'':>8} {_stats(idle)}")
        slower = statistics.median(walls["background"]) / statistics.median(walls["package"])
        print(f"{'':>8} worst ping background/package "
              f"{worst['background'] / max(worst['package'], 1e-9):.2f}, hashing time "
              f"background/package {slower:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    if args.mib < 2:
        sys.exit("--mib must be at least 2")
    asyncio.run(bench(args.mib, args.reps))


if __name__ == "__main__":
    main()
