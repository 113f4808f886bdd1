"""Replay speed and policy gain: block references per second per policy (issue 4 asks
>= 100,000 on 2 cores; issue 13: with the adaptive policy's shadow caches on; wall clock,
which decides the exit status, and per second of this process's CPU time, which a loaded
machine does not halve) and the
cost of the shadows side by side (adaptive's refs/s over cost's, the policy it runs when
its shadows pick cost), the adaptive runs' final mode and live MRC; with ``--spread``,
each policy's token hits over LRU's measured at five capacities around each fraction
(x0.92 .. x1.08).

A single capacity is a noisy measure of a policy: eviction is chaotic, and moving the
capacity by a few per cent moves cost/LRU on the shared Mooncake trace by up to +-0.05. A change
to a policy is real when it moves the mean over nearby capacities, not one point.

Replays run in the store's order (``SimConfig.order``, kvtier.replay.simulator), as
``kvtier replay`` does; ``--order reference`` replays head first, the order of the
reference figures of shared/traces/README.md and of the measurements before 2026-12-06.

Usage: python benchmarks/bench_replay.py [TRACE] [--fraction F ...] [--spread] [--order O]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from statistics import mean

from kvtier.replay.simulator import Order, SimConfig, TierSpec, simulate
from kvtier.replay.trace import Trace, load_trace

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "traces" / (
    "mooncake_synthetic_trace.jsonl")
if not DEFAULT.exists():  # a worktree one level deeper than the main checkout
    DEFAULT = Path(__file__).resolve().parents[3] / "shared" / "traces" / DEFAULT.name
SPREAD = (0.92, 0.96, 1.0, 1.04, 1.08)


def _config(trace: Trace, fraction: float, order: Order = Order.STORE) -> SimConfig:
    return SimConfig(tiers=(TierSpec("cpu", max(1, int(trace.n_unique_blocks * fraction)),
                                     25e9),), order=order)


def spread(trace: Trace, fraction: float, policies: list[str],
           order: Order = Order.STORE) -> None:
    """Print each policy's token hits / LRU's at the capacities around ``fraction``."""
    ratios: dict[str, list[float]] = {p: [] for p in policies if p != "lru"}
    for s in SPREAD:
        cfg = _config(trace, fraction * s, order)
        lru = simulate(trace, "lru", cfg).hit_tokens
        for p in ratios:
            ratios[p].append(simulate(trace, p, cfg).hit_tokens / max(lru, 1))
    for p, rs in ratios.items():
        at = rs[SPREAD.index(1.0)]
        print(f"{p:>8} {fraction:>8.0%}  vs lru: at {at:.3f}  mean {mean(rs):.3f}  "
              f"min {min(rs):.3f}  max {max(rs):.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", default=str(DEFAULT))
    ap.add_argument("--fraction", nargs="+", type=float, default=[0.05, 0.40])
    ap.add_argument("--policy", nargs="+",
                    default=["lru", "lfu", "cost", "hindsight", "adaptive", "belady"])
    ap.add_argument("--spread", action="store_true",
                    help="also print each policy vs LRU over five capacities around each "
                    "fraction (x0.92 .. x1.08)")
    ap.add_argument("--order", choices=[o.value for o in Order], default=Order.STORE.value,
                    help="how a request's blocks reach the policy (default: as the store)")
    args = ap.parse_args()
    order = Order(args.order)
    trace = load_trace(args.trace)
    print(f"{args.trace}: {trace.n_references} block references, {order.value} order")
    print(f"{'policy':>8} {'capacity':>8} {'refs/s':>10} {'cpu refs/s':>10} {'tok hit':>8}"
          "  >=100k/s  notes")
    worst = float("inf")
    for f in args.fraction:
        cfg = _config(trace, f, order)
        rates: dict[str, float] = {}
        for p in args.policy:
            r = simulate(trace, p, cfg, capacity_fraction=f)
            rate = rates[p] = r.references / r.elapsed_s
            worst = min(worst, rate)
            ok = "yes" if rate >= 100_000 else "NO"
            note = ""
            if r.shadows:
                sh = r.shadows[0]
                mrc = " ".join(f"{p['scale']:g}x={p['hit_rate']:.3f}"
                               for p in sh["mrc"])  # type: ignore[attr-defined]
                note = f"mode {sh['mode']} ({sh['switches']} switches)  MRC {mrc}"
                if "cost" in rates:
                    note += f"  speed vs cost {rate / rates['cost']:.2f}x"
            cpu = r.references / r.cpu_s if r.cpu_s > 0 else float("nan")
            print(f"{p:>8} {f:>8.0%} {rate:>10,.0f} {cpu:>10,.0f} {r.token_hit_rate:>8.4f}  "
                  f"{ok:>8}  {note}")
    print(f"slowest: {worst:,.0f} refs/s")
    if args.spread:
        print("\ntoken hits over LRU's at five capacities around each fraction")
        for f in args.fraction:
            spread(trace, f, [p for p in args.policy if p != "belady"], order)
    return 0 if worst >= 100_000 else 1


if __name__ == "__main__":
    raise SystemExit(main())
