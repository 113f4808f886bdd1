"""LMCache 0.5.6's RESP L2 adapter timed by its own ``lmcache bench l2``, from its own
virtualenv (../shared/bench/lmcache_cpu_install.sh makes one), for bench_redis."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

KiB = 1 << 10


def bench_lmcache(venv: Path, port: int, size: int, k: int, rounds: int,
                  workdir: Path) -> dict[str, float] | str:
    """p50 (and fastest) ms per round of LMCache's RESP L2 adapter (store, lookup of the
    stored keys, load), or why it was skipped."""
    exe = venv / "bin" / "lmcache"
    if not exe.exists():
        return (f"LMCache column skipped: {exe} not found (install it with "
                "../shared/bench/lmcache_cpu_install.sh VENV, never into this env)")
    out = workdir / f"lmcache-{size}.json"
    spec = json.dumps({"type": "resp", "host": "127.0.0.1", "port": port})
    cmd = [str(exe), "bench", "l2", "--l2-adapter", spec, "--num-keys", str(k),
           "--data-size-kb", str(size // KiB), "--rounds", str(rounds), "--warmup-rounds", "1",
           "--lookup-max-hit-rate", "1.0", "--format", "json", "--output", str(out), "-q"]
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0 or not out.exists():
        return f"LMCache run failed ({proc.returncode}): {proc.stderr[-500:]}"
    metrics = json.loads(out.read_text())["metrics"]
    result = {}
    for op in metrics.values():
        if isinstance(op, dict) and op.get("operation") in ("Store", "Lookup", "Load"):
            if op["total_success"] != op["total_keys"]:
                return f"LMCache {op['operation']} lost keys: {op}"
            result["lmcache_" + op["operation"].lower()] = float(op["duration_p50_ms"])
            result["lmcache_best_" + op["operation"].lower()] = float(op["duration_min_ms"])
    return result
