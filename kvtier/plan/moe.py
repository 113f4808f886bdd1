"""Mixture-of-experts shape read from a config.json: which layers are MoE, expert widths.

Families say it in their own fields, read as vLLM's model code reads them: DeepSeek leads
with ``first_k_dense_replace`` dense layers (AFMoE and LFM2-MoE: ``num_dense_layers``),
then every ``moe_layer_freq``-th is MoE; Qwen MoEs are MoE every ``decoder_sparse_step``-th
layer except ``mlp_only_layers``, Llama-4
Maverick every ``interleave_moe_layer_step``-th (or the listed ``moe_layers``), Jamba every
``expert_layer_period``-th from ``expert_layer_offset``, and
Transformers 5 configs list ``mlp_layer_types``; the other layers have a dense MLP.
Shared experts, which every token passes through, are a count of expert-wide MLPs
(``n_shared_experts``) or one MLP of their own width (``shared_expert_intermediate_size``);
Llama-4 has one of ``intermediate_size`` that no field names. Counting every layer as
MoE, or dropping the shared experts, miscounts the weights by up to 2x (Maverick) or ~6%
(Qwen1.5-MoE, Llama-4 Scout). Ernie 4.5 and Aria count their experts in ``moe_num_experts``
and Ernie's MoE layers run from ``moe_layer_start_index`` every ``moe_layer_interval``-th.

How many routed experts each token uses (``num_experts_per_tok`` and its family spellings)
sets the active parameters, hence the prefill time kvtier saves. A config without it gets
its family's Transformers default; an unknown family's config without it is refused, since
any guess would misstate the saving (Qwen3-MoE uses 8 of 128, Llama-4 one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.plan.errors import PlanError
from kvtier.plan.fields import (
    MAX_EXPERTS,
    MAX_LAYERS,
    brief,
    int_field,
    opt_int,
    require_int,
)

#: Fields giving the shared experts' own MLP width (all of them fused into one MLP).
_SHARED_WIDTH = ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                 "shared_intermediate_size")
#: Fields giving how many shared experts there are, each as wide as a routed expert.
_SHARED_COUNT = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
#: Model types whose MoE layers hold one shared expert no config field declares
#: (Transformers' and vLLM's Llama4 MoE: ``shared_expert`` of ``intermediate_size``).
IMPLICIT_SHARED_EXPERT = frozenset({"llama4", "llama4_text"})
#: Fields giving the routed experts' count, in the order Transformers' configs use them.
_ROUTED = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
#: Fields giving how many routed experts each token uses (Transformers' attribute maps:
#: Ernie 4.5 ``moe_k``, Hunyuan/LongCat/Aria ``moe_topk``, Kimi-Linear
#: ``num_experts_per_token``, Step-3.5 ``moe_top_k``, Gemma 4 ``top_k_experts``).
_TOP_K = ("num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token", "moe_top_k",
          "top_k_experts")
#: Per model type, the experts per token that Transformers' config class (and so vLLM)
#: assumes when config.json leaves the field out (Transformers 5.19's defaults).
DEFAULT_TOP_K: dict[str, int] = {
    "mixtral": 2, "jamba": 2, "phimoe": 2, "minimax": 2, "jetmoe": 2, "granitemoe": 2,
    "granitemoeshared": 2, "granitemoehybrid": 2, "nemotron_h": 2, "cohere2_moe": 2,
    "aria_text": 2, "qwen2_moe": 4, "qwen3_vl_moe_text": 4, "gpt_oss": 4, "lfm2_moe": 4,
    "qwen3_moe": 8, "qwen3_omni_moe_text": 8, "deepseek_v3": 8, "deepseek_v32": 8,
    "glm4_moe": 8, "olmoe": 8, "minimax_m2": 8, "kimi_linear": 8, "exaone_moe": 8,
    "qwen3_next": 10, "ernie4_5_moe": 6, "afmoe": 6, "longcat_flash": 12,
    "llama4": 1, "llama4_text": 1, "hunyuan_v1_moe": 1,
}


@dataclass(frozen=True, slots=True)
class MoESpec:
    """Mixture-of-experts shape.

    ``expert_intermediate`` is one routed expert's MLP width; ``shared_intermediate`` the
    width of the shared experts fused into one MLP (0: none); ``moe_layers`` says per layer
    whether it is an MoE layer (the others have a dense MLP of the model's width).
    """

    routed_experts: int
    active_experts: int
    expert_intermediate: int
    shared_intermediate: int
    moe_layers: tuple[bool, ...]

    @property
    def dense_layers(self) -> int:
        """How many layers have a dense MLP instead of experts."""
        return self.moe_layers.count(False)


def _layer_list(cfg: dict[str, Any], key: str, layers: int, source: str) -> frozenset[int]:
    """A list of layer indices (``moe_layers``, ``mlp_only_layers``); empty when absent."""
    value = cfg.get(key)
    if value is None:
        return frozenset()
    if not isinstance(value, list) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
            for i in value):
        raise PlanError(f"{source}: config field {key!r} must be a list of layer indices "
                        f"from 0 to {layers - 1}, got {brief(value)}")
    return frozenset(value)


def moe_layer_mask(cfg: dict[str, Any], layers: int, source: str) -> tuple[bool, ...]:
    """Per layer, whether it is an MoE layer, by the rule of the family's fields."""
    kinds = cfg.get("mlp_layer_types")  # Transformers 5 spells it out per layer
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != layers or any(
                k not in ("dense", "sparse") for k in kinds):
            raise PlanError(f"{source}: config field 'mlp_layer_types' must list 'dense' or "
                            f"'sparse' for each of the {layers} layers, got {brief(kinds)}")
        return tuple(k == "sparse" for k in kinds)
    model_type = str(cfg.get("model_type", ""))
    if model_type == "jamba":  # JambaConfig.layers_num_experts
        period = opt_int(cfg, "expert_layer_period", source, 2, low=1, high=MAX_LAYERS)
        offset = opt_int(cfg, "expert_layer_offset", source, 1, high=MAX_LAYERS)
        return tuple(i % period == offset for i in range(layers))
    if model_type == "longcat_flash":  # one MoE per decoder layer of two sublayers
        return tuple(i % 2 == 1 for i in range(layers))
    if model_type.startswith("ernie4_5"):  # Ernie4_5_MoeDecoderLayer
        start = opt_int(cfg, "moe_layer_start_index", source, 1, high=MAX_LAYERS)
        end = int_field(cfg, "moe_layer_end_index", source, -1, MAX_LAYERS)
        last = layers - 1 if end is None or end < 0 else end
        interval = opt_int(cfg, "moe_layer_interval", source, 1, low=1, high=MAX_LAYERS)
        return tuple(start <= i <= last and (i + 1) % interval == 0 for i in range(layers))
    if cfg.get("moe_layers") is not None:  # Llama-4, when the config lists them
        listed = _layer_list(cfg, "moe_layers", layers, source)
        return tuple(i in listed for i in range(layers))
    step = (opt_int(cfg, "interleave_moe_layer_step", source, high=MAX_LAYERS)
            or opt_int(cfg, "decoder_sparse_step", source, 1, high=MAX_LAYERS))
    dense_only = _layer_list(cfg, "mlp_only_layers", layers, source)
    first_moe = (opt_int(cfg, "first_k_dense_replace", source, high=layers)
                 or opt_int(cfg, "num_dense_layers", source, high=layers))  # AFMoE, LFM2-MoE
    freq = opt_int(cfg, "moe_layer_freq", source, 1, high=MAX_LAYERS)
    return tuple(i not in dense_only and (i + 1) % step == 0 and i >= first_moe
                 and i % freq == 0 for i in range(layers))


def _shared_width(cfg: dict[str, Any], expert: int, source: str) -> int:
    """The shared experts' total MLP width (0 when there are none). LongCat-Flash's second
    dense MLP of a decoder layer counts as one: it sits in the sublayer with the MoE."""
    if str(cfg.get("model_type", "")) == "longcat_flash":
        return opt_int(cfg, "ffn_hidden_size", source)
    for key in _SHARED_WIDTH:
        width = opt_int(cfg, key, source)
        if width:
            return width
    for key in _SHARED_COUNT:
        count = opt_int(cfg, key, source, high=MAX_EXPERTS)
        if count:
            return count * expert
    return expert if str(cfg.get("model_type", "")) in IMPLICIT_SHARED_EXPERT else 0


def _top_k(cfg: dict[str, Any], routed: int, source: str) -> int:
    """How many routed experts each token uses: the config's field, else its family's
    default; PlanError for an unknown family that does not say."""
    for key in _TOP_K:
        top_k = int_field(cfg, key, source, 1, routed)
        if top_k is not None:
            return top_k
    model_type = str(cfg.get("model_type", ""))
    if model_type in DEFAULT_TOP_K:
        return min(DEFAULT_TOP_K[model_type], routed)
    raise PlanError(f"{source}: the config has {routed} routed experts but no "
                    f"'num_experts_per_tok' (nor {', '.join(map(repr, _TOP_K[1:]))}), and "
                    f"model_type {brief(model_type)} has no known default; add "
                    "'num_experts_per_tok' from the model card to config.json")


def _dbrx(cfg: dict[str, Any], layers: int, source: str) -> MoESpec:
    """DBRX keeps its experts in ``ffn_config`` (DbrxFFNConfig's defaults where a field is
    left out): every layer MoE, no shared expert."""
    ffn = cfg.get("ffn_config") or {}
    if not isinstance(ffn, dict):
        raise PlanError(f"{source}: config field 'ffn_config' must be an object, got "
                        f"{brief(ffn)}")
    routed = opt_int(ffn, "moe_num_experts", source, 4, low=1, high=MAX_EXPERTS,
                     label="ffn_config.moe_num_experts")
    return MoESpec(
        routed_experts=routed,
        active_experts=opt_int(ffn, "moe_top_k", source, 1, low=1, high=routed,
                               label="ffn_config.moe_top_k"),
        expert_intermediate=opt_int(ffn, "ffn_hidden_size", source, 3584, low=1,
                                    label="ffn_config.ffn_hidden_size"),
        shared_intermediate=0,
        moe_layers=(True,) * layers,
    )


def read_moe(cfg: dict[str, Any], layers: int, source: str) -> MoESpec | None:
    """The MoE shape of a config, or None for a dense model (no routed experts)."""
    if str(cfg.get("model_type", "")) == "dbrx":
        return _dbrx(cfg, layers, source)
    routed = next((n for n in (opt_int(cfg, key, source, high=MAX_EXPERTS) for key in _ROUTED)
                   if n), 0)
    if not routed:
        return None
    # an all-MoE config (Qwen3.5-MoE, DeepSeek-V4) need not give a dense intermediate_size
    expert = (opt_int(cfg, "moe_intermediate_size", source)
              or opt_int(cfg, "expert_ffn_hidden_size", source)   # LongCat-Flash
              or require_int(cfg, "intermediate_size", source))
    return MoESpec(
        routed_experts=routed,
        active_experts=_top_k(cfg, routed, source),
        expert_intermediate=expert,
        shared_intermediate=_shared_width(cfg, expert, source),
        moe_layers=moe_layer_mask(cfg, layers, source),
    )
