"""On-CPU time of the processes a bench_redis round runs on, per path, op and process.

On a machine with few cores the paths are not only as fast as their critical paths: the
bench client, the daemon and redis-server share the cores, so a path that burns more CPU
per round is slower once they are all busy. This table shows where each path's CPU goes
(docs/redis-bench-log.md reads it).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field

from redis_faults import Faults, ServerFaults, size_label

PROCS = ("client", "daemon", "redis")
Cpu = dict[str, list[float]]   # "path_op_process" -> on-CPU ms per measured round


def cpu_seconds(pid: int | None) -> float | None:
    """On-CPU time so far of every thread of ``pid`` (``/proc/PID/task/*/schedstat``, in
    ns: finer than the clock ticks of ``/proc/PID/stat``), or None where /proc cannot
    tell. A thread that ends between two reads takes its time with it: the bench's and
    the daemons' threads are pools that live as long as their process."""
    if pid is None:
        return None
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue   # ended meanwhile
    return total / 1e9


class CpuMeter:
    """Reads the CPU time of the bench client (this process), one daemon and the server
    around each timed step (the reads themselves outside the timing)."""

    def __init__(self, redis_pid: int | None) -> None:
        self.redis_pid = redis_pid
        self.available = cpu_seconds(os.getpid()) is not None

    def now(self, daemon_pid: int | None = None) -> dict[str, float | None]:
        """CPU seconds so far per process (``daemon`` only when a pid is given)."""
        if not self.available:
            return {}
        return {"client": cpu_seconds(os.getpid()), "daemon": cpu_seconds(daemon_pid),
                "redis": cpu_seconds(self.redis_pid)}

    @staticmethod
    def record(cpu: Cpu, path_op: str, before: dict[str, float | None],
               after: dict[str, float | None]) -> None:
        """Each process's ms between ``before`` and ``after`` under ``path_op``."""
        for proc in PROCS:
            a, b = before.get(proc), after.get(proc)
            if a is not None and b is not None:
                cpu.setdefault(f"{path_op}_{proc}", []).append(max(0.0, b - a) * 1e3)


def print_cpu(cpu_of: dict[int, Cpu], wall_of: dict[tuple[int, str], float],
              labels: dict[str, str]) -> None:
    """Median on-CPU ms per round of each process, per value size, path and op, beside the
    path's median wall time (``wall_of``: (size, "path_op") -> ms)."""
    if not any(cpu_of.values()):
        return
    print("\nCPU per round during the timed step (ms, median; every thread, from schedstat): "
          "client = the bench process (the engine's side; the tier and redis-py run in it), "
          "daemon = A for a store, B for a load; LMCache: only the server's CPU over its "
          "store + lookup + load of a round (its own process's is not separable from its "
          "start-up)")
    print(f"{'value':>7} {'op':<6} {'path':<9} {'wall':>7} " +
          " ".join(f"{p:>7}" for p in PROCS) + f" {'total':>7} {'cores':>6}")
    for size, cpu in cpu_of.items():
        for path in ("daemon", "views", "tier", "plain", "lmcache"):
            for op in ("store", "load", "round"):
                cells = [cpu.get(f"{path}_{op}_{proc}") for proc in PROCS]
                if not any(cells):
                    continue
                med = [statistics.median(c) if c else None for c in cells]
                total = sum(m for m in med if m is not None)
                wall = wall_of.get((size, f"{path}_{op}"))
                print(f"{size_label(size):>7} {op:<6} {labels[path]:<9} "
                      + (f"{wall:>7.2f} " if wall else f"{'-':>7} ")
                      + " ".join(f"{m:>7.2f}" if m is not None else f"{'-':>7}" for m in med)
                      + f" {total:>7.2f} "
                      + (f"{total / wall:>6.2f}" if wall else f"{'-':>6}"))


@dataclass(slots=True)
class Snap:
    """The server's page faults and each process's CPU seconds at one moment."""

    faults: int
    cpu: dict[str, float | None]


@dataclass(slots=True)
class Watch:
    """What one value size's timed steps cost the processes: the server's page faults
    (``redis_faults``) and the CPU of client, daemon and server, per path and op."""

    server: ServerFaults
    meter: CpuMeter
    faults: Faults = field(default_factory=dict)
    cpu: Cpu = field(default_factory=dict)

    def snap(self, daemon_pid: int | None = None) -> Snap:
        """Read before and after a timed step, outside its timing."""
        return Snap(self.server.now(), self.meter.now(daemon_pid))

    def record(self, path_op: str, before: Snap, after: Snap, *, cpu: bool = True) -> None:
        """The step's faults, and its CPU unless ``cpu`` is False (a step whose window
        holds untimed work)."""
        self.faults.setdefault(path_op, []).append(after.faults - before.faults)
        if cpu:
            self.meter.record(self.cpu, path_op, before.cpu, after.cpu)

    def record_per_round(self, name: str, before: float | None, after: float | None,
                         rounds: int) -> None:
        """CPU ms per round of a step that ran ``rounds`` rounds in one go."""
        if before is not None and after is not None and rounds > 0:
            self.cpu.setdefault(name, []).append(max(0.0, after - before) * 1e3 / rounds)
