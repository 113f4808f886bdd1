"""Another client process (per-process shares are per process): it stores ``n`` blocks of
its own, reads them back, and says how many it stored and how many came back exact."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

VICTIM = textwrap.dedent("""
    import sys
    import numpy as np
    from kvtier.client import connect
    from kvtier.keys import block_keys
    from kvtier.layout import KVLayout
    n = int(sys.argv[2])
    with connect(sys.argv[1]) as c:
        ns = c.register_layout(KVLayout(2, 2, 32, "float16", 64), "m", cache_salt="victim")
        keys = block_keys(ns, np.arange(50_000, 50_000 + n * 64))
        data = [np.full(ns.layout.block_bytes, 0x20 + i, np.uint8) for i in range(n)]
        stored = c.put(ns, keys, data)
        outs = [np.zeros(ns.layout.block_bytes, np.uint8) for _ in keys]
        got = c.get(ns, keys, outs)
        exact = sum(np.array_equal(o, d) for o, d in zip(outs[:got], data[:got]))
        print(stored, got, exact)
""")


def victim(socket: Path, n: int) -> tuple[int, int, int]:
    """(stored, got back, exact) of ``n`` blocks put and read by another process."""
    out = subprocess.run([sys.executable, "-c", VICTIM, str(socket), str(n)], check=True,
                         capture_output=True, text=True, timeout=60).stdout.split()
    stored, got, exact = (int(x) for x in out)
    return stored, got, exact
