"""``kvtier plan``: argument parsing and the command's entry point."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kvtier import ui
from kvtier.argtypes import float_in, int_in
from kvtier.plan.errors import PlanError
from kvtier.plan.hardware import GPUS, find_gpu
from kvtier.plan.kvmath import KV_DTYPES, WEIGHT_DTYPES, normalize_dtype
from kvtier.plan.model import ModelSpec, load_model
from kvtier.plan.planner import (
    DAEMON_BYTES_PER_BLOCK,
    MAX_CONCURRENCY,
    Plan,
    PlanInput,
    make_plan,
)
from kvtier.plan.presets import preset_names
from kvtier.plan.report import gb, model_line, to_json
from kvtier.plan.workload import parse_context, read_trace

EXIT_OK = 0
EXIT_BAD_INPUT = 2


MAX_PARAMS = 1e15
"""Largest ``--params``: a thousand trillion."""
MAX_GB = 1e6
"""Largest ``--gpu-mem-gb`` and ``--reserve-gb``: a petabyte per GPU."""
MAX_BLOCK_TOKENS = 1 << 20
"""Largest ``--trace-block-tokens``."""


def _count(text: str) -> int:
    """Parse a parameter count: ``14e9``, ``14B``, ``70b``, ``7.6B``, ``560M``."""
    t = text.strip().upper()
    scale = {"B": 1e9, "M": 1e6, "T": 1e12}.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if scale != 1.0 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r}") from None
    if not 0 < value <= MAX_PARAMS:  # NaN and infinities fail this too
        raise argparse.ArgumentTypeError(f"a parameter count must be positive and at most "
                                         f"{MAX_PARAMS:g}, got {text!r}")
    return int(value)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``plan`` on the ``kvtier`` command line."""
    p = subparsers.add_parser(
        "plan", help="size KV memory and kvtier tiers for a model and workload",
        description="KV-cache capacity planning: weights and KV per GPU, sequences that "
                    "fit in HBM at P50/P95/P99, spill at the target concurrency, and "
                    "recommended kvtier tier sizes. Sizes are decimal GB.")
    p.add_argument("--model", required=True,
                   help=f"preset ({', '.join(preset_names())}) or a config.json path/folder")
    p.add_argument("--kv-dtype", default="auto",
                   help="KV cache dtype: auto (as vLLM's --kv-cache-dtype auto: the "
                        "checkpoint's quantized KV, e.g. ModelOpt FP8, else the model's "
                        f"dtype) or {', '.join(KV_DTYPES)}")
    p.add_argument("--weights-dtype", default="auto",
                   help="weights dtype for every weight: auto (the checkpoint's, with its "
                        f"quantization_config) or {', '.join(WEIGHT_DTYPES)}")
    p.add_argument("--params", type=_count, default=None,
                   help="parameter count override, e.g. 14B (default: counted from config)")
    p.add_argument("--gpu", default="h100-80gb", help=f"GPU type: {', '.join(GPUS)}")
    p.add_argument("--gpu-mem-gb", type=float_in(0, MAX_GB, above=True), default=None,
                   help="memory per GPU in GB (overrides the --gpu preset's)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs on the node (default: --tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size per engine")
    p.add_argument("--mem-util", type=float, default=0.9,
                   help="share of GPU memory the engine may use (vLLM "
                        "--gpu-memory-utilization)")
    p.add_argument("--reserve-gb", type=float_in(0, MAX_GB), default=0.0,
                   help="GB per GPU kept for activations, CUDA graphs, NCCL")
    p.add_argument("--concurrency", type=int_in(1, MAX_CONCURRENCY), default=32,
                   help="running sequences to serve at once, over all engine instances")
    p.add_argument("--context", default="2048,4096,8192",
                   help="prompt tokens at P50,P95,P99 (or one value for all)")
    p.add_argument("--max-output", type=int, default=0,
                   help="output tokens added to each --context length")
    p.add_argument("--prefix-share", type=float, default=0.0,
                   help="share of prompt tokens in reused prefixes, 0..1")
    p.add_argument("--trace", default=None,
                   help="measure context percentiles and prefix reuse from a kvtier replay "
                        "trace (Mooncake or Bailian JSONL) instead of --context")
    p.add_argument("--trace-block-tokens", type=int_in(1, MAX_BLOCK_TOKENS), default=None,
                   help="tokens per hash_ids entry (default 512 Mooncake, 16 Bailian)")
    p.add_argument("--block-size", type=int, default=16,
                   help="engine KV page size in tokens (allocation granularity)")
    p.add_argument("--tokens-per-block", type=int, default=None,
                   help="kvtier's block in tokens, as the connector's tokens_per_block "
                        "(default: about 256, a multiple of --block-size)")
    p.add_argument("--live-stats", default=None, metavar="URL|FILE",
                   help="a daemon's /v1/stats (URL or saved JSON): also print what other tier "
                        "sizes would hit on its live workload (adaptive policy's curve)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw KV memory vs context length against the HBM budget")
    p.set_defaults(func=run)


def build_input(args: argparse.Namespace) -> PlanInput:
    """Turn parsed arguments into a PlanInput (raises PlanError on bad values)."""
    model = load_model(args.model)
    gpu = find_gpu(args.gpu)
    if args.gpu_mem_gb is not None:
        gpu = dataclasses.replace(gpu, name=f"{gpu.name} ({args.gpu_mem_gb:g} GB)",
                                  memory_bytes=int(args.gpu_mem_gb * 1e9))
    if args.kv_dtype == "auto":
        kv_dtype = auto_kv_dtype(model)
    else:
        kv_dtype = normalize_dtype(args.kv_dtype, KV_DTYPES, "--kv-dtype")
    trace = None
    context = parse_context(args.context)
    max_output = args.max_output
    prefix_share = args.prefix_share
    if args.trace:
        if args.max_output:
            raise PlanError("--max-output and --trace exclude each other: the trace holds "
                            "output lengths")
        trace = read_trace(args.trace, args.trace_block_tokens)
        context, max_output, prefix_share = trace.sequence_tokens, 0, trace.prefix_share
    return PlanInput(
        model=model, gpu=gpu, kv_dtype=kv_dtype,
        weights_dtype=None if args.weights_dtype == "auto" else args.weights_dtype,
        gpus=args.gpus or args.tp, tp=args.tp, mem_util=args.mem_util,
        reserve_bytes=int(args.reserve_gb * 1e9), concurrency=args.concurrency,
        context=context, max_output=max_output, prefix_share=prefix_share,
        block_tokens=args.block_size, kvtier_block_tokens=args.tokens_per_block,
        params_override=args.params, trace=trace,
    )


def auto_kv_dtype(model: ModelSpec) -> str:
    """``--kv-dtype auto`` as vLLM resolves ``--kv-cache-dtype auto``: the KV dtype the
    checkpoint's quantization_config asks for (ModelOpt FP8: fp8_e4m3), else the model's
    dtype (fp16 or bf16; bf16 for an fp32 checkpoint)."""
    if model.checkpoint_kv_dtype:
        return model.checkpoint_kv_dtype
    kv_dtype = normalize_dtype(model.torch_dtype or "bf16")
    return kv_dtype if kv_dtype in ("fp16", "bf16") else "bf16"


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvtier plan``; returns the exit status."""
    try:
        if args.plot:   # checked first, as replay does (found by review)
            from kvtier.plan.plot import check_plot_path

            check_plot_path(args.plot)
        plan = make_plan(build_input(args))
        if args.plot:
            from kvtier.plan.plot import write_plot

            out = write_plot(plan, args.plot)
            if not args.json:
                print(f"plot written to {out}", file=sys.stderr)
    except PlanError as exc:
        print(f"kvtier plan: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(to_json(plan), indent=2))
    else:
        print_plan(plan)
    if getattr(args, "live_stats", None):
        from kvtier.errors import KVTierError
        from kvtier.policy.mrc import live_plan

        try:
            print(live_plan(args.live_stats), file=sys.stderr if args.json else sys.stdout)
        except KVTierError as exc:
            print(f"kvtier plan: error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
    return EXIT_OK


def _small(n: int) -> str:
    """Bytes in GB, or in MB under one GB (the daemon's own memory often is)."""
    return gb(n) if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def print_plan(plan: Plan) -> None:
    """The human output: the inputs, then rich tables of memory, sequences and tiers."""
    out = ui.console()
    p = plan.inputs
    text = [
        model_line(plan),
        f"hardware  {p.gpus} x {p.gpu.name} ({gb(p.gpu.memory_bytes)}), TP {p.tp}, "
        f"{plan.replicas} engine instance(s), memory utilization {p.mem_util:.2f}",
        f"workload  {p.concurrency} running sequences"
        + (f", trace {p.trace.path} ({p.trace.requests:,} requests)" if p.trace else "")
        + (f", max output {p.max_output:,} tokens" if p.max_output else ""),
    ]
    for line in text:
        out.print(line, markup=False)
    out.print()
    out.print(ui.table(["memory", "size"], [
        [f"weights ({plan.weights_dtype})",
         f"{gb(plan.weights_bytes)} total, {gb(plan.weights_bytes_per_gpu)} per GPU"],
        [f"KV per token ({p.kv_dtype})", f"{plan.kv_bytes_per_token:,} B"
         + (f" ({plan.kv_bytes_per_token_per_gpu:,} B per GPU)" if p.tp > 1 else "")],
        ["HBM left for KV per GPU", f"{gb(plan.kv_budget_bytes_per_gpu)} ({p.mem_util:.2f} x "
         f"{gb(p.gpu.memory_bytes)} - weights"
         + (f" - reserve {gb(p.reserve_bytes)}" if p.reserve_bytes else "") + ")"],
    ]))
    out.print()
    out.print(ui.table(
        ["percentile", "tokens/seq", "KV/seq", "sequences that fit in HBM"],
        [[name.upper(), f"{plan.sequence_tokens[name]:,}", gb(plan.kv_bytes_per_sequence[name]),
          f"{plan.max_sequences_in_hbm[name]:,}"] for name in ("p50", "p95", "p99")],
        right=(1, 2, 3)))
    out.print()
    out.print(f"KV needed at P99 x {p.concurrency}: {gb(plan.kv_demand_bytes_p99)} vs "
              f"{gb(plan.kv_pool_bytes)} of HBM KV pool; "
              + (f"{gb(plan.spill_bytes_p99)} (whole sequences) must spill"
                 if plan.spill_bytes_p99 else "fits in HBM"), markup=False)
    out.print()
    out.print(ui.table(["tier", "size", "why"],
                       [[t.tier, gb(t.bytes) if t.bytes else "off", t.why] for t in plan.tiers]
                       + [["daemon", _small(plan.daemon_memory_bytes),
                           f"its own memory, beside cpu.bytes: ~{DAEMON_BYTES_PER_BLOCK:,} B "
                           f"per block, up to {plan.daemon_blocks:,} blocks of "
                           f"{plan.kvtier_block_tokens} tokens in cpu + nvme"]],
                       title="recommended kvtier tiers (this node)", right=(1,)))
    s = plan.prefill_saving
    out.print()
    out.print(f"prefix reuse {s['prefix_share']:.1%} of prompt tokens: prefill at P50 "
              f"({int(s['prompt_tokens_p50']):,} tokens) {s['prefill_flops_p50'] / 1e12:,.1f} "
              f"TFLOP, saves {s['saved_flops_p50'] / 1e12:,.1f} TFLOP "
              f"(~{s['saved_seconds_p50'] * 1e3:,.0f} ms of "
              f"{s['prefill_seconds_p50'] * 1e3:,.0f} ms at 50% MFU)", markup=False)
    out.print(f"decode step with {plan.decode_sequences_p99:,} P99 sequences per instance in "
              f"HBM: >= {plan.decode_step_s_p99 * 1e3:,.1f} ms (weights + KV read from HBM "
              "each step)", markup=False)
    for n in plan.notes:
        out.print(f"note: {n}", markup=False)


def main(argv: list[str] | None = None) -> int:
    """Run ``plan`` alone (``python -m kvtier.plan``) until kvtier's CLI wires it in."""
    parser = argparse.ArgumentParser(prog="kvtier")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))
