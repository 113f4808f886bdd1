"""Per-layer weights of hybrid stacks: which layers mix tokens by attention or by a
recurrent state, and which have an MLP, read from config.json as vLLM builds the layers.

A Mamba-2 mixer (Nemotron-H, Bamba, Falcon-H1, Granite-4 hybrids) projects the hidden
state into x, z, B, C and dt, runs a short convolution over x, B and C, and projects
back; a gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo hybrid) projects q, k, v, z, beta and
alpha, convolves q, k and v, and projects back. Nemotron-H's layers hold one block each
(Mamba, attention, MLP or MoE: ``hybrid_override_pattern`` or ``layers_block_type``),
where the other families put an MLP after every mixer; Zamba2's layers are all Mamba, its
attention and MLP blocks shared (kvtier.plan.side_weights). Counted as attention plus MLP
in every layer, Nemotron-H-8B came out at 47 B, Zamba2 2.3x and Qwen3.5 9% short.

A state layer of a family not known here keeps the attention count: the plan may then be
off on the weights, never on the KV (kvtier.plan.layers decides which layers hold KV).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.plan.fields import MAX_DIM, opt_int

#: Single-block layer types (Nemotron-H): a layer of one of these holds its MLP only.
MLP_BLOCKS = frozenset({"mlp", "moe", "dense", "sparse"})
#: Types naming a recurrent-state mixer (no attention projections of their own).
_STATE = frozenset({"mamba", "mamba2", "linear_attention", "conv", "short_conv"})
#: Types with both attention and a Mamba mixer side by side (Falcon-H1).
_BOTH = frozenset({"hybrid"})
#: Model types whose state layers are Mamba-2 mixers.
MAMBA2_TYPES = frozenset({"nemotron_h", "bamba", "falcon_h1", "granitemoehybrid"})
#: Model types whose state layers are Mamba-1 mixers.
MAMBA1_TYPES = frozenset({"jamba"})
#: Model types whose state layers are short convolutions.
CONV_TYPES = frozenset({"lfm2"})
#: Model types whose state layers are gated DeltaNet mixers.
DELTANET_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                            "qwen3_5_moe_text", "olmo_hybrid"})


@dataclass(frozen=True, slots=True)
class LayerMixers:
    """Per layer: ``attention`` (it has Q/K/V/O projections), ``state`` (the parameters
    of its recurrent mixer, 0: none) and ``mlp`` (it has an MLP or MoE block)."""

    attention: tuple[bool, ...]
    state: tuple[int, ...]
    mlp: tuple[bool, ...]


def _first(cfg: dict[str, Any], keys: tuple[str, ...], source: str, default: int = 0) -> int:
    """The first of ``keys`` the config sets (to a positive integer), else ``default``."""
    return next((n for n in (opt_int(cfg, k, source) for k in keys) if n), default)


def _bias(cfg: dict[str, Any], keys: tuple[str, ...], default: bool) -> bool:
    value = next((cfg[k] for k in keys if isinstance(cfg.get(k), bool)), default)
    return bool(value)


def mamba2_params(cfg: dict[str, Any], hidden: int, source: str) -> int:
    """One Mamba-2 mixer (vLLM's MambaMixer2): in and out projections, the convolution,
    dt bias, A, D and the gated norm."""
    heads = _first(cfg, ("mamba_num_heads", "mamba_n_heads", "n_mamba_heads"), source, 1)
    head_dim = _first(cfg, ("mamba_head_dim", "mamba_d_head", "mamba_headdim"), source)
    expand = _first(cfg, ("expand", "mamba_expand"), source, 2)
    inner = _first(cfg, ("mamba_d_ssm",), source) or heads * head_dim or expand * hidden
    groups = _first(cfg, ("n_groups", "mamba_n_groups", "mamba_ngroups"), source, 1)
    d_state = _first(cfg, ("ssm_state_size", "mamba_d_state"), source, 128)
    kernel = _first(cfg, ("conv_kernel", "mamba_d_conv"), source, 4)
    conv_dim = inner + 2 * groups * d_state
    proj_bias = _bias(cfg, ("mamba_proj_bias", "use_bias"), False)
    in_width = 2 * inner + 2 * groups * d_state + heads
    params = hidden * in_width + (in_width if proj_bias else 0)
    params += conv_dim * kernel + (conv_dim if _bias(cfg, ("use_conv_bias", "mamba_conv_bias"),
                                                     True) else 0)
    params += 3 * heads  # dt bias, A, D
    params += inner if cfg.get("mamba_rms_norm", True) is not False else 0
    return params + inner * hidden + (hidden if proj_bias else 0)


def mamba1_params(cfg: dict[str, Any], hidden: int, source: str) -> int:
    """One Mamba-1 mixer (vLLM's MambaMixer, with Jamba's dt, B and C norms)."""
    inner = opt_int(cfg, "mamba_expand", source, 2) * hidden
    d_state = opt_int(cfg, "mamba_d_state", source, 16)
    dt_rank = opt_int(cfg, "mamba_dt_rank", source, -(-hidden // 16))
    kernel = opt_int(cfg, "mamba_d_conv", source, 4)
    proj_bias = _bias(cfg, ("mamba_proj_bias",), False)
    params = hidden * 2 * inner + (2 * inner if proj_bias else 0)
    params += inner * kernel + (inner if _bias(cfg, ("mamba_conv_bias",), True) else 0)
    params += inner * (dt_rank + 2 * d_state) + dt_rank * inner + inner  # x_proj, dt_proj
    params += inner * d_state + inner  # A, D
    params += dt_rank + 2 * d_state  # Jamba's norms of dt, B and C
    return params + inner * hidden + (hidden if proj_bias else 0)


def conv_params(cfg: dict[str, Any], hidden: int, source: str) -> int:
    """One short convolution (vLLM's ShortConv, LFM2): B, C, x in, the filter, out."""
    kernel = opt_int(cfg, "conv_L_cache", source, 3)
    bias = _bias(cfg, ("conv_bias",), False)
    return 4 * hidden * hidden + kernel * hidden + (5 * hidden if bias else 0)


def deltanet_params(cfg: dict[str, Any], hidden: int, source: str) -> int:
    """One gated DeltaNet mixer (vLLM's Qwen3-Next GatedDeltaNet)."""
    key_heads = opt_int(cfg, "linear_num_key_heads", source, 16, high=MAX_DIM)
    value_heads = opt_int(cfg, "linear_num_value_heads", source, 32, high=MAX_DIM)
    key_dim = key_heads * opt_int(cfg, "linear_key_head_dim", source, 128)
    value_head = opt_int(cfg, "linear_value_head_dim", source, 128)
    value_dim = value_heads * value_head
    kernel = opt_int(cfg, "linear_conv_kernel_dim", source, 4)
    params = hidden * (2 * key_dim + 2 * value_dim) + hidden * 2 * value_heads
    params += (2 * key_dim + value_dim) * kernel
    return params + 2 * value_heads + value_head + value_dim * hidden


def read_mixers(cfg: dict[str, Any], types: list[str] | None, hidden: int,
                source: str) -> LayerMixers | None:
    """The stack's per-layer mixers; None when every layer is attention and an MLP."""
    if types is None:
        return None
    model_type = str(cfg.get("model_type", ""))
    if model_type == "zamba2":  # every layer a Mamba mixer; its shared blocks: side_weights
        state = mamba2_params(cfg, hidden, source)
        return LayerMixers(attention=(False,) * len(types), state=(state,) * len(types),
                           mlp=(False,) * len(types))
    if model_type in MAMBA2_TYPES:
        state = mamba2_params(cfg, hidden, source)
    elif model_type in DELTANET_TYPES:
        state = deltanet_params(cfg, hidden, source)
    elif model_type in MAMBA1_TYPES:
        state = mamba1_params(cfg, hidden, source)
    elif model_type in CONV_TYPES:
        state = conv_params(cfg, hidden, source)
    else:
        state = 0   # unknown mixer: counted as attention
    single = any(t in MLP_BLOCKS for t in types)
    stateful = [bool(state) and (t in _STATE or t in _BOTH) for t in types]
    return LayerMixers(
        attention=tuple(not (s and t in _STATE) and t not in MLP_BLOCKS
                        for s, t in zip(stateful, types, strict=True)),
        state=tuple(state if s else 0 for s in stateful),
        mlp=tuple(t in MLP_BLOCKS if single else True for t in types),
    )
