"""``kvtier replay TRACE``: measure eviction policies on a request trace.

Wiring: ``kvtier/cli.py`` calls :func:`add_parser` with its subparsers; the parsed
namespace's ``func`` is :func:`run`, which returns the process exit code.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier import ui
from kvtier.argtypes import float_in, int_in
from kvtier.errors import KVTierError
from kvtier.policy.admission import AdmissionPolicy, AlwaysAdmit, SecondHitAdmission, WriteBudget
from kvtier.policy.costmodel import BlockCosts, PrefillModel
from kvtier.policy.prefetch import TIMEOUT_BASE_S, PrefetchWait
from kvtier.replay.report import (
    belady_note,
    format_mrc,
    format_reuse_breakdown,
    fraction_label,
    table_rows,
    to_record,
)
from kvtier.replay.simulator import Order, ReplayResult, SimConfig, TierSpec, simulate
from kvtier.replay.trace import STDIN, Trace, TraceFormat, load_trace

POLICIES = ("lru", "lfu", "cost", "adaptive", "belady")
CHOICES = (*POLICIES, "hindsight")  # hindsight: what adaptive starts in (not a default column)
DEFAULT_FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20, 0.40)
DEFAULT_BW = {"hbm": 1.0e12, "cpu": 25.0e9, "nvme": 3.0e9, "redis": 1.0e9}
MAX_BLOCKS = 1 << 48
"""Largest ``--tier`` size in blocks."""
MAX_DIM = 2**31
"""Largest ``--layers``, ``--hidden``, ``--bytes-per-token``, ``--block-tokens``."""
_BYTES_PER_S = float_in(0, above=True)
PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff",
                 ".webp")
"""What ``--plot`` may end in: formats matplotlib's savefig writes with its Agg backend."""


def _name_value(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"must look like NAME=VALUE, got {text!r}")
    return name, value


def _tier(text: str) -> tuple[str, int]:
    """``--tier NAME=BLOCKS``: a whole number of blocks, at least one (``2e6`` is fine)."""
    name, value = _name_value(text)
    try:
        blocks = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number") from None
    if not (1 <= blocks <= MAX_BLOCKS and blocks.is_integer()):  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{text!r}: a tier holds a whole number of blocks "
                                         f"from 1 to {MAX_BLOCKS:,}")
    return name, int(blocks)


def _bandwidth(text: str) -> tuple[str, float]:
    """``--bandwidth NAME=B/S``: a positive, finite read bandwidth."""
    name, value = _name_value(text)
    try:
        return name, _BYTES_PER_S(value)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``replay`` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser(
        "replay",
        help="replay a request trace through the tiers with each eviction policy",
        description="Replay a Mooncake or Alibaba Bailian JSONL trace through a simulated "
        "tier hierarchy driven by kvtier's own policies, and compare them with LRU "
        "(tokens saved) and Belady's offline optimum (block hits: MIN is a bound on blocks "
        "found, not on tokens saved).",
    )
    p.add_argument("trace", help="JSONL trace file (Mooncake or Alibaba Bailian format; "
                   "gzip, bzip2 or xz compressed too); - reads standard input")
    p.add_argument("--format", choices=[f.value for f in TraceFormat], default="auto")
    p.add_argument("--block-tokens", type=int_in(1, MAX_DIM), default=None,
                   help="tokens per hash id (default: 512 Mooncake, 16 Bailian)")
    p.add_argument("--policy", nargs="+", choices=CHOICES, default=list(POLICIES),
                   help="policies to compare (default: all)")
    p.add_argument("--capacity-fraction", nargs="+", type=float, default=None,
                   help="one-tier runs sized as fractions of the trace's unique blocks "
                   "(default: 0.01 0.02 0.05 0.1 0.2 0.4)")
    p.add_argument("--tier", action="append", default=[], metavar="NAME=BLOCKS",
                   type=_tier,
                   help="a tier and its size in blocks, top first (e.g. --tier cpu=2000 "
                   "--tier nvme=20000); replaces --capacity-fraction")
    p.add_argument("--bandwidth", action="append", default=[], metavar="NAME=B/S",
                   type=_bandwidth,
                   help="read bandwidth of a tier toward the GPU (defaults: cpu 25e9, "
                   "nvme 3e9, redis 1e9)")
    p.add_argument("--nvme-admission", choices=["always", "second-hit"], default="always")
    p.add_argument("--nvme-write-budget", type=float_in(0), default=None, metavar="B/S",
                   help="token-bucket write budget of the nvme tier, as the daemon's "
                   "nvme.write_budget_bytes_per_s (burst: one second, at least 64 MiB; "
                   "0: nothing past the first burst)")
    p.add_argument("--prefetch", choices=[w.value for w in PrefetchWait], default="wait")
    p.add_argument("--order", choices=[o.value for o in Order], default=Order.STORE.value,
                   help="how a request's blocks reach the policy: 'store' as kvtier's store "
                   "does (the default: its hits touched tail first, room made for its new "
                   "blocks, which are then inserted tail first), 'reference' head first with "
                   "an eviction after each insert (the semantics of the LRU and Belady "
                   "reference figures of shared/traces/README.md)")
    p.add_argument("--model-params", type=float_in(0, above=True), default=8.0e9)
    p.add_argument("--layers", type=int_in(1, MAX_DIM), default=32)
    p.add_argument("--hidden", type=int_in(1, MAX_DIM), default=4096)
    p.add_argument("--flops", type=float_in(0, above=True), default=4.0e14,
                   help="effective prefill FLOP/s")
    p.add_argument("--bytes-per-token", type=int_in(1, MAX_DIM), default=131072,
                   help="KV bytes per token (default: 8B model, 8 KV heads, fp16)")
    p.add_argument("--limit", type=int_in(1), default=None,
                   help="replay only the N earliest requests (a trace in arrival order is "
                   "parsed no further)")
    p.add_argument("--json", action="store_true", help="one JSON object per line per run")
    p.add_argument("--reuse-breakdown", action="store_true",
                   help="also show the share of reuses each policy hits by reuse distance "
                   "(in capacities): whether it loses on recent reuses or on distant ones")
    p.add_argument("--progress", action="store_true",
                   help="show a progress bar even when stderr is not a terminal")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw hit rate against capacity fraction (needs matplotlib; .png, "
                   ".svg, .pdf, ...; not with --tier)")
    p.set_defaults(func=run)
    return p


def _admission(args: argparse.Namespace) -> Callable[[str], AdmissionPolicy]:
    def build(tier: str) -> AdmissionPolicy:
        if tier != "nvme":
            return AlwaysAdmit()
        inner: AdmissionPolicy | None = (
            SecondHitAdmission() if args.nvme_admission == "second-hit" else None
        )
        if args.nvme_write_budget is not None:   # the daemon's budget (policy/factory.py)
            return WriteBudget.per_second(args.nvme_write_budget, inner=inner)
        return inner or AlwaysAdmit()

    return build


def _configs(args: argparse.Namespace, trace: Trace) -> list[tuple[float | None, SimConfig]]:
    bw = dict(DEFAULT_BW)
    bw.update(dict(args.bandwidth))
    costs = BlockCosts(
        block_tokens=trace.block_tokens,
        block_bytes=trace.block_tokens * args.bytes_per_token,
        prefill=PrefillModel(params=args.model_params, layers=args.layers, hidden=args.hidden,
                             flops_per_s=args.flops),
    )
    common: dict[str, Any] = {
        "costs": costs, "bytes_per_token": args.bytes_per_token,
        "prefetch": PrefetchWait(args.prefetch), "admission": _admission(args),
        "order": Order(args.order),
    }
    if args.tier and args.capacity_fraction:
        raise KVTierError("give either --tier sizes or --capacity-fraction, not both")
    names = [name for name, _ in args.tier]
    nvme_flags = [flag for flag, given in (
        ("--nvme-admission", args.nvme_admission != "always"),
        ("--nvme-write-budget", args.nvme_write_budget is not None)) if given]
    if nvme_flags and "nvme" not in names:
        raise KVTierError(f"{' and '.join(nvme_flags)} act on a tier named nvme: add "
                          "--tier nvme=BLOCKS (--capacity-fraction replays one cpu tier)")
    for name in names:
        if names.count(name) > 1:
            raise KVTierError(f"--tier {name}= is given {names.count(name)} times: name each "
                              "tier once")
    for name, _ in args.bandwidth:
        if name not in DEFAULT_BW and name not in names:
            raise KVTierError(f"--bandwidth {name}=: no tier is named {name!r} (known: "
                              f"{', '.join(sorted({*DEFAULT_BW, *names}))})")
    if args.tier:
        tiers = tuple(
            TierSpec(name, int(blocks), bw.get(name, DEFAULT_BW["cpu"]))
            for name, blocks in args.tier
        )
        return [(None, SimConfig(tiers=tiers, **common))]
    unique = trace.n_unique_blocks
    out = []
    for f in args.capacity_fraction or DEFAULT_FRACTIONS:
        if not 0 < f <= 1:
            raise KVTierError(f"--capacity-fraction must be in (0, 1], got {f}")
        cap = max(1, int(unique * f))
        out.append((f, SimConfig(tiers=(TierSpec("cpu", cap, bw["cpu"]),), **common)))
    return out


def _check_plot(args: argparse.Namespace) -> None:
    """Refuse a ``--plot`` that could not be written, before a replay that may take minutes
    (matplotlib would only fail at the end, and a name without a known suffix or a directory
    would silently become NAME.png)."""
    if not args.plot:
        return
    path = Path(args.plot)
    if args.tier:
        raise KVTierError("--plot draws hit rate against --capacity-fraction: there is "
                          "nothing to plot for --tier runs")
    if path.is_dir():
        raise KVTierError(f"--plot {args.plot} is a directory: give a file name such as "
                          f"{path / 'hit_rates.png'}")
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise KVTierError(f"--plot {args.plot}: the name must end in one of "
                          f"{' '.join(PLOT_SUFFIXES)}")
    if not path.parent.is_dir():
        raise KVTierError(f"--plot {args.plot}: no directory {path.parent} to write it in")


def _check_finite(trace: Trace, configs: list[tuple[float | None, SimConfig]]) -> None:
    """Refuse model inputs (``--flops``, ``--bandwidth``, ``--model-params``) so extreme
    that a time overflows to infinity: JSON has no Infinity, and a table of inf says
    nothing. Bound: every request prefilled from scratch and loaded from the slowest tier,
    summed over the trace."""
    worst_tokens = max(r.input_tokens or len(r.blocks) * trace.block_tokens
                       for r in trace.requests)
    for _, config in configs:
        if config.costs is None:  # _configs always sets it
            continue
        slowest = min(t.read_bw for t in config.tiers)
        worst = (config.costs.prefill.seconds(0, worst_tokens) + TIMEOUT_BASE_S
                 + 2.0 * (worst_tokens + trace.block_tokens) * config.bytes_per_token / slowest)
        if not math.isfinite(worst * 4.0 * (len(trace.requests) + 1)):
            raise KVTierError(
                f"a request's modelled time overflows ({worst:.3g} s for {worst_tokens:,} "
                "tokens): give a realistic --flops, --model-params and --bandwidth")


def run(args: argparse.Namespace) -> int:
    """Execute ``kvtier replay``; prints a table (or JSON lines) and returns the exit code."""
    try:
        _check_plot(args)
        # with an explicit --block-tokens too: a block size that contradicts input_length
        # misreads every prefix
        trace = load_trace(args.trace, fmt=TraceFormat(args.format),
                           block_tokens=args.block_tokens, limit=args.limit,
                           check_lengths=True)
        configs = _configs(args, trace)
        _check_finite(trace, configs)
    except KVTierError as exc:
        print(f"kvtier replay: {exc}", file=sys.stderr)
        return 2
    show = args.progress or sys.stderr.isatty()
    results: list[ReplayResult] = []
    for fraction, config in configs:
        for policy in args.policy:
            label = f"{policy} " + (fraction_label(fraction) if fraction is not None
                                    else "tiers")
            with ui.progress(trace.n_references, label, enabled=show) as advance:
                results.append(simulate(trace, policy, config, capacity_fraction=fraction,
                                        progress=advance, reuse_breakdown=args.reuse_breakdown))
    if args.json:
        try:  # _check_finite keeps inf and NaN out; JSON has neither
            lines = [json.dumps(to_record(r, results), allow_nan=False) for r in results]
        except ValueError as exc:
            print(f"kvtier replay: a result is not a finite number ({exc})", file=sys.stderr)
            return 2
        print("\n".join(lines))
    else:
        out = ui.console()
        name = "standard input" if args.trace == STDIN else args.trace
        out.print(f"{name}: {len(trace.requests)} requests, {trace.n_references} block "
                  f"references, {trace.n_unique_blocks} unique blocks of {trace.block_tokens} "
                  f"tokens; {args.order} order", markup=False)
        head, rows = table_rows(results)
        out.print(ui.table(head, rows, right=range(2, len(head))))
        note = belady_note(results)
        if note:
            out.print(note, markup=False)
        mrc = format_mrc(results)
        if mrc:
            out.print()
            out.print(mrc, markup=False)
        if args.reuse_breakdown:
            print()
            print(format_reuse_breakdown(results))
    if args.plot:
        from kvtier.replay.plot import plot_hit_rates

        try:
            plot_hit_rates(results, args.plot)
        except KVTierError as exc:
            print(f"kvtier replay: {exc}", file=sys.stderr)
            return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``python -m kvtier.replay.cli``) until kvtier/cli.py wires it."""
    parser = argparse.ArgumentParser(prog="kvtier")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
