"""KV-cache and weights arithmetic.

KV bytes = layers x tokens x KV width x bytes per element, where the KV width of a
layer is 2 x kv_heads x head_dim for MHA/GQA/MQA (K and V, KV heads not attention
heads) and kv_lora_rank + qk_rope_head_dim for MLA (one latent, no separate K and V).
A sliding-window (or chunked) layer holds at most its window of tokens, and the linear
attention, SSM and MLP-only layers of hybrid models hold none. Under tensor parallelism
KV heads are split across ranks (replicated when there are fewer KV heads than ranks)
while an MLA latent is held whole by every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.plan.errors import PlanError
from kvtier.plan.model import AttentionKind, ModelSpec

#: Bytes per element of the dtypes ``--kv-dtype`` and ``--weights-dtype`` accept.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
    "int8": 1, "int4": 0.5,
}
_DTYPE_ALIASES: dict[str, str] = {
    "float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16", "float8": "fp8", "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2",
}
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2")


def normalize_dtype(name: str) -> str:
    """Canonical short dtype name (``bfloat16`` -> ``bf16``); PlanError when unknown."""
    key = name.strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise PlanError(f"unknown dtype {name!r}; use one of {', '.join(DTYPE_BYTES)}")
    return key


def serving_dtype(model: ModelSpec) -> str:
    """The dtype an engine serves the weights in by default (vLLM's ``--dtype auto``).

    fp8-quantized checkpoints stay fp8; fp32 checkpoints are served in bf16.
    """
    if model.quantization == "fp8":
        return "fp8"
    dtype = normalize_dtype(model.torch_dtype) if model.torch_dtype else "bf16"
    return "bf16" if dtype == "fp32" else dtype


def kv_width(model: ModelSpec) -> int:
    """Elements of KV one token adds to one layer (K and V together, or the MLA latent)."""
    if model.attention is AttentionKind.MLA:
        return model.kv_lora_rank + model.qk_rope_head_dim
    return 2 * model.num_kv_heads * model.head_dim


def kv_bytes_per_token(model: ModelSpec, kv_dtype: str) -> int:
    """KV bytes of one token over all layers that hold KV, for the whole model (all TP
    ranks)."""
    return int(model.kv_layers * kv_width(model) * DTYPE_BYTES[normalize_dtype(kv_dtype)])


def check_tensor_parallel(model: ModelSpec, tp: int) -> None:
    """Reject TP sizes an engine cannot shard this model's heads over."""
    if tp <= 0:
        raise PlanError(f"--tp must be positive, got {tp}")
    if model.num_attention_heads % tp:
        raise PlanError(f"--tp {tp} does not divide num_attention_heads="
                        f"{model.num_attention_heads}; pick a divisor")
    kv = model.num_kv_heads
    if model.attention is not AttentionKind.MLA and (kv % tp if kv >= tp else tp % kv):
        raise PlanError(f"--tp {tp} cannot shard num_key_value_heads={kv}: "
                        "KV heads and TP size must divide one another")


def kv_share_per_rank(model: ModelSpec, tp: int) -> float:
    """Fraction of the model's per-token KV that one TP rank holds."""
    if model.attention is AttentionKind.MLA:
        return 1.0  # every rank keeps the whole latent
    heads_per_rank = max(1, model.num_kv_heads // tp)
    return heads_per_rank / model.num_kv_heads


def round_to_block(tokens: int, block_tokens: int) -> int:
    """Tokens an engine allocates for ``tokens``: whole pages of ``block_tokens``."""
    if block_tokens <= 1:
        return tokens
    return math.ceil(tokens / block_tokens) * block_tokens


def kv_bytes_per_sequence(model: ModelSpec, kv_dtype: str, tokens: int,
                          block_tokens: int = 16) -> int:
    """KV bytes one sequence of ``tokens`` holds across the model, windows honoured."""
    if tokens < 0:
        raise PlanError(f"a sequence cannot have {tokens} tokens")
    per_layer = kv_width(model) * DTYPE_BYTES[normalize_dtype(kv_dtype)]
    total = 0.0
    for window in model.layer_windows:
        held = tokens if window is None else min(tokens, window)
        total += round_to_block(held, block_tokens) * per_layer
    return int(total)


@dataclass(frozen=True, slots=True)
class ParamCount:
    """Parameter counts: ``total`` is stored, ``active`` is used per token (MoE)."""

    total: int
    active: int


def _attention_params(m: ModelSpec) -> int:
    h = m.hidden_size
    if m.attention is AttentionKind.MLA:
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        heads = m.num_attention_heads
        if m.q_lora_rank:
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * qk_dim
        else:
            q = h * heads * qk_dim
        kv = (h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
              + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim))
        return q + kv + heads * m.v_head_dim * h
    q_out = m.num_attention_heads * m.head_dim
    kv_out = m.num_kv_heads * m.head_dim
    bias = (q_out + 2 * kv_out) if m.attention_bias else 0
    return h * q_out + 2 * h * kv_out + q_out * h + bias


def estimate_params(model: ModelSpec) -> ParamCount:
    """Count parameters from the architecture (gated MLP, MoE experts, MLA projections).

    Within about 1% of the published counts for the presets; used for weights memory
    (``total``) and prefill FLOPs (``active``, 2 FLOPs per active parameter per token).
    """
    m = model
    h = m.hidden_size
    embed = m.vocab_size * h * (1 if m.tie_embeddings else 2)
    attn = _attention_params(m)
    norms = 2 * h
    dense_mlp = 3 * h * m.intermediate_size
    total = active = embed + h  # final norm
    for layer in range(m.num_layers):
        base = attn + norms
        if m.moe is None or layer < m.moe.dense_layers:
            total += base + dense_mlp
            active += base + dense_mlp
            continue
        expert = 3 * h * m.moe.expert_intermediate
        router = h * m.moe.routed_experts
        total += base + router + expert * (m.moe.routed_experts + m.moe.shared_experts)
        active += base + router + expert * (m.moe.active_experts + m.moe.shared_experts)
    return ParamCount(total=int(total), active=int(active))
