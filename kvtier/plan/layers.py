"""How far back each layer of a model keeps KV, read from a Hugging Face config.json.

A layer's *reach* is ``None`` (full attention: every token's KV), a positive number of
tokens (sliding or chunked attention keeps at most that many), or ``NO_KV`` (a layer without
attention KV: linear attention, SSM or short convolution, whose state has a fixed size per
sequence, or an MLP-only layer of a hybrid stack). Hybrid models (Qwen3-Next, Jamba,
Nemotron-H, Granite 4, LFM2, MiniMax) hold KV in a few of their layers only, so counting
every layer would plan several times the KV they need.

Names follow Transformers' ``layer_types`` vocabulary; older configs spell the same pattern
in per-architecture fields, read here too. A layer type not known here counts as full
attention: an unknown layer never makes the plan smaller than the KV can be.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.plan.errors import PlanError
from kvtier.plan.hybrid import hybrid_types

NO_KV = 0

_WINDOWED = frozenset({"sliding_attention", "hybrid_sliding", "local_attention", "local",
                       "window_attention"})
_CHUNKED = frozenset({"chunked_attention"})
_STATE = frozenset({"linear_attention", "mamba", "mamba2", "conv", "short_conv",
                    "recurrent"})  # a fixed-size state per sequence instead of KV
_STATE_AND_KV = frozenset({"hybrid", "hybrid_sliding"})  # attention beside such a state
_MLP_ONLY = frozenset({"moe", "mlp", "dense", "sparse"})
_NEMOTRON = {"M": "mamba", "E": "moe", "*": "full_attention", "-": "mlp"}


@dataclass(frozen=True, slots=True)
class LayerReach:
    """Per-layer reach (see the module doc) and how many layers carry a recurrent state."""

    reach: tuple[int | None, ...]
    state_layers: int


def _positive(cfg: dict[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def _every(layers: int, interval: int, hit: str, other: str) -> list[str]:
    """``hit`` on every ``interval``-th layer (1-based), ``other`` elsewhere."""
    return [hit if (i + 1) % interval == 0 else other for i in range(layers)]


def _types_from_fields(cfg: dict[str, Any], layers: int) -> list[str] | None:
    """The layer types older configs spell in per-architecture fields; None: no pattern."""
    model_type = str(cfg.get("model_type", ""))
    hybrid = hybrid_types(cfg, layers)
    if hybrid is not None:
        return hybrid
    pattern = cfg.get("hybrid_override_pattern")  # Nemotron-H: one character per layer
    if isinstance(pattern, str) and pattern and set(pattern) <= set(_NEMOTRON):
        return [_NEMOTRON[c] for c in pattern]
    kinds = cfg.get("attn_type_list")  # MiniMax: 1 softmax attention, 0 lightning (linear)
    if isinstance(kinds, list) and kinds:
        return ["full_attention" if k == 1 else "linear_attention" for k in kinds]
    if model_type.startswith("llama4") and _positive(cfg, "attention_chunk_size"):
        no_rope = cfg.get("no_rope_layers")  # 1: a RoPE layer, chunked; 0: NoPE, global
        if not (isinstance(no_rope, list) and no_rope):
            interval = _positive(cfg, "no_rope_layer_interval") or 4
            no_rope = [int((i + 1) % interval != 0) for i in range(layers)]
        return ["chunked_attention" if r else "full_attention" for r in no_rope]
    if model_type == "qwen3_next" or _positive(cfg, "full_attention_interval"):
        interval = _positive(cfg, "full_attention_interval") or 4
        return _every(layers, interval, "full_attention", "linear_attention")
    if model_type == "jamba" or _positive(cfg, "attn_layer_period"):
        period = _positive(cfg, "attn_layer_period") or 8
        offset = cfg.get("attn_layer_offset")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            offset = 4
        return ["full_attention" if i % period == offset else "mamba" for i in range(layers)]
    ids = cfg.get("hybrid_layer_ids")  # Zamba2: Mamba layers, a shared block in these
    if model_type == "zamba2" and isinstance(ids, list):
        return ["hybrid" if i in ids else "mamba" for i in range(layers)]
    indices = cfg.get("attn_layer_indices")  # Bamba: attention in the listed layers
    if model_type == "bamba" and isinstance(indices, list):
        return ["full_attention" if i in indices else "mamba" for i in range(layers)]
    if model_type == "lfm2" and isinstance(cfg.get("full_attn_idxs"), list):
        full = set(cfg["full_attn_idxs"])
        return ["full_attention" if i in full else "conv" for i in range(layers)]
    if _positive(cfg, "sliding_window") is None:
        return None
    if "use_sliding_window" in cfg or model_type.startswith(("qwen2", "qwen3")):
        # Qwen2 and every config that copies its fields (Qwen2-VL, Qwen2.5-VL, Qwen3, their
        # MoE and text_config forms): sliding_window is only a size; use_sliding_window
        # (default false) switches it on, for the layers from max_window_layers on. Read
        # the switch for any model type: the size alone would plan a fraction of the KV.
        first = _positive(cfg, "max_window_layers") or layers
        sliding = cfg.get("use_sliding_window") is True
        return ["sliding_attention" if sliding and i >= first else "full_attention"
                for i in range(layers)]
    every = _positive(cfg, "sliding_window_pattern")  # Gemma 3, Cohere 2: every n-th global
    if every is None:
        every = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4, "gemma4_text": 6,
                 "gemma4_unified_text": 6}.get(model_type)
    if every is not None:
        return _every(layers, every, "full_attention", "sliding_attention")
    return None


def layer_types(cfg: dict[str, Any], layers: int, source: str) -> list[str] | None:
    """Each layer's type, from ``layer_types`` or the older per-architecture fields; None
    when every layer is of one kind."""
    types = cfg.get("layer_types")
    if not isinstance(types, list) or not types:
        types = cfg.get("layers_block_type")  # Jamba, Bamba, Falcon-H1, Zamba 2
    if isinstance(types, list) and types:
        if len(types) != layers:
            raise PlanError(f"{source}: config field 'layer_types' has {len(types)} entries "
                            f"for num_hidden_layers={layers}")
    else:
        types = _types_from_fields(cfg, layers)
        if types is not None and len(types) != layers:
            raise PlanError(f"{source}: the layer pattern has {len(types)} layers for "
                            f"num_hidden_layers={layers}")
    return None if types is None else [str(t) for t in types]


def layer_reach(cfg: dict[str, Any], layers: int, source: str) -> LayerReach:
    """Each layer's reach, from ``layer_types`` or the older per-architecture fields."""
    types = layer_types(cfg, layers, source)
    if types is None:  # one kind for every layer
        # a window at least max_position_embeddings long (Phi-3-mini-128k, Ministral) holds
        # every token, but vLLM still builds a sliding-window cache for it, which kvtier's
        # connector refuses: it stays a window (found by review)
        return LayerReach((_positive(cfg, "sliding_window"),) * layers, 0)
    return _reach_of(types, cfg)


def _reach_of(types: Sequence[object], cfg: dict[str, Any]) -> LayerReach:
    window, chunk = _positive(cfg, "sliding_window"), _positive(cfg, "attention_chunk_size")
    reach: list[int | None] = []
    for t in (str(t) for t in types):
        if t in _STATE or t in _MLP_ONLY:
            reach.append(NO_KV)
        elif t in _WINDOWED:
            reach.append(window)  # no window given: full, never less than the KV can be
        elif t in _CHUNKED:
            reach.append(chunk)
        else:
            reach.append(None)
    states = sum(1 for t in types if str(t) in _STATE or str(t) in _STATE_AND_KV)
    return LayerReach(tuple(reach), states)
