"""ModelSpec: what the planner needs to know about a model, read from a config.json.

A spec is built from the fields of a Hugging Face ``config.json`` (a user's file or a
built-in preset, which is stored in the same form), so both paths give the same numbers.
It records the attention kind (MHA, GQA/MQA, MLA), which layers use a sliding window,
and enough of the architecture to count parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from kvtier import jsonin
from kvtier.plan.errors import PlanError
from kvtier.plan.layers import NO_KV, layer_reach
from kvtier.plan.presets import find_preset, preset_names


class AttentionKind(str, Enum):
    """How a layer's KV is shaped: separate K and V per KV head, or one MLA latent."""

    MHA = "mha"  # one KV head per attention head
    GQA = "gqa"  # fewer KV heads than attention heads (MQA when there is one)
    MLA = "mla"  # DeepSeek: compressed latent + decoupled rope key, no separate K and V


@dataclass(frozen=True, slots=True)
class MoESpec:
    """Mixture-of-experts shape; ``dense_layers`` lead with a plain MLP (DeepSeek)."""

    routed_experts: int
    active_experts: int
    shared_experts: int
    expert_intermediate: int
    dense_layers: int


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The model geometry the KV and weights arithmetic reads.

    ``layer_windows`` holds, per layer, how many tokens of KV it keeps at most: ``None``
    for full attention, a window (sliding or chunked attention), or ``NO_KV`` (0) for a
    layer without attention KV (kvtier.plan.layers); ``state_layers`` of them carry a
    fixed-size recurrent state per sequence instead (linear attention, SSM, convolution).
    """

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    torch_dtype: str
    tie_embeddings: bool
    attention: AttentionKind
    layer_windows: tuple[int | None, ...]
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    moe: MoESpec | None = None
    attention_bias: bool = False
    quantization: str | None = None
    state_layers: int = 0

    @property
    def windowed_layers(self) -> int:
        """How many layers keep a bounded window of KV (sliding or chunked attention)."""
        return sum(1 for w in self.layer_windows if w is not None and w != NO_KV)

    @property
    def kv_layers(self) -> int:
        """How many layers hold attention KV at all."""
        return sum(1 for w in self.layer_windows if w != NO_KV)


MAX_LAYERS = 10_000
"""Most layers a config may declare (the plan keeps a window per layer)."""
MAX_DIM = 2**31
"""Largest size, head count or vocabulary a config may declare."""
MAX_EXPERTS = 1 << 16
"""Most experts a config may declare (MoE models have hundreds)."""


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int_field(cfg: dict[str, Any], key: str, source: str, low: int, high: int) -> int | None:
    """``cfg[key]``: None when absent or null, else an integer from ``low`` to ``high``
    (PlanError naming the field otherwise: a float, a string, a bool, a negative or an
    absurd size would make the arithmetic wrong or unbounded)."""
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PlanError(f"{source}: config field {key!r} must be an integer from {low:,} to "
                        f"{high:,}, got {_brief(value)}")
    return value


def _require_int(cfg: dict[str, Any], key: str, source: str, high: int = MAX_DIM) -> int:
    """A field the plan cannot do without: an integer from 1 to ``high``."""
    value = _int_field(cfg, key, source, 1, high)
    if value is None:
        raise PlanError(f"{source}: config field {key!r} is missing; it must be an integer "
                        f"from 1 to {high:,}")
    return value


def _opt_int(cfg: dict[str, Any], key: str, source: str, default: int = 0, *, low: int = 0,
             high: int = MAX_DIM) -> int:
    """An optional field: ``default`` when absent, null or 0 (how real configs say "not
    set", e.g. a dense model's ``num_local_experts``), else an integer up to ``high``;
    ``low=1`` where 0 makes no sense (``num_key_value_heads``)."""
    return _int_field(cfg, key, source, low, high) or default


def spec_from_config(cfg: dict[str, Any], name: str = "") -> ModelSpec:
    """Build a ModelSpec from the fields of a Hugging Face config.json.

    Multimodal configs that nest the language model under ``text_config`` are unwrapped.
    Raises PlanError naming the missing or malformed field.
    """
    if not isinstance(cfg, dict):
        raise PlanError(f"{name or 'config'}: expected a JSON object, got {type(cfg).__name__}")
    if isinstance(cfg.get("text_config"), dict) and "num_hidden_layers" not in cfg:
        inner = dict(cfg["text_config"])
        inner.setdefault("torch_dtype", cfg.get("torch_dtype"))
        cfg = inner
    source = name or str(cfg.get("_name_or_path") or "config.json")
    layers = _require_int(cfg, "num_hidden_layers", source, MAX_LAYERS)
    hidden = _require_int(cfg, "hidden_size", source)
    heads = _require_int(cfg, "num_attention_heads", source)
    kv_heads = _opt_int(cfg, "num_key_value_heads", source, heads, low=1)
    head_dim = _opt_int(cfg, "head_dim", source, hidden // heads, low=1)
    if head_dim < 1:
        raise PlanError(f"{source}: hidden_size={hidden} is smaller than "
                        f"num_attention_heads={heads}; the config must give head_dim")
    kv_lora = _opt_int(cfg, "kv_lora_rank", source)
    if kv_lora:
        attention = AttentionKind.MLA
    elif kv_heads == heads:
        attention = AttentionKind.MHA
    else:
        attention = AttentionKind.GQA
    if attention is not AttentionKind.MLA and heads % kv_heads:
        raise PlanError(f"{source}: num_attention_heads={heads} is not a multiple of "
                        f"num_key_value_heads={kv_heads}")
    routed = (_opt_int(cfg, "n_routed_experts", source, high=MAX_EXPERTS)
              or _opt_int(cfg, "num_local_experts", source, high=MAX_EXPERTS)
              or _opt_int(cfg, "num_experts", source, high=MAX_EXPERTS))
    moe = None
    if routed:
        moe = MoESpec(
            routed_experts=routed,
            active_experts=_opt_int(cfg, "num_experts_per_tok", source, 1, low=1,
                                    high=routed),
            shared_experts=_opt_int(cfg, "n_shared_experts", source, high=MAX_EXPERTS),
            expert_intermediate=_opt_int(cfg, "moe_intermediate_size", source,
                                         _require_int(cfg, "intermediate_size", source)),
            dense_layers=_opt_int(cfg, "first_k_dense_replace", source, high=layers),
        )
    reach = layer_reach(cfg, layers, source)
    if reach.reach.count(NO_KV) == layers:
        raise PlanError(f"{source}: no layer holds attention KV (every layer is linear "
                        "attention, SSM, convolution or MLP): there is no KV to plan")
    quant = cfg.get("quantization_config")
    quant_method = str(quant.get("quant_method")) if isinstance(quant, dict) else None
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return ModelSpec(
        name=source,
        model_type=str(cfg.get("model_type", "")),
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=_opt_int(cfg, "intermediate_size", source, 4 * hidden),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_require_int(cfg, "vocab_size", source),
        max_context=_opt_int(cfg, "max_position_embeddings", source),
        torch_dtype=dtype,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention=attention,
        layer_windows=reach.reach,
        state_layers=reach.state_layers,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=_opt_int(cfg, "qk_rope_head_dim", source),
        q_lora_rank=_opt_int(cfg, "q_lora_rank", source),
        qk_nope_head_dim=_opt_int(cfg, "qk_nope_head_dim", source),
        v_head_dim=_opt_int(cfg, "v_head_dim", source),
        moe=moe,
        attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        quantization=quant_method,
    )


def load_model(ref: str) -> ModelSpec:
    """Resolve ``--model``: a preset name, a config.json path, or a folder holding one."""
    fields = find_preset(ref)
    if fields is not None:
        return spec_from_config(fields, name=ref.strip().lower())
    path = Path(ref)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanError(f"unknown model {ref!r}: not a preset and no config.json there; "
                        f"presets: {', '.join(preset_names())}")
    try:
        cfg = jsonin.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:   # (UnicodeDecodeError is a ValueError)
        raise PlanError(f"cannot read model config {path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"model config {path}: expected a JSON object, got a JSON "
                        f"{type(cfg).__name__}")
    return spec_from_config(cfg, name=str(cfg.get("_name_or_path") or path))
