"""KV-cache and weights arithmetic.

KV bytes = layers x tokens x KV width x bytes per element, where the KV width of a
layer is 2 x kv_heads x head_dim for MHA/GQA/MQA (K and V, KV heads not attention
heads) and kv_lora_rank + qk_rope_head_dim for MLA (one latent, no separate K and V),
plus, with DeepSeek-V3.2's sparse attention, the indexer's fp8 key and scales
(kvtier.plan.indexer), which do not follow ``--kv-dtype``. That sparse MLA with
``--kv-dtype fp8`` is stored in vLLM's ``fp8_ds_mla`` layout, 656 B per token per layer.
A sliding-window (or chunked) layer holds at most its window of tokens, and the linear
attention, SSM and MLP-only layers of hybrid models hold none. Under tensor parallelism
KV heads are split across ranks (replicated when there are fewer KV heads than ranks)
while an MLA latent is held whole by every rank.

Weights bytes = parameters counted from the architecture, by part (embeddings, attention
and dense MLPs, MoE experts), each part at the width the checkpoint's quantization gives
it (kvtier.plan.quant), or every part at ``--weights-dtype``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.plan.blocks import FULL, LINEAR
from kvtier.plan.errors import PlanError
from kvtier.plan.indexer import indexer_bytes
from kvtier.plan.layers import NO_KV
from kvtier.plan.model import AttentionKind, ModelSpec

#: Bytes per element of the dtypes ``--kv-dtype`` and ``--weights-dtype`` accept. nvfp4
#: KV (vLLM's packed layout: head/2 bytes of 4-bit values + head/16 fp8 scales) is 9/16.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
    "int8": 1, "int4": 0.5, "nvfp4": 9 / 16,
}
_DTYPE_ALIASES: dict[str, str] = {
    "float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16", "float8": "fp8", "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2",
}
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4")
"""What ``--kv-dtype`` takes (vLLM's --kv-cache-dtype has no int8 or int4 KV)."""
WEIGHT_DTYPES = ("fp32", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
"""What ``--weights-dtype`` takes."""
NO_KV_REPLICATION = frozenset({"gpt_oss"})
"""Model types whose vLLM attention splits KV heads over TP ranks without replicating
them (gpt_oss.py: ``num_key_value_heads // tp_size`` KV heads per rank), so the TP size
must divide the KV heads: at TP 16 gpt-oss's 8 KV heads leave a rank none."""


def normalize_dtype(name: str, allowed: tuple[str, ...] = tuple(DTYPE_BYTES),
                    what: str = "dtype") -> str:
    """Canonical short dtype name (``bfloat16`` -> ``bf16``); PlanError naming ``what``
    and the names it takes when not one of ``allowed``."""
    key = name.strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in allowed:
        raise PlanError(f"unknown {what} {name!r}; use one of {', '.join(allowed)}")
    return key


def serving_dtype(model: ModelSpec) -> str:
    """The dtype an engine serves the weights no quantization narrows in (vLLM's ``--dtype
    auto``): the checkpoint's 16-bit dtype; fp32 and fp8 ones are served in bf16.

    A quantization narrows only the layers it quantizes (kvtier.plan.quant): vLLM's fp8
    methods quantize linear layers and experts, and leave the embeddings, the LM head and
    the norms at this dtype.
    """
    dtype = normalize_dtype(model.torch_dtype) if model.torch_dtype else "bf16"
    return dtype if dtype in ("fp16", "bf16") else "bf16"


def kv_width(model: ModelSpec, layer: int = 0) -> int:
    """Elements of KV one token adds to layer ``layer`` (K and V together, or the MLA
    latent); layers differ only where the model gives them other heads (Gemma-4)."""
    if model.attention is AttentionKind.MLA:
        return model.kv_lora_rank + model.qk_rope_head_dim
    kv, head = model.shape(layer)
    return 2 * kv * head


#: Bytes per token per layer of vLLM's ``fp8_ds_mla`` cache (MLAAttention's
#: ``state_content_bytes``): the 512 NoPE latent values in fp8, an fp32 scale per 128 of
#: them and the 64 RoPE values in bf16, 512 + 16 + 128, fixed whatever the model's dims.
FP8_DS_MLA_BYTES = 656


def is_fp8_ds_mla(model: ModelSpec, kv_dtype: str) -> bool:
    """Whether vLLM 0.32 stores the model's latent as ``fp8_ds_mla``: sparse MLA
    (DeepSeek-V3.2) with ``--kv-cache-dtype fp8``, which on Hopper only FlashMLA's sparse
    backend takes, and serves in that layout. ``fp8_e4m3`` is not a dtype it takes:
    FlashInfer's sparse backend serves that one as a plain fp8 latent."""
    return model.sparse_mla and normalize_dtype(kv_dtype) == "fp8"


def kv_layer_bytes(model: ModelSpec, kv_dtype: str, layer: int = 0) -> float:
    """Bytes of KV one token adds to layer ``layer`` (the indexer's keys apart)."""
    if is_fp8_ds_mla(model, kv_dtype):
        return FP8_DS_MLA_BYTES
    return kv_width(model, layer) * DTYPE_BYTES[normalize_dtype(kv_dtype)]


def _layer_bytes(model: ModelSpec, kv_dtype: str) -> list[float]:
    """Per layer, the KV bytes one token adds (0 for a layer without KV)."""
    return [0.0 if w == NO_KV else kv_layer_bytes(model, kv_dtype, i)
            for i, w in enumerate(model.layer_windows)]


def kv_bytes_per_token(model: ModelSpec, kv_dtype: str) -> int:
    """KV bytes of one token over all layers that hold KV, for the whole model (all TP
    ranks), with a sparse-attention indexer's keys where layers keep them."""
    return int(sum(_layer_bytes(model, kv_dtype))
               + sum(model.indexer_layers) * indexer_bytes(model.index_head_dim))


def check_tensor_parallel(model: ModelSpec, tp: int) -> None:
    """Reject TP sizes an engine cannot shard this model's heads over."""
    if tp <= 0:
        raise PlanError(f"--tp must be positive, got {tp}")
    if model.num_attention_heads % tp:
        raise PlanError(f"--tp {tp} does not divide num_attention_heads="
                        f"{model.num_attention_heads}; pick a divisor")
    if model.attention is AttentionKind.MLA:
        return
    for kv in sorted({model.shape(i)[0] for i in range(model.num_layers)}):
        if model.model_type in NO_KV_REPLICATION and kv % tp:
            raise PlanError(f"--tp {tp} cannot run {model.model_type}: vLLM splits its "
                            f"num_key_value_heads={kv} over the TP ranks without copying "
                            "them, so the TP size must divide them")
        if kv % tp if kv >= tp else tp % kv:
            raise PlanError(f"--tp {tp} cannot shard num_key_value_heads={kv}: "
                            "KV heads and TP size must divide one another")


def kv_share_per_rank(model: ModelSpec, tp: int) -> float:
    """Fraction of the model's per-token KV that one TP rank holds: per layer, its share
    of that layer's KV heads (replicated when fewer than ranks), weighted by the layer's
    bytes where layers differ (Gemma-4)."""
    if model.attention is AttentionKind.MLA:
        return 1.0  # every rank keeps the whole latent
    if not model.layer_shapes:
        return max(1, model.num_kv_heads // tp) / model.num_kv_heads
    sizes = _layer_bytes(model, "bf16")
    held = sum(b * max(1, model.shape(i)[0] // tp) / model.shape(i)[0]
               for i, b in enumerate(sizes))
    return held / sum(sizes)


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
    per_layer = _layer_bytes(model, kv_dtype)
    indexer = indexer_bytes(model.index_head_dim)
    total = 0.0
    for layer, window in enumerate(model.layer_windows):
        held = round_to_block(tokens if window is None else min(tokens, window), block_tokens)
        total += held * per_layer[layer]
        if layer < len(model.indexer_layers) and model.indexer_layers[layer]:
            total += held * indexer
    return int(total)


@dataclass(frozen=True, slots=True)
class ParamCount:
    """Parameter counts: ``total`` is stored, ``active`` is used per token (MoE).

    The parts of ``total``, which quantization stores differently: ``embeddings`` (token
    embeddings and the LM head, once when tied), ``experts`` (every MoE expert's MLP, shared
    ones included) and ``dense`` (the rest: attention, dense MLPs, routers, norms).
    """

    total: int
    active: int
    embeddings: int
    experts: int

    @property
    def dense(self) -> int:
        """Attention, dense MLPs, routers and norms."""
        return self.total - self.embeddings - self.experts


@dataclass(frozen=True, slots=True)
class WeightsFormat:
    """Bytes per parameter of each part of the weights, and what the plan calls it."""

    label: str
    embed_bytes: float
    dense_bytes: float
    expert_bytes: float

    @property
    def uniform(self) -> bool:
        """Every part at the same width (no quantization, or ``--weights-dtype``)."""
        return self.embed_bytes == self.dense_bytes == self.expert_bytes


def _uniform(dtype: str) -> WeightsFormat:
    size = DTYPE_BYTES[dtype]
    return WeightsFormat(dtype, size, size, size)


def weights_format(model: ModelSpec, dtype: str | None = None) -> WeightsFormat:
    """How the weights are stored: ``dtype`` (``--weights-dtype``) for every part when
    given, else the checkpoint's quantization over its dtype; PlanError for a quantization
    the plan does not model (kvtier.plan.quant)."""
    if dtype:
        return _uniform(normalize_dtype(dtype, WEIGHT_DTYPES, "--weights-dtype"))
    base = serving_dtype(model)
    q = model.quantization
    if q is None:
        return _uniform(base)
    if q.problem:
        raise PlanError(q.problem)
    if q.linear_bits is None and model.moe is None:
        raise PlanError(f"{model.name}: quantization_config quant_method {q.method!r} "
                        "quantizes MoE experts and this model has none; pass --weights-dtype")
    size = DTYPE_BYTES[base]
    dense = size if q.linear_bits is None else q.linear_bits / 8
    experts = dense if q.expert_bits is None else q.expert_bits / 8
    embed = size if q.embed_bits is None else q.embed_bits / 8
    label = q.label if q.linear_bits is not None else f"{q.label}, {base} rest"
    return WeightsFormat(label, embed, dense, experts)


def weights_bytes(count: ParamCount, fmt: WeightsFormat, params: int | None = None) -> int:
    """Bytes of the weights; ``params`` (``--params``) rescales the counted parts."""
    params = params or count.total
    if fmt.uniform:
        return int(params * fmt.dense_bytes)
    counted = (count.embeddings * fmt.embed_bytes + count.dense * fmt.dense_bytes
               + count.experts * fmt.expert_bytes)
    return round(counted * params / count.total)


def _attention_params(m: ModelSpec, layer: int = 0) -> int:
    """One layer's attention weights: MLA projections wherever the config has them (also
    MiniCPM3's, which vLLM caches as plain attention), else Q, K, V and O at the layer's
    own head size and KV heads (Gemma-4's global layers)."""
    h = m.hidden_size
    if m.kv_lora_rank:
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        heads = m.num_attention_heads
        if m.q_lora_rank:
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * qk_dim
        else:
            q = h * heads * qk_dim
        kv = (h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
              + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim))
        return q + kv + heads * m.v_head_dim * h
    kv_heads, head_dim = m.shape(layer)
    q_width = m.num_attention_heads * head_dim
    q_out = q_width * (2 if m.attn_output_gate else 1)   # a gate projected as wide as Q
    kv_out = kv_heads * head_dim
    bias = (q_out + 2 * kv_out) if m.attention_bias else 0
    return h * q_out + 2 * h * kv_out + q_width * h + bias


def _mlp_params(m: ModelSpec, width: int) -> int:
    """One MLP: gate, up and down matrices, or up and down where it is not gated."""
    return (3 if m.gated_mlp else 2) * m.hidden_size * width


def _block_params(m: ModelSpec) -> int:
    """A DeciLM stack's layers, each as its block says (kvtier.plan.blocks), with the
    norm in front of every sub-layer it keeps."""
    h = m.hidden_size
    attn = _attention_params(m)
    total = 0
    for b in m.blocks:
        total += {FULL: attn + h, LINEAR: h * h + h}.get(b.attention, 0)
        total += {FULL: _mlp_params(m, b.ffn_width) + h, LINEAR: h * h + h}.get(b.ffn, 0)
    return total


def estimate_params(model: ModelSpec) -> ParamCount:
    """Count parameters from the architecture (gated MLP, MoE experts, MLA projections).

    Within about 1% of the published counts for the presets; used for weights memory
    (``total``, by part) and prefill FLOPs (``active``, 2 FLOPs per active parameter per
    token). A config without ``vocab_size`` counts no embeddings.
    """
    m = model
    h = m.hidden_size
    embed = m.vocab_size * h * (1 if m.tie_embeddings else 2) + m.side.embeddings
    dense = h + m.side.dense  # final norm, and the weights beside the layers
    experts = active_experts = 0
    if m.blocks:
        dense += _block_params(m)
        return ParamCount(total=embed + dense, active=embed + dense, embeddings=embed,
                          experts=0)
    dense_mlp = _mlp_params(m, m.intermediate_size)
    mix = m.mixers
    for layer in range(m.num_layers):
        attention = _attention_params(m, layer)
        mixer = (attention if mix is None or mix.attention[layer] else 0) + (
            mix.state[layer] if mix else 0)
        has_mlp = mix is None or mix.mlp[layer]
        dense += mixer + h * (1 + (has_mlp and mixer > 0))  # a norm before each block
        if not has_mlp:
            continue
        if m.moe is None or not m.moe.moe_layers[layer]:
            dense += dense_mlp
            continue
        expert = _mlp_params(m, m.moe.expert_intermediate)
        shared = _mlp_params(m, m.moe.shared_intermediate)
        dense += h * m.moe.routed_experts  # the router
        experts += expert * m.moe.routed_experts + shared
        active_experts += expert * m.moe.active_experts + shared
    # the last layers reading an earlier layer's KV (Gemma-3n) have a Q projection only
    kv_out = m.num_kv_heads * m.head_dim
    dense -= m.shared_kv_layers * (2 * h * kv_out + (2 * kv_out if m.attention_bias else 0))
    return ParamCount(total=embed + dense + experts, active=embed + dense + active_experts,
                      embeddings=embed, experts=experts)
