"""A redis-server's minor page faults, per path and round, for bench_redis."""

from __future__ import annotations

import statistics
from pathlib import Path

KiB, MiB = 1 << 10, 1 << 20


def size_label(size: int) -> str:
    """A value size as the bench's tables print it (256Ki, 3Mi)."""
    return f"{size // MiB}Mi" if size >= MiB else f"{size // KiB}Ki"


class ServerFaults:
    """The redis-server's minor page faults so far (``/proc/PID/stat``), to show what each
    path's rounds cost the server's allocator: a server that gave freed memory back to the
    kernel faults it in again on the next values or reply buffers, and that cost (a few ms
    per 8 MiB here) lands on whichever path comes next."""

    def __init__(self, pid: int | None) -> None:
        path = Path(f"/proc/{pid}/stat") if pid else None
        self.path = path if path is not None and path.exists() else None

    @property
    def available(self) -> bool:
        """Whether the counts are real (a /proc to read): else every count is 0."""
        return self.path is not None

    def now(self) -> int:
        if self.path is None:
            return 0
        try:
            return int(self.path.read_text().rsplit(")", 1)[1].split()[7])
        except (OSError, IndexError, ValueError):
            return 0


Faults = dict[str, list[int]]   # path_op -> server page faults per measured round


def print_faults(faults_of: dict[int, Faults], labels: dict[str, str]) -> None:
    """Median server page faults per round, per path (``labels``: its printed name) and op
    (see ``ServerFaults``)."""
    if not any(faults_of.values()):
        return
    cols = [("daemon", "store"), ("daemon", "load"), ("tier", "store"), ("tier", "load"),
            ("plain", "store"), ("plain", "load")]
    print("\nredis-server minor page faults per round (median; 4 KiB pages; LMCache: its "
          "store + lookup + load of a round)")
    print(f"{'value':>7} " + " ".join(f"{labels[p] + ' ' + op:>14}" for p, op in cols)
          + f" {'LMCache round':>14}")
    for size, faults in faults_of.items():
        value = size_label(size)
        cells = [faults.get(f"{p}_{op}") for p, op in cols] + [faults.get("lmcache_round")]
        print(f"{value:>7} " + " ".join(f"{statistics.median(c):>14.0f}" if c else f"{'-':>14}"
                                        for c in cells))
