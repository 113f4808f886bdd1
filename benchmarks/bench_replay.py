"""Replay speed: block references per second per policy (issue 4 asks >= 100,000 on 2 cores).

Usage: python benchmarks/bench_replay.py [TRACE] [--fraction F ...]
Prints one row per (policy, capacity) with the speed and the token hit rate.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtier.replay.simulator import SimConfig, TierSpec, simulate
from kvtier.replay.trace import load_trace

DEFAULT = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("trace", nargs="?", default=str(DEFAULT))
    ap.add_argument("--fraction", nargs="+", type=float, default=[0.05, 0.40])
    ap.add_argument("--policy", nargs="+", default=["lru", "lfu", "cost", "belady"])
    args = ap.parse_args()
    trace = load_trace(args.trace)
    print(f"{args.trace}: {trace.n_references} block references")
    print(f"{'policy':>8} {'capacity':>8} {'refs/s':>10} {'tok hit':>8}  >=100k/s")
    worst = float("inf")
    for f in args.fraction:
        cfg = SimConfig(tiers=(TierSpec("cpu", int(trace.n_unique_blocks * f), 25e9),))
        for p in args.policy:
            r = simulate(trace, p, cfg, capacity_fraction=f)
            rate = r.references / r.elapsed_s
            worst = min(worst, rate)
            ok = "yes" if rate >= 100_000 else "NO"
            print(f"{p:>8} {f:>8.0%} {rate:>10,.0f} {r.token_hit_rate:>8.4f}  {ok}")
    print(f"slowest: {worst:,.0f} refs/s")
    return 0 if worst >= 100_000 else 1


if __name__ == "__main__":
    raise SystemExit(main())
