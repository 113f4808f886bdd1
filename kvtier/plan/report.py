"""The plan's model line and its ``--json`` document (the tables: plan.cli.print_plan)."""

from __future__ import annotations

from typing import Any

from kvtier.plan.layers import NO_KV
from kvtier.plan.model import AttentionKind, ModelSpec
from kvtier.plan.planner import DAEMON_BYTES_PER_BLOCK, Plan


def gb(n: float) -> str:
    """Bytes as decimal gigabytes, the unit GPU and disk datasheets use."""
    return f"{n / 1e9:,.2f} GB"


def model_line(plan: Plan) -> str:
    """The model, its layers and KV shape(s), and its parameter count."""
    m = plan.inputs.model
    if m.attention is AttentionKind.MLA:
        shape = f"MLA latent {m.kv_lora_rank} + rope {m.qk_rope_head_dim}"
    else:
        shape = f"{m.attention.value.upper()} " + " / ".join(
            f"{s['kv_heads']} KV heads x {s['head_dim']}"
            + (f" ({s['layers']} layers)" if m.layer_shapes else "") for s in kv_shapes(m))
    layers = (f"{m.num_layers} layers" if m.kv_layers == m.num_layers
              else f"{m.num_layers} layers ({m.kv_layers} with KV)")
    return (f"model     {m.name}: {layers}, {shape}, "
            f"{plan.params / 1e9:,.2f} B params"
            + (f" ({plan.active_params / 1e9:,.2f} B active)" if plan.active_params
               != plan.params else ""))


def kv_shapes(m: ModelSpec) -> list[dict[str, int]]:
    """The KV cache's shapes as vLLM's KV cache spec gives them: per distinct (KV heads,
    head size), how many layers hold it. An MLA latent is one head of kv_lora_rank +
    qk_rope_head_dim values (vLLM's MLAAttentionSpec), not the attention heads."""
    counts: dict[tuple[int, int], int] = {}
    for i, w in enumerate(m.layer_windows):
        if w != NO_KV:
            shape = ((1, m.kv_lora_rank + m.qk_rope_head_dim)
                     if m.attention is AttentionKind.MLA else m.shape(i))
            counts[shape] = counts.get(shape, 0) + 1
    return [{"kv_heads": kv, "head_dim": dim, "layers": n} for (kv, dim), n in counts.items()]


def to_json(plan: Plan) -> dict[str, Any]:
    """The ``--json`` document; byte counts are integers, shares are fractions.
    ``model.kv_heads`` and ``model.head_dim`` describe the KV cache of the first layer
    that holds KV (an MLA latent: 1 head of latent + rope), ``model.kv_shapes`` all."""
    p = plan.inputs
    m = p.model
    shapes = kv_shapes(m)
    return {
        "model": {
            "name": m.name, "attention": m.attention.value, "layers": m.num_layers,
            "kv_heads": shapes[0]["kv_heads"], "head_dim": shapes[0]["head_dim"],
            "kv_shapes": shapes,
            "kv_lora_rank": m.kv_lora_rank, "qk_rope_head_dim": m.qk_rope_head_dim,
            "sliding_window_layers": m.windowed_layers, "kv_layers": m.kv_layers,
            "state_layers": m.state_layers, "max_context": m.max_context,
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
        "stored_copies": plan.stored_copies,
        "daemon_memory": {"bytes": plan.daemon_memory_bytes, "blocks": plan.daemon_blocks,
                          "block_tokens": plan.kvtier_block_tokens,
                          "bytes_per_block": DAEMON_BYTES_PER_BLOCK},
        "prefill_saving": plan.prefill_saving,
        "decode_step_seconds_p99": plan.decode_step_s_p99,
        "decode_sequences_p99": plan.decode_sequences_p99,
        "notes": list(plan.notes),
    }
