"""Render a Plan as a readable table or as a JSON-ready dict."""

from __future__ import annotations

from typing import Any

from kvtier.plan.planner import Plan


def gb(n: float) -> str:
    """Bytes as decimal gigabytes, the unit GPU and disk datasheets use."""
    return f"{n / 1e9:,.2f} GB"


def _model_line(plan: Plan) -> str:
    m = plan.inputs.model
    if m.attention.value == "mla":
        shape = f"MLA latent {m.kv_lora_rank} + rope {m.qk_rope_head_dim}"
    else:
        shape = f"{m.attention.value.upper()} {m.num_kv_heads} KV heads x {m.head_dim}"
    return (f"model     {m.name}: {m.num_layers} layers, {shape}, "
            f"{plan.params / 1e9:,.2f} B params"
            + (f" ({plan.active_params / 1e9:,.2f} B active)" if plan.active_params
               != plan.params else ""))


def render_table(plan: Plan) -> str:
    """The default human-readable output of ``kvtier plan``."""
    p = plan.inputs
    lines = [
        _model_line(plan),
        f"hardware  {p.gpus} x {p.gpu.name} ({gb(p.gpu.memory_bytes)}), TP {p.tp}, "
        f"{plan.replicas} engine instance(s), memory utilization {p.mem_util:.2f}",
        f"workload  {p.concurrency} running sequences"
        + (f", trace {p.trace.path} ({p.trace.requests:,} requests)" if p.trace else "")
        + (f", max output {p.max_output:,} tokens" if p.max_output else ""),
        "",
        f"{'weights (' + plan.weights_dtype + ')':<24} {gb(plan.weights_bytes)} total, "
        f"{gb(plan.weights_bytes_per_gpu)} per GPU",
        f"{'KV per token (' + p.kv_dtype + ')':<24} {plan.kv_bytes_per_token:,} B"
        + (f" ({plan.kv_bytes_per_token_per_gpu:,} B per GPU)" if p.tp > 1 else ""),
        f"{'HBM left for KV per GPU':<24} {gb(plan.kv_budget_bytes_per_gpu)} "
        f"({p.mem_util:.2f} x {gb(p.gpu.memory_bytes)} - weights"
        + (f" - reserve {gb(p.reserve_bytes)}" if p.reserve_bytes else "") + ")",
        "",
        "percentile   tokens/seq   KV/seq       sequences that fit in HBM",
    ]
    for name in ("p50", "p95", "p99"):
        lines.append(f"{name.upper():<12} {plan.sequence_tokens[name]:>10,}   "
                     f"{gb(plan.kv_bytes_per_sequence[name]):>11}  "
                     f"{plan.max_sequences_in_hbm[name]:>8,}")
    lines += [
        "",
        f"KV needed at P99 x {p.concurrency}: {gb(plan.kv_demand_bytes_p99)} vs "
        f"{gb(plan.kv_pool_bytes)} of HBM KV pool; "
        + (f"{gb(plan.spill_bytes_p99)} (whole sequences) must spill"
           if plan.spill_bytes_p99 else "fits in HBM"),
        "",
        "recommended kvtier tiers (this node)",
    ]
    for tier in plan.tiers:
        size = gb(tier.bytes) if tier.bytes else "off"
        lines.append(f"  {tier.tier:<6} {size:>11}  {tier.why}")
    s = plan.prefill_saving
    lines += [
        "",
        f"prefix reuse {s['prefix_share']:.1%} of prompt tokens: prefill at P50 "
        f"({int(s['prompt_tokens_p50']):,} tokens) {s['prefill_flops_p50'] / 1e12:,.1f} TFLOP, "
        f"saves {s['saved_flops_p50'] / 1e12:,.1f} TFLOP "
        f"(~{s['saved_seconds_p50'] * 1e3:,.0f} ms of {s['prefill_seconds_p50'] * 1e3:,.0f} ms "
        "at 50% MFU)",
        f"decode step with {plan.decode_sequences_p99:,} P99 sequences per instance in HBM: "
        f">= {plan.decode_step_s_p99 * 1e3:,.1f} ms (weights + KV read from HBM each step)",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def to_json(plan: Plan) -> dict[str, Any]:
    """The ``--json`` document; byte counts are integers, shares are fractions."""
    p = plan.inputs
    m = p.model
    return {
        "model": {
            "name": m.name, "attention": m.attention.value, "layers": m.num_layers,
            "kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
            "kv_lora_rank": m.kv_lora_rank, "qk_rope_head_dim": m.qk_rope_head_dim,
            "sliding_window_layers": m.windowed_layers, "max_context": m.max_context,
            "params": plan.params, "active_params": plan.active_params,
        },
        "hardware": {"gpu": p.gpu.name, "gpu_memory_bytes": p.gpu.memory_bytes,
                     "gpus": p.gpus, "tp": p.tp, "replicas": plan.replicas,
                     "mem_util": p.mem_util, "reserve_bytes": p.reserve_bytes},
        "workload": {"concurrency": p.concurrency, "max_output": p.max_output,
                     "context": dict(p.context.items()),
                     "trace": p.trace.path if p.trace else None},
        "kv_dtype": p.kv_dtype,
        "weights_dtype": plan.weights_dtype,
        "weights_bytes": plan.weights_bytes,
        "weights_bytes_per_gpu": plan.weights_bytes_per_gpu,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "kv_bytes_per_token_per_gpu": plan.kv_bytes_per_token_per_gpu,
        "sequence_tokens": plan.sequence_tokens,
        "kv_bytes_per_sequence": plan.kv_bytes_per_sequence,
        "kv_budget_bytes_per_gpu": plan.kv_budget_bytes_per_gpu,
        "max_sequences_in_hbm": plan.max_sequences_in_hbm,
        "kv_pool_bytes": plan.kv_pool_bytes,
        "kv_demand_bytes_p99": plan.kv_demand_bytes_p99,
        "spill_bytes_p99": plan.spill_bytes_p99,
        "tiers": {t.tier: {"bytes": t.bytes, "why": t.why} for t in plan.tiers},
        "prefill_saving": plan.prefill_saving,
        "decode_step_seconds_p99": plan.decode_step_s_p99,
        "decode_sequences_p99": plan.decode_sequences_p99,
        "notes": list(plan.notes),
    }
